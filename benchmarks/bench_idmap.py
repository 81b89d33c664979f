"""IdMap on one rank's share of the ids and on chosen (hash-flooding) ids: as fast as on random ids.

    python benchmarks/bench_idmap.py [--ids 1000000] [--world 8] [--baseline DIR --pairs 9]

A rank of W owns the buckets [r·B/W, (r+1)·B/W), and bucket = mix64(id) mod B, so all ids in its
tables (training lookups, loads) share the low bits of their hash; and since mix64 is invertible, anyone
can choose ids whose hashes are 0, 4096, 8192, ... (`unmix64`). The engine's hash tables (IdMap, the
chain fold) take their home slots from the top bits of a keyed multiply-shift of a keyed mix (csrc/hash.h);
this measures inserts (`insert_new`, as a load does) and lookups of `ids` ids of one rank's share and of
chosen ids against as many random ids, in this run. Targets: ratio <= 1.5 for a rank's share, <= 2 for
chosen ids (before the key: 30-60x for a share when homes came from low bits, quadratic for chosen ids).

`--load`: also saves one table of `ids` random ids and one of as many chosen ids (dim 8) and times loads
of each into a fresh HashTable, alternating, best of `rounds` (target: chosen <= 2x random).

`--baseline DIR`: DIR is another checkout with its extension built (e.g. main before the key). Random-id
inserts and lookups are timed in child processes that alternate between DIR and this checkout, `pairs`
times; the report is the median of the per-pair ratios (target for lookups: <= 1.05).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(_C, ids, rounds=5):
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


def random_ids(n):
    return np.random.default_rng(0).integers(-(1 << 62), 1 << 62, n)


def load_times(n, rounds):
    import tempfile

    import torch

    from recckpt import HashTable, SaveOptions, Saver
    from recckpt.format.hashing import unmix64
    sets = {"random": random_ids(n), "chosen": unmix64(np.arange(n, dtype=np.uint64) * np.uint64(4096))}
    best = {k: float("inf") for k in sets}
    with tempfile.TemporaryDirectory() as d:
        for k, ids in sets.items():
            t = HashTable("t", dim=8)
            t.import_rows(torch.from_numpy(ids), {"embedding": torch.ones(n, 8)})
            Saver(torch.nn.ModuleDict({"t": t}), output_dir=os.path.join(d, k), options=SaveOptions(fsync=False)).save("c")
        for _ in range(rounds):
            for k in sets:
                m = torch.nn.ModuleDict({"t": HashTable("t", dim=8)})
                t0 = time.perf_counter()
                Saver(m, output_dir=os.path.join(d, k)).load()
                best[k] = min(best[k], time.perf_counter() - t0)
                assert len(m["t"]) == n
    print(f"| load of a checkpoint, best of {rounds} | random {best['random']:.3f} s | chosen "
          f"{best['chosen']:.3f} s ({best['chosen'] / best['random']:.2f}x) |")


def child(n, rounds):
    """Random-id timings of whichever recckpt is first on sys.path (the parent sets PYTHONPATH)."""
    from recckpt import _C
    ins, look = timed(_C, random_ids(n), rounds)
    print(json.dumps({"insert": ins, "lookup": look, "from": _C.__file__}))


def interleaved(baseline, n, pairs, rounds):
    def run(root):
        env = dict(os.environ, PYTHONPATH=root)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--ids", str(n),
                              "--rounds", str(rounds)], env=env, cwd=root, capture_output=True, text=True,
                             check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        assert r["from"].startswith(root), r["from"]   # the intended build, not an installed one
        return r
    ratios = {"insert": [], "lookup": []}
    for i in range(pairs):
        order = (baseline, ROOT) if i % 2 == 0 else (ROOT, baseline)
        got = {root: run(root) for root in order}
        for k in ratios:
            ratios[k].append(got[ROOT][k] / got[baseline][k])
    print(f"random ids, {n}: this checkout / {baseline}, {pairs} interleaved pairs of child processes "
          f"(median of {rounds} each)")
    print("| op | median ratio | min | max |")
    print("|---|---|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--buckets", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", help="another checkout (extension built) to compare random ids against")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--load", action="store_true", help="also time loads of checkpoints of random and chosen ids")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.ids, a.rounds)
    if a.baseline:
        return interleaved(os.path.abspath(a.baseline), a.ids, a.pairs, a.rounds)
    sys.path.insert(0, ROOT)
    from recckpt import _C
    from recckpt.format.hashing import unmix64
    rng = np.random.default_rng(0)
    pool = rng.integers(-(1 << 62), 1 << 62, a.ids * a.world * 2)
    share = pool[_C.bucket_of(pool, a.buckets) < a.buckets // a.world][:a.ids].copy()
    rand = pool[:len(share)].copy()
    chosen = unmix64(np.arange(len(share), dtype=np.uint64) * np.uint64(a.buckets))
    (ri, rl), (si, sl), (ci, cl) = timed(_C, rand, a.rounds), timed(_C, share, a.rounds), timed(_C, chosen, a.rounds)
    print(f"{len(share)} ids, rank 0 of {a.world}, {a.buckets} buckets")
    print("| ids | insert s | lookup s |")
    print("|---|---|---|")
    print(f"| random | {ri:.3f} | {rl:.3f} |")
    print(f"| one rank's share | {si:.3f} ({si / ri:.2f}x) | {sl:.3f} ({sl / rl:.2f}x) |")
    print(f"| chosen: mix64(id) = k*{a.buckets} | {ci:.3f} ({ci / ri:.2f}x) | {cl:.3f} ({cl / rl:.2f}x) |")
    if a.load:
        load_times(len(share), a.rounds)


if __name__ == "__main__":
    main()
