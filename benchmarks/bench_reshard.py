"""Resharding load throughput and bytes read per rank, against a load at the world size that saved.

    python benchmarks/bench_reshard.py [--rows 2000000] [--dim 32] [--table hash|dict]

Saves one table (embedding + Adagrad accumulator) as if by 4 and by 2 workers (all shards from this
process, split with recckpt.partition), then loads 4 → 2 vs 4 → 4 and 2 → 3 vs 2 → 2, one rank after
another in this process (the per-rank work a real rank would do; ranks in parallel would share the
disk). Prints, per load, MB/s per rank (wall and CPU seconds) and bytes read per rank relative to
table_bytes / M; the ratios compare runs measured in the same process. The table is recckpt's
`HashTable` (`--table dict`: the tests' `DictTable`, whose own re-sorting import then dominates).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's recckpt
from helpers.tables import DictTable  # noqa: E402
from recckpt import HashTable, SaveOptions, Saver, partition  # noqa: E402
from recckpt.state.protocol import SlotSpec  # noqa: E402


class Holder(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.emb = t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--table", choices=("hash", "dict"), default="hash")
    a = ap.parse_args()

    def new_table():
        if a.table == "dict":
            return DictTable("emb", spec)
        t = HashTable("emb", dim=a.dim)
        t.add_slot("adagrad.acc", torch.float32, (a.dim,), category="sparse_opt")
        return t

    spec = {"embedding": SlotSpec(torch.float32, (a.dim,), "sparse"),
            "adagrad.acc": SlotSpec(torch.float32, (a.dim,), "sparse_opt")}
    row_bytes = 8 + 8 * a.dim
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (a.rows,), dtype=torch.int64))
    vals = torch.randn(ids.numel(), a.dim)
    table_bytes = ids.numel() * row_bytes
    tmp = tempfile.mkdtemp(prefix="recckpt-bench-reshard-")
    opts = SaveOptions(fsync=False)
    try:
        for n in (4, 2):
            for w in range(n):
                mine = partition(ids, n) == w
                t = new_table()
                t.import_rows(ids[mine], {"embedding": vals[mine], "adagrad.acc": vals[mine].abs()})
                Saver(Holder(t), output_dir=tmp, options=opts, max_keep=None).save(f"n{n}", shard_id=w, shard_num=n)
        print(f"table: {ids.numel()} rows x {row_bytes} B = {table_bytes / 1e6:.1f} MB; chunk_bytes "
              f"{opts.chunk_bytes}, {opts.num_buckets} buckets")
        print(f"{'load':>8} {'rank MB/s (median)':>20} {'bytes/rank vs table/M':>22} {'max bytes/rank':>15}")
        results = {}
        for n, m in ((4, 4), (4, 2), (2, 2), (2, 3)):
            best = None
            for _ in range(a.repeat):
                per_rank = []
                for r in range(m):
                    t = new_table()
                    t0, c0 = time.perf_counter(), time.process_time()
                    res = Saver(Holder(t), output_dir=tmp).load(ckpt_id=f"n{n}", shard_id=r, shard_num=m,
                                                                 load_conf={"load": ["sparse", "sparse_opt"]})
                    dt = time.perf_counter() - t0
                    per_rank.append((res.bytes_read, dt, time.process_time() - c0))
                if best is None or sum(d for _, d, _ in per_rank) < sum(d for _, d, _ in best):
                    best = per_rank
            mbps = sorted(table_bytes / m / d / 1e6 for _, d, _ in best)[len(best) // 2]
            cpu_mbps = sorted(table_bytes / m / c / 1e6 for _, _, c in best)[len(best) // 2]
            ratio = max(b for b, _, _ in best) / (table_bytes / m)
            results[(n, m)] = (mbps, ratio, cpu_mbps)
            print(f"{n:>3} → {m:<3} {mbps:>20.1f} {ratio:>22.3f} {max(b for b, _, _ in best) / 1e6:>13.1f}MB"
                  f"   (per CPU second: {cpu_mbps:.1f} MB/s)")
        for (n, m), (base_n, base_m) in (((4, 2), (4, 4)), ((2, 3), (2, 2))):
            (t1, r1, c1), (t0, r0, c0) = results[(n, m)], results[(base_n, base_m)]
            print(f"{n} → {m} vs {base_n} → {base_m}: time per byte x{t0 / t1:.2f} (target <= 1.2; "
                  f"in CPU seconds x{c0 / c1:.2f}), bytes read / fair share {r1:.3f} vs {r0:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
