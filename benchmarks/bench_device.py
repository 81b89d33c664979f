"""Tables on a CUDA device (issue 18): the three targets as ratios against baselines of the same run.

- staging: `StagingPool.stage` over a CUDA table's export chunks (pinned buffers bounded by
  `--staging-mb`, side stream, double buffering) against one `copy_(non_blocking=True)` of the same bytes
  into a pinned buffer of their full size.                                   target >= 0.80 of that bandwidth
- save from a GPU table against the same save of the same rows from a host table. target <= 1.2x
- async stall (`CheckpointManager(async_save=True)`, a save after the first) against a sync save of the
  GPU table.                                                                 target <= 0.15x

Needs a CUDA device: on a machine without one it says so and exits with status 2.
Run:  PYTHONPATH=$PWD python benchmarks/bench_device.py --ids 2000000 --dim 64
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from recckpt import CheckpointManager, HashTable, SaveOptions, Saver, SparseAdam
from recckpt.state.staging import StagingPool


class Model(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table


def build(ids: int, dim: int, device: str):
    t = HashTable("emb", dim, device=device, capacity=ids)
    opt = SparseAdam([t])
    g = torch.Generator().manual_seed(0)
    step = 1 << 20
    for lo in range(0, ids, step):  # same rows on every device: drawn on the host, imported in chunks
        n = min(step, ids - lo)
        t.import_rows(torch.arange(lo, lo + n) * 7919,
                      {s: torch.randn(n, dim, generator=g) for s in t.slot_names})
    return t, opt


def table_bytes(t: HashTable) -> int:
    return sum(t.slot(s).numel() * t.slot(s).element_size() for s in t.slot_names) + 8 * len(t)


def timed(fn, reps):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--staging-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_device.py needs a CUDA device, and torch sees none here "
              f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda}). Run it on a GPU machine.",
              file=sys.stderr)
        sys.exit(2)

    gpu, gpu_opt = build(a.ids, a.dim, "cuda")
    cpu, cpu_opt = build(a.ids, a.dim, "cpu")
    nbytes = table_bytes(gpu)
    slots = gpu.slot_names
    staging_bytes = a.staging_mb << 20
    res = {"ids": a.ids, "dim": a.dim, "bytes": nbytes, "staging_bytes": staging_bytes,
           "device": torch.cuda.get_device_name()}

    # 1. staging vs one pinned copy of the same bytes
    cols = [gpu.slot(s) for s in slots]
    pinned = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True) for c in cols]

    def pinned_copy():
        for d, c in zip(pinned, cols):
            d.copy_(c, non_blocking=True)

    pool = StagingPool(staging_bytes)

    def staged():
        for _ in pool.stage(gpu.export_chunks(slots, 1 << 30), "emb"):
            pass

    staged()  # allocates the pinned buffers once, as the Saver's pool does on its first save
    res["pinned_copy_s"] = timed(pinned_copy, a.reps)
    res["staging_s"] = timed(staged, a.reps)
    res["staging_peak_bytes"] = pool.peak_bytes
    res["staging_over_pinned_bandwidth"] = res["pinned_copy_s"] / res["staging_s"]
    pinned.clear()  # the full-size pinned copy is only the baseline

    root = a.dir or tempfile.mkdtemp(prefix="recckpt-bench-device-")
    opts = SaveOptions(staging_bytes=staging_bytes)
    try:
        # 2. save from the GPU table vs the same save from host memory
        def saver_for(t, opt, name):
            return Saver(Model(t), sparse_optim=opt, output_dir=os.path.join(root, name), max_keep=1, options=opts)
        sg, sc = saver_for(gpu, gpu_opt, "gpu"), saver_for(cpu, cpu_opt, "cpu")
        counter = iter(range(10 ** 6))
        res["save_gpu_s"] = timed(lambda: sg.save(f"c{next(counter)}"), a.reps)
        res["save_cpu_s"] = timed(lambda: sc.save(f"c{next(counter)}"), a.reps)
        res["gpu_save_over_cpu_save"] = res["save_gpu_s"] / res["save_cpu_s"]

        # 3. async stall vs sync save, GPU table
        mgr = CheckpointManager(saver_for(gpu, gpu_opt, "async"), async_save=True)
        stalls = []
        for _ in range(a.reps + 1):
            mgr.step()
            stalls.append(mgr.save().stall_seconds)
            mgr.wait()
        mgr.close()
        res["async_first_stall_s"] = stalls[0]
        res["async_stall_s"] = statistics.median(stalls[1:])
        res["stall_over_sync"] = res["async_stall_s"] / res["save_gpu_s"]
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    print(f"table: {a.ids} ids x {a.dim} x 3 slots float32 = {gb:.2f} GB on {res['device']}; "
          f"staging {a.staging_mb} MB")
    checks = [("staging / pinned-copy bandwidth", res["staging_over_pinned_bandwidth"], ">=", 0.80),
              ("GPU save / host save", res["gpu_save_over_cpu_save"], "<=", 1.2),
              ("async stall / sync save", res["stall_over_sync"], "<=", 0.15)]
    for name, v, op, target in checks:
        ok = v >= target if op == ">=" else v <= target
        print(f"  {name:32s} {v:8.3f}   target {op} {target}  {'OK' if ok else 'MISSED'}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
