"""Per-step cost of CheckpointManager.step() on 2 ranks (gloo, CPU), with EveryNSeconds and preemption
on (one small collective per step on recckpt's own group), against the same training loop without a
manager. Both loops run in the same processes, interleaved in rounds, so machine noise hits both.

    .venv/bin/python benchmarks/bench_manager_step.py [--steps 2000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def worker(rank, world, port, steps, rounds, out):
    import torch.distributed as dist

    from recckpt import CheckpointManager, EveryNSeconds, Saver
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)

    def train_step():
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()

    saver = Saver(model, output_dir=os.path.join(out, "ckpt"))
    mgr = CheckpointManager(saver, policies=[EveryNSeconds(3600)], preemption=True, save_rng=False)
    bare, managed, step_only = [], [], []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step()
        bare.append((time.perf_counter() - t0) / steps)
        dist.barrier()
        t0, in_step = time.perf_counter(), 0.0
        for _ in range(steps):
            train_step()
            s = time.perf_counter()
            mgr.step()
            in_step += time.perf_counter() - s
        managed.append((time.perf_counter() - t0) / steps)
        step_only.append(in_step / steps)
    mgr.close()
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"bare": bare, "managed": managed, "step_only": step_only}, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, port, a.steps, a.rounds, out), nprocs=2)
        with open(os.path.join(out, "result.json")) as f:
            r = json.load(f)
    bare, managed, step_only = (statistics.median(r[k]) for k in ("bare", "managed", "step_only"))
    print("| loop (2 ranks, gloo) | per step | vs bare |")
    print("|---|---|---|")
    print(f"| bare training step | {bare * 1e6:.1f} µs | 1.00x |")
    print(f"| + manager.step() (EveryNSeconds + preemption) | {managed * 1e6:.1f} µs | {managed / bare:.2f}x |")
    print(f"| of which manager.step() itself | {step_only * 1e6:.1f} µs | |")


if __name__ == "__main__":
    main()
