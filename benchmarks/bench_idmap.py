"""IdMap on one rank's share of the ids: as fast as on random ids.

    python benchmarks/bench_idmap.py [--ids 1000000] [--world 8]

A rank of W owns the buckets [r·B/W, (r+1)·B/W), and bucket = mix64(id) mod B, so all ids in its
tables (training lookups, loads) share the low bits of their hash. The engine's hash tables (IdMap, the
chain fold) take their home slots from the top bits; this measures inserts and lookups of `ids` ids of
one rank's share against as many random ids, in this run. Target: ratio <= 1.5 (it was 30-60 when homes
came from the low bits).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from recckpt import _C


def timed(ids, rounds=5):
    ins, look = [], []
    for _ in range(rounds):
        m = _C.IdMap()
        t0 = time.perf_counter()
        m.insert_new(ids)
        t1 = time.perf_counter()
        m.lookup(ids)
        look.append(time.perf_counter() - t1)
        ins.append(t1 - t0)
    return statistics.median(ins), statistics.median(look)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--buckets", type=int, default=4096)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    pool = rng.integers(-(1 << 62), 1 << 62, a.ids * a.world * 2)
    share = pool[_C.bucket_of(pool, a.buckets) < a.buckets // a.world][:a.ids].copy()
    rand = pool[:len(share)].copy()
    (ri, rl), (si, sl) = timed(rand), timed(share)
    print(f"{len(share)} ids, rank 0 of {a.world}, {a.buckets} buckets")
    print("| ids | insert s | lookup s |")
    print("|---|---|---|")
    print(f"| random | {ri:.3f} | {rl:.3f} |")
    print(f"| one rank's share | {si:.3f} ({si / ri:.2f}x) | {sl:.3f} ({sl / rl:.2f}x) |")


if __name__ == "__main__":
    main()
