"""save() and load() on many ranks against 2 ranks, the same rows in all (issue 26 item 5).

    python benchmarks/bench_ranks.py [--ranks 2,16] [--rows 1000000] [--dim 32] [--tables 8]

Each world runs under torch.distributed.run on gloo (CPU): every rank holds the rows that
recckpt.partition gives it of one set of ids, spread over `tables` HashTables. Timed between barriers:
one sync save (fsync on), then a load of it into a fresh model on the same world. It also reports
rank 0's own save time, which includes the commit (merging every rank's index, the manifest), next to
the slowest other rank's. On a machine with
fewer cores than ranks the ranks share the cores, so more ranks cannot be faster here: the number to
read is how the cost grows with the world at a fixed amount of data.
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

    from recckpt import HashTable, SaveOptions, Saver, partition

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(a.rows * 4, generator=gen)[: a.rows] * 2654435761

    def model():
        m = torch.nn.Module()
        for t in range(a.tables):
            setattr(m, f"t{t}", HashTable(f"t{t}", dim=a.dim))
        return m

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
    dst = model()
    dist.barrier()
    t0 = time.perf_counter()
    Saver(dst, output_dir=a.out).load()
    dist.barrier()
    load_s = time.perf_counter() - t0
    rows = sum(len(getattr(dst, f"t{t}")) for t in range(a.tables))
    got = [None] * world
    dist.all_gather_object(got, (rows, own_save_s))
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump({"world": world, "save_s": save_s, "load_s": load_s, "rows": sum(g[0] for g in got),
                       "rank0_save_s": got[0][1], "others_save_s": max((g[1] for g in got[1:]), default=0.0),
                       "bytes": sum(os.path.getsize(os.path.join(d, x)) for d, _, fs in os.walk(a.out) for x in fs)}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,16")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--tables", type=int, default=8)
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
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                            __file__, "--worker", "--out", out, "--result", result, "--rows", str(a.rows),
                            "--dim", str(a.dim), "--tables", str(a.tables)], check=True, env=env)
            with open(result) as f:
                res.append(json.load(f))
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
