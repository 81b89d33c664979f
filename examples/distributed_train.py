"""Distributed training with recckpt's CheckpointManager: the design card's loop on many workers.

    torchrun --nproc_per_node=2 examples/distributed_train.py --out /tmp/run --steps 30
    torchrun --nproc_per_node=3 examples/distributed_train.py --out /tmp/run --steps 40   # resumes on 3

(scripts/distributed_example.sh trains on 2 workers, SIGKILLs the job, resumes on 2 with losses equal
to an uninterrupted run, then resumes on 3.) The manager takes its rank and world size from the process
group. Each rank owns the user ids that `recckpt.partition(ids, world) == rank` and trains on the
examples of the users it owns, so no embedding lives on two ranks; the MLP is replicated (gradients
all-reduced). `restore()` on another number of workers gives each rank exactly the rows it owns under
the new world size, keeps the global step, and reseeds the RNGs (the manager's resize_policy).
"""
from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from recckpt import CheckpointManager, HashTable, SaveOptions, Saver, SparseAdagrad, partition


class CTR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)     # identical dense init on every rank
        self.user = HashTable("user", dim=8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(8, 1))

    def forward(self, u):
        return self.mlp(self.user(u)).squeeze(1)


class Reader:
    """This worker's data position: IO state, per worker."""

    def __init__(self):
        self.batches = 0

    def dump_io_state(self):
        return {"batches": self.batches}

    def load_io_state(self, state):
        self.batches = state["batches"]


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    u = torch.randint(0, 3000, (256,), generator=g) * 7919 - 10**9
    return u, (u % 3 == 0).float()


def build(out: str, *, interval: int, async_save: bool, coordination_timeout_s: float = 60.0, **manager_kwargs):
    """The model, its optimizers, the reader and the manager of one worker."""
    model = CTR()
    sparse_opt = SparseAdagrad(model, lr=0.05)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    reader = Reader()
    saver = Saver(model, sparse_optim=sparse_opt, output_dir=out, max_keep=None,
                  options=SaveOptions(coordination_timeout_s=coordination_timeout_s))
    manager = CheckpointManager(saver, interval, async_save=async_save, **manager_kwargs)
    manager.register_for_checkpointing("dense_opt", dense_opt)
    manager.register_io_state("reader", reader)
    return model, sparse_opt, dense_opt, reader, manager


def train_step(model, sparse_opt, dense_opt, reader, step: int) -> float:
    """One data-parallel step on this rank's share of the global batch; returns the global loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    u, y = global_batch(step)
    mine = partition(u, world) == rank
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u[mine]), y[mine], reduction="sum") / 256
    sparse_opt.zero_grad()
    dense_opt.zero_grad()
    loss.backward()
    for p in model.mlp.parameters():
        dist.all_reduce(p.grad)
    sparse_opt.step()
    dense_opt.step()
    reader.batches += 1
    total = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30, help="train until this global step")
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL every worker after this step (a crash)")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.out, exist_ok=True)
    model, sparse_opt, dense_opt, reader, manager = build(os.path.join(a.out, "ckpt"), interval=a.interval,
                                                          async_save=a.async_save)
    start = manager.restore()
    if start is not None and rank == 0:
        print(f"resumed from global step {start} on {world} workers", flush=True)
    if start is not None:
        owned = bool((partition(model.user.ids(), world) == rank).all())
        print(f"[rank {rank}/{world}] restored {len(model.user)} user rows, all owned: {owned}", flush=True)
    log = open(os.path.join(a.out, f"losses-{world}.txt"), "a") if rank == 0 else None
    with manager:
        while manager.global_step < a.steps:
            loss = train_step(model, sparse_opt, dense_opt, reader, manager.global_step)
            if log:
                log.write(f"{manager.global_step + 1} {float.hex(loss)}\n")
                log.flush()
            manager.step()
            if manager.global_step == a.kill_at:
                manager.wait()   # for a deterministic example: the last save is durable, then the crash
                os.kill(os.getpid(), signal.SIGKILL)
    rows = torch.tensor([len(model.user)])
    dist.all_reduce(rows)
    if rank == 0:
        print(f"done at step {manager.global_step} on {world} workers: {int(rows)} user rows in total", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
