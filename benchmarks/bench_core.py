"""Core save/load throughput next to torch.save/torch.load and safetensors, same data, same run.

Default state: 4M ids x 64 float32 embeddings in a HashTable with two Adam slots (adam.m, adam.v),
plus 64 MB of dense tensors (~3.1 GB in all). Every peer saves the same arrays: the table's ids and
slots exported to tensors (as a user of that peer would have to) plus the dense state_dict, and
fsyncs. Loads rebuild the HashTable from what was read. Prints GB/s and the ratio to torch.save.

    python benchmarks/bench_core.py                    # default size
    python benchmarks/bench_core.py --ids 200000       # quick
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from recckpt import HashTable, Saver, SaveOptions
from recckpt.state.optim import SparseAdam


class Model(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.table = HashTable("table", dim=dim)
        self.dense = torch.nn.ParameterDict()


def build(ids: int, dim: int, dense_mb: int, seed=0) -> tuple[Model, SparseAdam]:
    torch.manual_seed(seed)
    m = Model(dim)
    SparseAdam_ = SparseAdam(m, lr=0.01)
    m.table.reserve(ids)
    step = 1 << 20
    with torch.no_grad():
        for s in range(0, ids, step):
            m.table(torch.arange(s, min(ids, s + step), dtype=torch.int64) * 2654435761)
    for slot in ("adam.m", "adam.v"):
        m.table.slot(slot).normal_()
    n_dense = max(1, dense_mb * (1 << 20) // 4 // (1 << 20))
    for k in range(n_dense):
        m.dense[f"w{k}"] = torch.nn.Parameter(torch.randn(1 << 20))
    return m, SparseAdam_


def exported(m: Model) -> dict[str, torch.Tensor]:
    t = m.table
    out = {"table.ids": t.ids()}
    for slot in t.slot_names:
        out[f"table.{slot}"] = t.slot(slot).clone()
    out.update({k: v.detach() for k, v in m.dense.state_dict().items()})
    return out


def rebuild(m: Model, tensors: dict[str, torch.Tensor]):
    t = m.table
    t.clear_rows()
    t.import_rows(tensors["table.ids"], {s: tensors[f"table.{s}"] for s in t.slot_names})
    m.dense.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("table.")})


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def drop_caches_hint(path):
    # We cannot drop the page cache without root privileges everywhere; loads are therefore
    # "warm" for every method alike. POSIX_FADV_DONTNEED is a best-effort cold-ish read.
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dense-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="recckpt-bench-")
    os.makedirs(root, exist_ok=True)
    src, opt = build(args.ids, args.dim, args.dense_mb)
    nbytes = sum(v.numel() * v.element_size() for v in exported(src).values())
    gb = nbytes / 1e9
    results = {}

    def record(name, save_s, load_s):
        results[name] = {"save_s": save_s, "load_s": load_s, "save_GBps": gb / save_s, "load_GBps": gb / load_s}

    # recckpt
    d = os.path.join(root, "recckpt")
    saver = Saver(src, sparse_optim=opt, output_dir=d, concurrency=args.threads, options=SaveOptions())
    s_t, _ = timed(lambda: saver.save("c"))
    drop_caches_hint(d)
    dst, dst_opt = Model(args.dim), None
    dst_opt = SparseAdam(dst, lr=0.01)
    for k in src.dense.keys():
        dst.dense[k] = torch.nn.Parameter(torch.empty(1 << 20))
    l_t, _ = timed(lambda: Saver(dst, sparse_optim=dst_opt, output_dir=d, concurrency=args.threads).load())
    assert len(dst.table) == len(src.table)
    record("recckpt", s_t, l_t)
    shutil.rmtree(d)
    del dst
    # torch.save / torch.load
    p = os.path.join(root, "torch.pt")

    def tsave():
        torch.save(exported(src), p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    s_t, _ = timed(tsave)
    drop_caches_hint(root)
    dst = Model(args.dim)
    SparseAdam(dst, lr=0.01)
    for k in src.dense.keys():
        dst.dense[k] = torch.nn.Parameter(torch.empty(1 << 20))
    l_t, _ = timed(lambda: rebuild(dst, torch.load(p, weights_only=True)))
    record("torch.save", s_t, l_t)
    os.remove(p)
    # safetensors
    p = os.path.join(root, "st.safetensors")

    def ssave():
        save_file(exported(src), p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    s_t, _ = timed(ssave)
    drop_caches_hint(root)
    l_t, _ = timed(lambda: rebuild(dst, load_file(p)))
    record("safetensors", s_t, l_t)
    os.remove(p)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    base = results["torch.save"]
    print(f"state: {args.ids:,} ids x {args.dim} f32 + 2 Adam slots + {args.dense_mb} MB dense = {gb:.2f} GB; "
          f"{args.threads} threads; {os.cpu_count()} CPUs")
    print(f"{'method':<12} {'save s':>8} {'save GB/s':>10} {'vs torch':>9} {'load s':>8} {'load GB/s':>10} {'vs torch':>9}")
    for name, r in results.items():
        print(f"{name:<12} {r['save_s']:8.2f} {r['save_GBps']:10.2f} {base['save_s'] / r['save_s']:8.2f}x "
              f"{r['load_s']:8.2f} {r['load_GBps']:10.2f} {base['load_s'] / r['load_s']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
