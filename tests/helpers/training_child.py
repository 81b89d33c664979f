"""A small CTR training job around CheckpointManager, for manager tests. Also runnable as a script so a
test can kill it (SIGKILL/SIGTERM) and resume it in a fresh process:

    python tests/helpers/training_child.py --out DIR --steps N --losses FILE [--async] [--interval K]
        [--preemption] [--sleep S]

Every loss goes to FILE as "<step> <float.hex(loss)>" lines, flushed, so a test compares bit for bit.
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from recckpt import CheckpointManager, HashTable, SaveOptions, Saver, SparseAdagrad  # noqa: E402

FAST = SaveOptions(num_buckets=16, chunk_bytes=1024, segment_bytes=1 << 16, fsync=False)


class CTR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable("user", dim=8)
        self.item = HashTable("item", dim=4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(8, 1))

    def forward(self, u, i):
        return self.mlp(torch.cat([self.user(u), self.item(i)], dim=1)).squeeze(1)


class ClickReader:
    """Deterministic synthetic click log; its position is IO state. Drops some negatives with NumPy's
    global RNG and jitters the batch with Python's, so every RNG matters for an exact resume."""

    def __init__(self, batch: int = 32):
        self.batch, self.position = batch, 0

    def next(self):
        g = np.random.default_rng([7, self.position])
        self.position += 1
        u = g.integers(-500, 500, self.batch)
        i = g.integers(0, 300, self.batch) * 7919
        y = (g.random(self.batch) < 0.3).astype(np.float32)
        keep = (y > 0) | (np.random.random(self.batch) < 0.7)
        keep[random.randrange(self.batch)] = True
        return (torch.from_numpy(u[keep]), torch.from_numpy(i[keep]), torch.from_numpy(y[keep]))

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, s):
        self.position = s["position"]


def make_job(out, *, interval=None, async_save=False, seed=0, **mgr_kwargs):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = CTR()
    sopt = SparseAdagrad(model, lr=0.05)
    dopt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    reader = ClickReader()
    saver = Saver(model, sparse_optim=sopt, output_dir=out, max_keep=None, options=FAST)
    mgr = CheckpointManager(saver, interval, async_save=async_save, **mgr_kwargs)
    mgr.register_for_checkpointing("dense_opt", dopt)
    mgr.register_io_state("reader", reader)
    return model, sopt, dopt, reader, mgr


def train_step(model, sopt, dopt, reader) -> float:
    u, i, y = reader.next()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u, i), y)
    sopt.zero_grad()
    dopt.zero_grad()
    loss.backward()
    sopt.step()
    dopt.step()
    return loss.item()


def run(out, steps, *, losses=None, sleep=0.0, **kw) -> list[float]:
    """Restore from `out` if it holds a checkpoint, then train to `steps`; returns the losses of the
    steps this call ran (and appends them to the `losses` file)."""
    model, sopt, dopt, reader, mgr = make_job(out, **kw)
    mgr.restore()
    got = []
    f = open(losses, "a") if losses else None
    with mgr:
        while mgr.global_step < steps:
            loss = train_step(model, sopt, dopt, reader)
            got.append(loss)
            if f:
                f.write(f"{mgr.global_step + 1} {float.hex(loss)}\n")
                f.flush()
            mgr.step()
            if sleep:
                time.sleep(sleep)
    if f:
        f.close()
    return got


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--losses", required=True)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--preemption", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    run(a.out, a.steps, losses=a.losses, sleep=a.sleep, interval=a.interval, async_save=a.async_save,
        preemption=a.preemption)
