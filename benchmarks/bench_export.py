"""Serving export throughput and memory, and `ls`/`inspect` on a directory of 100 checkpoints.

    python benchmarks/bench_export.py [--rows 1000000] [--dim 64] [--repeat 2] [--listing-only]

1. Saves one table of ROWS x DIM float32 embeddings (generated chunk by chunk, never whole in memory).
2. Exports it to Parquet as fp16 two ways, each in a fresh child process, alternating, best of --repeat:
   - `recckpt.export` (what `recckpt export --format parquet --dtype fp16` runs);
   - a baseline straight script: the checkpoint's verified segment reader (the same read path), torch's
     fp16 conversion, and pyarrow writing the same columns (id int64, embedding
     fixed_size_list<float16>[DIM]) with the same writer settings (no dictionary, statistics on id).
   Reports rows/s of each, their ratio (target >= 0.8), and each child's peak RSS above its RSS just
   before the export started (target <= 256 MB for recckpt.export, whatever the size).
3. Saves 100 small checkpoints into one output directory and times `recckpt ls`, `inspect` and `verify`
   in-process (the command's own work) and as a fresh `python -m recckpt` process (interpreter start-up
   included; best of 3), beside a process that only starts Python and one that only imports torch, and
   says whether the command's process imported torch (it should not). Target: under a second.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from recckpt import SaveOptions, Saver  # noqa: E402  (after the sys.path insert: runs from a checkout)
from recckpt.state.protocol import SlotSpec, SparseTableMeta  # noqa: E402


class GeneratedTable(torch.nn.Module):
    """A save-only table whose rows are made chunk by chunk, so the benchmark's own memory stays small."""

    def __init__(self, name: str, rows: int, dim: int):
        super().__init__()
        self.name, self.rows, self.dim = name, rows, dim
        self.slots = {"embedding": SlotSpec(torch.float32, (dim,), "sparse")}

    def sparse_meta(self):
        return SparseTableMeta(self.name, self.slots, self.rows)

    def export_chunks(self, slots, max_rows):
        g = torch.Generator().manual_seed(0)
        for s in range(0, self.rows, max_rows):
            n = min(max_rows, self.rows - s)
            ids = torch.arange(s, s + n, dtype=torch.int64) * 2654435761 - (1 << 40)
            yield ids, {"embedding": torch.randn(n, self.dim, generator=g)}

    def import_rows(self, ids, columns):
        raise NotImplementedError("save-only benchmark table")

    def clear_rows(self):
        raise NotImplementedError("save-only benchmark table")

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass


class Holder(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.emb = t


CHILD = r'''
import json, os, resource, sys, time
sys.path.insert(0, {repo!r})
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, torch
import recckpt
import recckpt.tools.exporter, recckpt.tools.reader  # imported before the RSS baseline, like the baseline's modules
from recckpt.format.checkpoint import CheckpointReader
from recckpt.storage import open_storage

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

ckpt, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
pa.array(np.zeros(1))  # pyarrow's one-time pandas import, outside both measurements
before = rss()
t0 = time.perf_counter()
if mode == "recckpt":
    rows = recckpt.export(ckpt, out, recckpt.ExportOptions(format="parquet", dtype="fp16")).rows
else:  # a straight script: the verified segment reader + pyarrow, nothing else
    r = CheckpointReader(open_storage(ckpt), "")
    info = r.manifest.tables["emb"].slots["embedding"]
    dim = info.shape[0]
    os.makedirs(out + "/emb")
    w, rows = None, 0
    for ids, (emb,) in r.segments.iter_table("emb", ["embedding"], [info.row_bytes]):
        vals = torch.from_numpy(emb.view("<f4")).to(torch.float16).numpy()
        t = pa.Table.from_arrays([pa.array(ids.copy(), type=pa.int64()),
                                  pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), dim)],
                                 names=["id", "embedding"])
        if w is None:
            w = pq.ParquetWriter(out + "/emb/part-00000.parquet", t.schema, use_dictionary=False,
                                 write_statistics=["id"])
        w.write_table(t)
        rows += len(ids)
    w.close()
secs = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"rows": rows, "seconds": secs, "extra_bytes": max(0, peak - before)}}))
'''


def run_child(ckpt, out, mode):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, "-c", CHILD.format(repo=REPO), ckpt, out, mode],
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_export(tmp, rows, dim, repeat):
    out_dir = os.path.join(tmp, "run")
    t0 = time.perf_counter()
    Saver(Holder(GeneratedTable("emb", rows, dim)), output_dir=out_dir,
          options=SaveOptions(fsync=False)).save("big")
    print(f"saved {rows} x {dim} float32 ({rows * dim * 4 / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")
    ckpt = os.path.join(out_dir, "big")
    best = {}
    for _ in range(repeat):
        for mode in ("baseline", "recckpt"):
            r = run_child(ckpt, os.path.join(tmp, f"out-{mode}"), mode)
            assert r["rows"] == rows, r
            if mode not in best or r["seconds"] < best[mode]["seconds"]:
                best[mode] = r
    for mode, r in best.items():
        print(f"{mode:9s} {rows / r['seconds'] / 1e6:6.2f} M rows/s  ({r['seconds']:.2f}s)  "
              f"peak extra memory {r['extra_bytes'] / 2**20:6.0f} MiB")
    ratio = best["baseline"]["seconds"] / best["recckpt"]["seconds"]
    print(f"export / baseline throughput: {ratio:.2f}x (target >= 0.8x); recckpt.export peak extra memory "
          f"{best['recckpt']['extra_bytes'] / 2**20:.0f} MiB (target <= 256 MiB)")
    return best, ratio


def bench_listing(tmp, n=100):
    from recckpt.cli import main
    out_dir = os.path.join(tmp, "many")
    t = GeneratedTable("emb", 1000, 16)
    s = Saver(Holder(t), output_dir=out_dir, max_keep=None, options=SaveOptions(fsync=False))
    for i in range(n):
        s.save(f"ckpt_{i:04d}")
    devnull = open(os.devnull, "w")
    env = {**os.environ, "PYTHONPATH": REPO}

    def best_of(cmd, k=3):
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
            times.append(time.perf_counter() - t0)
        return min(times)

    bare = best_of([sys.executable, "-c", "pass"])
    startup = best_of([sys.executable, "-c", "import torch"])
    print(f"reference: a new process that only starts Python: {bare:.2f}s; that only imports torch: {startup:.2f}s")
    res = {"bare": bare, "startup": startup}
    newest = os.path.join(out_dir, f"ckpt_{n - 1:04d}")
    probe = ("import runpy, sys; sys.argv = ['recckpt'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('recckpt', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    for verb, arg in (("ls", out_dir), ("inspect", newest), ("verify", newest)):
        old = sys.stdout
        sys.stdout = devnull
        try:
            t0 = time.perf_counter()
            code = main([verb, arg])
            inproc = time.perf_counter() - t0
        finally:
            sys.stdout = old
        assert code == 0
        whole = best_of([sys.executable, "-m", "recckpt", verb, arg])
        p = subprocess.run([sys.executable, "-c", probe, verb, arg], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=env)
        imported = p.stderr.strip().splitlines()[-1] == "True"
        res[verb] = (inproc, whole, imported)
        what = f"the directory of {n} checkpoints" if verb == "ls" else "the newest of them"
        print(f"recckpt {verb:7s} {what}: {inproc:.3f}s in-process, {whole:.2f}s as a new process "
              f"(target < 1s); torch imported: {imported}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--listing-only", action="store_true", help="only the ls/inspect/verify timings")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-export-")
    try:
        if not a.listing_only:
            bench_export(tmp, a.rows, a.dim, a.repeat)
        bench_listing(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
