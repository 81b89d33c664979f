"""A/B of transparent huge pages on HashTable storage: a default load, then training steps.

Issue 28 asks each load lever to be measured before it is kept. This one is not in recckpt: on the
machine this project runs on, huge pages made loads slower (benchmarks/README.md, "What was tried").
Run it where that may differ (bare metal, another hypervisor); each round runs plain and huge in fresh
processes, alternating, and prints load seconds, page faults and the median training-step time.

    python benchmarks/bench_hugepages.py --ids 500000 --rounds 3
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from recckpt import HashTable, SaveOptions, Saver
from recckpt.state.hashtable import storage
from recckpt.state.optim import SparseAdam

MADV_HUGEPAGE = 14
HUGE = 2 << 20


class Model(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.table = HashTable("table", dim=dim)


def advise_on_growth() -> None:
    """Every storage the table allocates from now on is advised MADV_HUGEPAGE (its 2 MiB-aligned interior)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    plain = storage.RowStore.realloc

    def realloc(self, cap):
        plain(self, cap)
        for t in [*self.columns.values(), self.ids]:
            lo = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
            hi = (t.data_ptr() + t.numel() * t.element_size()) & ~(HUGE - 1)
            if hi > lo:
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    storage.RowStore.realloc = realloc


def child(args) -> None:
    if args.mode == "huge":
        advise_on_growth()
    m = Model(args.dim)
    opt = SparseAdam(m, lr=0.01)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    Saver(m, output_dir=args.dir).load()
    load_s = time.perf_counter() - t
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    ids = torch.randint(0, args.ids, (65536,)) * 2654435761
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = m.table(ids).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append(time.perf_counter() - t)
    print(f"{args.mode} {load_s:.4f} {faults} {statistics.median(steps):.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="training steps timed after each load (median)")
    ap.add_argument("--mode", choices=("plain", "huge"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    work = tempfile.mkdtemp(prefix="bench_huge_")
    try:
        m = Model(args.dim)
        SparseAdam(m, lr=0.01)
        m.table.reserve(args.ids)
        with torch.no_grad():
            m.table(torch.arange(args.ids, dtype=torch.int64) * 2654435761)
        Saver(m, output_dir=work, options=SaveOptions(fsync=False)).save("c")
        del m
        res = {"plain": [], "huge": []}
        for _ in range(args.rounds):
            for mode in ("plain", "huge"):
                out = subprocess.run([sys.executable, __file__, "--mode", mode, "--dir", work, "--ids", str(args.ids),
                                      "--dim", str(args.dim), "--steps", str(args.steps)],
                                     check=True, capture_output=True, text=True).stdout.split()
                res[mode].append((float(out[1]), int(out[2]), float(out[3])))
        for mode, rows in res.items():
            print(f"{mode:<6} load s {[round(r[0], 3) for r in rows]}  faults {[r[1] for r in rows]}  "
                  f"step ms {[round(r[2] * 1e3, 1) for r in rows]}")
        ratio = statistics.median(r[0] for r in res["huge"]) / statistics.median(r[0] for r in res["plain"])
        print(f"huge / plain load time (median): {ratio:.2f}  (< 1: huge pages help this machine's loads)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
    main()
