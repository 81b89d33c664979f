"""save() and load() on many ranks against 2 ranks, the same rows in all (issue 26 item 5).

    python benchmarks/bench_ranks.py [--ranks 2,16] [--rows 1000000] [--dim 32] [--tables 8] [--adam]

Each world runs under torch.distributed.run on gloo (CPU): every rank holds the rows that
recckpt.partition gives it of one set of ids, spread over `tables` HashTables. Timed between barriers:
one sync save (fsync on), then a load of it into a fresh model on the same world. It also reports
rank 0's own save time, which includes the commit (merging every rank's index, the manifest), next to
the slowest other rank's. On a machine with
fewer cores than ranks the ranks share the cores, so more ranks cannot be faster here: the number to
read is how the cost grows with the world at a fixed amount of data.

benchmarks/bench_tables.py runs the same worker (`run_world`) for its many-tables targets: a save on one
world and a load of that checkpoint on another (`phase`), with the bytes each loading rank read against
its share of the rows.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch


def worker(a) -> None:
    import torch.distributed as dist

    from recckpt import HashTable, SaveOptions, Saver, SparseAdam, partition

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(a.rows * 4, generator=gen)[: a.rows] * 2654435761

    def model():
        m = torch.nn.Module()
        for t in range(a.tables):
            setattr(m, f"t{t}", HashTable(f"t{t}", dim=a.dim))
        if a.adam:
            SparseAdam(m, lr=0.01)   # the adam.m / adam.v slots in every table
        return m

    row_bytes = 8 + a.dim * 4 * (3 if a.adam else 1)
    save_s = own_save_s = load_s = 0.0
    if a.phase in ("both", "save"):
        src = model()
        mine = ids[partition(ids, world) == rank]
        with torch.no_grad():
            for t in range(a.tables):
                getattr(src, f"t{t}")(mine[mine % a.tables == t])
        saver = Saver(src, output_dir=a.out, options=SaveOptions(fsync=True))
        dist.barrier()
        t0 = time.perf_counter()
        saver.save("c")
        own_save_s = time.perf_counter() - t0
        dist.barrier()
        save_s = time.perf_counter() - t0
    rows, bytes_read, rchar = 0, 0, 0
    if a.phase in ("both", "load"):
        dst = model()
        dist.barrier()
        rchar0 = _rchar()
        t0 = time.perf_counter()
        res = Saver(dst, output_dir=a.out).load()
        rchar = _rchar() - rchar0
        dist.barrier()
        load_s = time.perf_counter() - t0
        bytes_read = res.bytes_read
        rows = sum(len(getattr(dst, f"t{t}")) for t in range(a.tables))
    got = [None] * world
    dist.all_gather_object(got, (rows, own_save_s, bytes_read, rchar))
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump({"world": world, "save_s": save_s, "load_s": load_s, "rows": sum(g[0] for g in got),
                       "rank0_save_s": got[0][1], "others_save_s": max((g[1] for g in got[1:]), default=0.0),
                       # per loading rank: sparse bytes the engine read, /proc/self/io rchar, its share
                       "bytes_read": [g[2] for g in got], "rchar": [g[3] for g in got],
                       "share_bytes": [g[0] * row_bytes for g in got],
                       "bytes": sum(os.path.getsize(os.path.join(d, x)) for d, _, fs in os.walk(a.out) for x in fs)}, f)
    dist.destroy_process_group()


def _rchar() -> int:
    """Bytes this process has read through system calls (page cache included), from /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return 0


def run_world(n: int, out: str, result: str, *, rows: int, dim: int, tables: int, adam: bool = False,
              phase: str = "both") -> dict:
    """One world of `n` ranks under torch.distributed.run (gloo): `phase` "save" writes checkpoint "c" to
    `out`, "load" loads it, "both" does both; returns rank 0's result (worker() above)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                    os.path.abspath(__file__), "--worker", "--out", out, "--result", result, "--rows", str(rows),
                    "--dim", str(dim), "--tables", str(tables), "--phase", phase] + (["--adam"] if adam else []),
                   check=True, env=env)
    with open(result) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,16")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--adam", action="store_true", help="SparseAdam slots in every table")
    ap.add_argument("--phase", default="both", choices=("both", "save", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    work = tempfile.mkdtemp(prefix="bench_ranks_")
    res = []
    try:
        for n in (int(x) for x in a.ranks.split(",")):
            out, result = os.path.join(work, f"w{n}"), os.path.join(work, f"w{n}.json")
            res.append(run_world(n, out, result, rows=a.rows, dim=a.dim, tables=a.tables, adam=a.adam))
            shutil.rmtree(out)
        base = res[0]
        print(f"\n{a.rows} rows x {a.dim} in {a.tables} tables; {os.cpu_count()} CPUs")
        print("| ranks | save s | load s | rank 0 save s | slowest other rank save s | bytes | save vs first | "
              "load vs first |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res:
            assert r["rows"] == base["rows"], "a world loaded other rows"
            print(f"| {r['world']} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['rank0_save_s']:.2f} | "
                  f"{r['others_save_s']:.2f} | {r['bytes'] / 1e6:.1f} MB | "
                  f"{r['save_s'] / base['save_s']:.2f} | {r['load_s'] / base['load_s']:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
