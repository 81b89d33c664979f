"""recckpt demo: train a small DLRM-style CTR model with async checkpoints, kill it with SIGKILL mid-run,
resume it, and show that the losses after the resume equal those of a run never interrupted.

    python examples/demo.py --out demo_output

Everything it writes goes under --out:
    uninterrupted/        checkpoints, losses.txt and stats.json of the reference run
    killed_and_resumed/   checkpoints, losses of the run before the kill and after the resume, stats.json
    summary.json          the comparison and the save statistics printed at the end
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import torch

import recckpt
from recckpt import CheckpointManager, EphemeralEveryNSteps, HashTable, KeepPolicy, SaveOptions, Saver, SparseAdagrad

DENSE_FEATURES = 13
SPARSE = {"user": 16, "item": 16, "category": 8, "city": 8}     # table name -> embedding dim
ID_SPACE = {"user": 200_000, "item": 50_000, "category": 500, "city": 2_000}


# --------------------------------------------------------------------------------------- the model
class DLRM(torch.nn.Module):
    """Bottom MLP over dense features, one HashTable per sparse feature, pairwise dot-product
    interactions, top MLP with dropout."""

    def __init__(self):
        super().__init__()
        self.tables = torch.nn.ModuleDict({n: HashTable(n, dim=d) for n, d in SPARSE.items()})
        self.proj = torch.nn.ModuleDict({n: torch.nn.Linear(d, 16, bias=False) for n, d in SPARSE.items()})
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE_FEATURES, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 16))
        k = len(SPARSE) + 1
        self.top = torch.nn.Sequential(torch.nn.Linear(16 + k * (k - 1) // 2, 64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))

    def forward(self, dense, sparse):
        vecs = [self.bottom(dense)] + [self.proj[n](self.tables[n](sparse[n])) for n in SPARSE]
        x = torch.stack(vecs, dim=1)                       # [b, k, 16]
        inter = torch.bmm(x, x.transpose(1, 2))
        i, j = torch.triu_indices(x.shape[1], x.shape[1], offset=1)
        return self.top(torch.cat([vecs[0], inter[:, i, j]], dim=1)).squeeze(1)


# ------------------------------------------------------------------------------------ the click log
class ClickLog:
    """A synthetic click log, read batch by batch. Batch k is a pure function of (seed, k), so the
    reader's position is all the state a resume needs: it is saved as IO state. Ids follow a power
    law (a few hot users and items, a long tail); labels come from a hidden logistic model. Negatives
    are downsampled with NumPy's global RNG, as many pipelines do, so the RNG state matters too."""

    def __init__(self, batch_size: int, seed: int = 2024):
        self.batch_size, self.seed, self.position = batch_size, seed, 0
        g = np.random.default_rng(seed)
        self.w_dense = g.normal(size=DENSE_FEATURES)
        self.bias = {n: g.normal(size=1024) for n in SPARSE}

    def next_batch(self):
        g = np.random.default_rng([self.seed, self.position])
        self.position += 1
        b = self.batch_size
        dense = g.normal(size=(b, DENSE_FEATURES)).astype(np.float32)
        ids = {n: (g.zipf(1.3, size=b) % ID_SPACE[n]).astype(np.int64) * 1_000_003 + i
               for i, n in enumerate(SPARSE)}
        logit = dense @ self.w_dense * 0.3 + sum(self.bias[n][ids[n] % 1024] for n in SPARSE) - 1.0
        y = (g.random(b) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        keep = (y > 0) | (np.random.random(b) < 0.5)      # downsample negatives (global RNG)
        return (torch.from_numpy(dense[keep]), {n: torch.from_numpy(v[keep]) for n, v in ids.items()},
                torch.from_numpy(y[keep]))

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, state):
        self.position = int(state["position"])


# ---------------------------------------------------------------------------------- one training run
def worker(args) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    torch.set_num_threads(1)  # deterministic and fair on a small machine; the writer gets the other core
    model = DLRM()
    sparse_opt = SparseAdagrad(model, lr=0.05)
    dense_opt = torch.optim.Adam([p for n, p in model.named_parameters()], lr=3e-3)
    reader = ClickLog(args.batch_size)
    saver = Saver(model, sparse_optim=sparse_opt, output_dir=os.path.join(args.run_dir, "ckpts"),
                  options=SaveOptions(num_buckets=256))
    manager = CheckpointManager(saver, save_interval=args.save_interval,
                                policies=[EphemeralEveryNSteps(args.save_interval // 5)],
                                keep=KeepPolicy(max_keep=2, keep_every_n_steps=args.save_interval * 4),
                                async_save=True)
    manager.register_for_checkpointing("dense_opt", dense_opt)
    manager.register_io_state("click_log", reader)
    restored = manager.restore()
    print(f"[{args.tag}] " + (f"resumed from global step {restored} ({manager.restored_from})"
                              if restored is not None else "fresh start"), flush=True)
    with open(os.path.join(args.run_dir, args.losses), "a") as log, manager:
        while manager.global_step < args.steps:
            dense, sparse, y = reader.next_batch()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), y)
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            log.write(f"{manager.global_step + 1} {float.hex(loss.item())}\n")
            log.flush()
            manager.step()
    saves = [{"ckpt_id": h.ckpt_id, "step": h.step, "ephemeral": h.ephemeral, "state": h.state,
              "stall_s": h.stall_seconds, "write_s": h.write_seconds, "bytes": h.bytes_written}
             for h in manager.saves]
    with open(os.path.join(args.run_dir, "stats.json"), "w") as f:
        json.dump({"restored_from": manager.restored_from, "saves": saves,
                   "rows": {n: len(t) for n, t in model.tables.items()}}, f, indent=1)


# -------------------------------------------------------------------------------------- orchestration
def read_losses(path):
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:
                    out[int(parts[0])] = float.fromhex(parts[1])
    return out


def spawn(args, run_dir, tag, losses):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", args.out, "--run-dir", run_dir,
           "--tag", tag, "--losses", losses, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--save-interval", str(args.save_interval)]
    return subprocess.Popen(cmd)


def main(args) -> int:
    t_start = time.perf_counter()
    out = os.path.abspath(args.out)
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"--out {out} exists and is not empty; give a new directory (the demo compares fresh runs)")
    ref_dir, run_dir = os.path.join(out, "uninterrupted"), os.path.join(out, "killed_and_resumed")
    os.makedirs(ref_dir)
    os.makedirs(run_dir)
    print(f"recckpt {recckpt.__version__} demo: {args.steps} steps of a DLRM-style CTR model "
          f"({', '.join(f'{n}:{d}' for n, d in SPARSE.items())}), async checkpoints every "
          f"{args.save_interval} steps (+ ephemeral every {args.save_interval // 5}); output in {out}", flush=True)

    print("1) reference run, never interrupted", flush=True)
    if spawn(args, ref_dir, "uninterrupted", "losses.txt").wait() != 0:
        raise SystemExit("the reference run failed")

    kill_at = args.kill_at or int(args.steps * 0.55) + 7
    print(f"2) the same run, killed with SIGKILL once it has finished step {kill_at}", flush=True)
    proc = spawn(args, run_dir, "to-be-killed", "losses_before_kill.txt")
    before_path = os.path.join(run_dir, "losses_before_kill.txt")
    while max(read_losses(before_path), default=0) < kill_at:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (exit {proc.returncode}) before it could be killed")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(read_losses(before_path))
    print(f"   killed at step {killed_at} (exit status {proc.returncode})", flush=True)

    print("3) restart: restore() picks the newest committed checkpoint and training continues", flush=True)
    if spawn(args, run_dir, "resumed", "losses_after_resume.txt").wait() != 0:
        raise SystemExit("the resumed run failed")

    ref = read_losses(os.path.join(ref_dir, "losses.txt"))
    after = read_losses(os.path.join(run_dir, "losses_after_resume.txt"))
    before = read_losses(before_path)
    mismatched = [s for s in after if ref.get(s) != after[s]] + [s for s in before if ref.get(s) != before[s]]
    resumed_from = min(after) - 1
    print(f"\nresumed at step {resumed_from + 1}, {killed_at - resumed_from} steps redone; "
          f"losses compared bit for bit on steps {resumed_from + 1}..{max(after)}:")
    for s in [resumed_from + 1, resumed_from + 2, (resumed_from + args.steps) // 2, args.steps]:
        if s in after:
            print(f"   step {s:4d}  uninterrupted {ref[s]:.10f}  resumed {after[s]:.10f}  "
                  f"{'equal' if ref[s] == after[s] else 'DIFFERENT'}")
    print(f"   {'ALL EQUAL' if not mismatched else f'{len(mismatched)} steps DIFFER'} "
          f"({len(after)} steps after the resume, {len(before)} before the kill)\n")

    rows = []
    for name, d in (("uninterrupted", ref_dir), ("resumed (after kill)", run_dir)):
        with open(os.path.join(d, "stats.json")) as f:
            st = json.load(f)
        saves = [s for s in st["saves"] if s["state"] == "durable"]
        ckpts = sorted(n for n in os.listdir(os.path.join(d, "ckpts")) if not n.startswith(".") and n != "checkpoint")
        rows.append((name, len(saves), sum(s["bytes"] for s in saves) / len(saves) / 1e6,
                     1e3 * sum(s["write_s"] for s in saves) / len(saves),
                     1e3 * sum(s["stall_s"] for s in saves) / len(saves), ", ".join(ckpts)))
    hdr = ("run", "checkpoints written", "MB per ckpt", "save time ms", "stall ms/save", "kept on disk")
    print("  ".join(f"{h:>20}" if i else f"{h:<21}" for i, h in enumerate(hdr[:5])) + f"  {hdr[5]}")
    for r in rows:
        print(f"{r[0]:<21}  {r[1]:>20}  {r[2]:>20.2f}  {r[3]:>20.1f}  {r[4]:>20.1f}  {r[5]}")
    elapsed = time.perf_counter() - t_start
    print(f"\n(save time: background write + commit; stall: time the training step spent in the save)"
          f"\ndone in {elapsed:.1f} s; everything is under {out}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"killed_at": killed_at, "resumed_from_step": resumed_from, "mismatched_steps": mismatched,
                   "equal": not mismatched, "seconds": elapsed,
                   "saves": [dict(zip(("run", "checkpoints", "mb_per_ckpt", "save_ms", "stall_ms", "kept"), r))
                             for r in rows]}, f, indent=1)
    return 0 if not mismatched else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for everything the demo writes (new or empty)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--save-interval", type=int, default=50)
    ap.add_argument("--kill-at", type=int, default=0, help="step after which to kill (default: ~55%%)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--losses", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(main(a))
