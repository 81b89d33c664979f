"""recckpt next to torch.save, safetensors, torch.distributed.checkpoint and raw numpy, same state, same run.

The state is a recommendation model: N ids x D float32 embeddings in a HashTable with two Adam slots
(adam.m, adam.v), plus dense tensors. Every method saves the same bytes and fsyncs them; every peer
first exports the table to arrays (ids + one tensor per slot, as a user of that peer must) and on load
rebuilds a fresh HashTable from what it read. `raw` is a parallel pwrite + fsync of those same arrays and
a parallel pread back into one new array (no checksums, no rebuild): the disk's and memory's limit with
the same threads, which pays the same first-touch cost of new memory as a load. For each method: sync save time, load time into
a fresh model, peak extra RSS during each (sampled from /proc/self/status), bytes written.

    python benchmarks/compare.py                                   # default: 8M ids x 64 x 3 slots = 6.3 GB
    python benchmarks/compare.py --ids 4000000 --methods recckpt,torch,safetensors   # the core issue's comparison
    python benchmarks/compare.py --ids 200000 --repeat 1           # quick smoke run
    python benchmarks/compare.py --scale                           # 10 GB: 13M ids, recckpt + raw, source freed before loads

Each method and round runs in a fresh process (`--in-process` runs them all in this one): a restore
after a crash starts in a fresh process, and in a shared process a method's speed depended on what
the methods before it had left in memory. Each round also times the *fresh-memory floor*: filling the
state's size of new memory with the same thread count, which no load into new memory can beat.
Every load is timed twice (`--cache both`, the default): *cold*, after POSIX_FADV_DONTNEED of the
files (a restore on a fresh machine; bound by the disk) and *warm*, after reading the files once so
that they sit in the page cache (a restore right after the save, or from a fast file server; bound
by memory and CPU, so the software's own cost shows). Methods run interleaved, `--repeat` times;
the table reports medians.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import torch

# Measure the checkout this file is in, in this process and in every child it starts: otherwise a
# script imports whichever recckpt the environment installed (e.g. another worktree's editable install).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from recckpt import HashTable, Saver  # noqa: E402
from recckpt.state.optim import SparseAdam  # noqa: E402

ALL_METHODS = ("recckpt", "recckpt-mmap", "torch", "torch-mmap", "safetensors", "dcp", "raw")
OURS = ("recckpt", "recckpt-mmap")  # the rest are peers, except raw (the disk's limit)
SLOTS = ("embedding", "adam.m", "adam.v")


# ------------------------------------------------------------------------------------------ state
class Model(torch.nn.Module):
    def __init__(self, dim: int, dense_keys=()):
        super().__init__()
        self.table = HashTable("table", dim=dim)
        self.dense = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.empty(1 << 20)) for k in dense_keys})


def build(ids: int, dim: int, dense_mb: int, seed: int = 0) -> tuple[Model, SparseAdam]:
    torch.manual_seed(seed)
    m = Model(dim)
    opt = SparseAdam(m, lr=0.01)  # adds the adam.m / adam.v slots
    m.table.reserve(ids)
    step = 1 << 20
    with torch.no_grad():
        for s in range(0, ids, step):
            m.table(torch.arange(s, min(ids, s + step), dtype=torch.int64) * 2654435761)
    for slot in ("adam.m", "adam.v"):
        m.table.slot(slot).normal_()
    for k in dense_keys(dense_mb):
        m.dense[k] = torch.nn.Parameter(torch.randn(1 << 20))
    return m, opt


def dense_keys(dense_mb: int) -> list[str]:
    """Names of the dense tensors `build` makes: one 4 MB float32 tensor per 4 MB, at least one."""
    return [f"w{k}" for k in range(max(1, dense_mb // 4))]


def fresh_model(src_dense_keys, dim) -> tuple[Model, SparseAdam]:
    m = Model(dim, src_dense_keys)
    return m, SparseAdam(m, lr=0.01)


def exported(m: Model) -> dict[str, torch.Tensor]:
    """What a user of a generic tensor checkpointer saves: the table as arrays plus the dense state.
    Slot views are used as they are (no copy) unless they do not own their whole storage, because
    torch.save would then write the unused capacity too."""
    t = m.table
    out = {"table.ids": t.ids()}
    for s in SLOTS:
        v = t.slot(s)
        out[f"table.{s}"] = v if v.untyped_storage().nbytes() == v.nbytes else v.clone()
    out.update({f"dense.{k}": v.detach() for k, v in m.dense.items()})
    return out


def rebuild(m: Model, tensors: dict[str, torch.Tensor]) -> None:
    """What a user of a generic tensor checkpointer does on load: refill the table from the arrays."""
    t = m.table
    t.clear_rows()
    ids = tensors["table.ids"]
    t.reserve(ids.numel())
    t.import_rows(ids, {s: tensors[f"table.{s}"] for s in SLOTS})
    with torch.no_grad():
        for k, p in m.dense.items():
            p.copy_(tensors[f"dense.{k}"])


def fingerprint(m: Model, k: int = 4096) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    ids = m.table.ids()
    pick = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(1))[:k]]
    rows = m.table.lookup(pick)
    return len(m.table), pick, {s: m.table.read_rows(s, rows) for s in SLOTS}


def check(m: Model, fp, method: str) -> None:
    n, pick, vals = fp
    if len(m.table) != n:
        raise SystemExit(f"{method}: loaded {len(m.table)} rows, saved {n}")
    rows = m.table.lookup(pick)
    if bool((rows < 0).any()):
        raise SystemExit(f"{method}: sampled ids missing after load")
    for s in SLOTS:
        if not torch.equal(m.table.read_rows(s, rows), vals[s]):
            raise SystemExit(f"{method}: slot {s} differs after load")


# ---------------------------------------------------------------------------------------- helpers
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples VmRSS every few ms on a thread; `extra` = peak minus RSS at entry."""

    def __init__(self, period: float = 0.002):
        self.period = period

    def __enter__(self):
        gc.collect()
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def fresh_memory_floor(nbytes: int, threads: int) -> tuple[float, float]:
    """(seconds, CPU seconds) to fill `nbytes` of newly allocated memory with `threads` threads: a load
    that leaves the state in new memory of this process (every method here) cannot be faster than this."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.fill_(1)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        del buf
        return dt, dc
    finally:
        torch.set_num_threads(prev)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_files(path: str):
    if os.path.isfile(path):
        yield path
        return
    for root, _, files in os.walk(path):
        for f in files:
            yield os.path.join(root, f)


def fsync_tree(path: str) -> None:
    for p in tree_files(path):
        fsync_path(p)
    if os.path.isdir(path):
        fsync_path(path)
    fsync_path(os.path.dirname(path) or ".")


def warm_cache(path: str) -> None:
    """Read every file once so that its pages are in the page cache (what a warm load starts from)."""
    buf = bytearray(16 << 20)
    for p in tree_files(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cache(path: str) -> None:
    """Best effort: ask the kernel to drop these files' cached pages (no root needed)."""
    for p in tree_files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path: str) -> int:
    return sum(os.path.getsize(p) for p in tree_files(path))


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


# ---------------------------------------------------------------------------------------- methods
# Each method: save(src, opt, path, threads) and load(dst, dst_opt, path, threads). Saves include
# fsync of every file written; loads end with the model holding the state.

def recckpt_save(src, opt, path, threads):
    Saver(src, sparse_optim=opt, output_dir=path, concurrency=threads, max_keep=None).save("c")


def recckpt_load(dst, dst_opt, path, threads, read_options=None):
    Saver(dst, sparse_optim=dst_opt, output_dir=path, concurrency=threads,
          read_options=read_options).load(ckpt_id="c")


def recckpt_mmap_load(dst, dst_opt, path, threads):
    # The table's storage becomes a copy-on-write mapping of the checkpoint (LoadConfig.mmap).
    Saver(dst, sparse_optim=dst_opt, output_dir=path, concurrency=threads).load(ckpt_id="c",
                                                                               load_conf={"mmap": True})


def torch_save(src, opt, path, threads):
    torch.save(exported(src), path)
    fsync_tree(path)


def torch_load(dst, dst_opt, path, threads):
    rebuild(dst, torch.load(path, weights_only=True))


def torch_mmap_load(dst, dst_opt, path, threads):
    # torch's own mapped load: tensors view the file; the rebuild copies them into the table.
    rebuild(dst, torch.load(path, weights_only=True, mmap=True))


def st_save(src, opt, path, threads):
    from safetensors.torch import save_file
    save_file(exported(src), path)
    fsync_tree(path)


def st_load(dst, dst_opt, path, threads):
    from safetensors.torch import load_file
    rebuild(dst, load_file(path))


def dcp_save(src, opt, path, threads):
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: running single-process"
        dcp.save(exported(src), storage_writer=dcp.FileSystemWriter(path, thread_count=threads, sync_files=True))
    fsync_tree(path)


def dcp_load(dst, dst_opt, path, threads):
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    # A DCP user must preallocate every tensor before loading into it.
    sd = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)
    rebuild(dst, sd)


def raw_arrays(src):
    return [v.contiguous().view(torch.uint8).numpy() if v.dim() else v.reshape(1).view(torch.uint8).numpy()
            for v in exported(src).values()]


def raw_save(src, opt, path, threads):
    # The write limit: the same bytes into one file with `threads` threads writing 8 MiB pieces in
    # parallel (os.pwrite releases the GIL), then fsync: no checksums, no index, no layout. A save has to
    # do at least this much (issue 28 item 3 compares recckpt's save with it).
    arrays = raw_arrays(src)
    offsets, off = [], 0
    for a in arrays:
        offsets.append(off)
        off += a.nbytes
    pieces = [(a, o + p, p, min(a.nbytes, p + (8 << 20))) for a, o in zip(arrays, offsets)
              for p in range(0, a.nbytes, 8 << 20)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, off)

        def work(k):
            for a, at, lo, hi in pieces[k::threads]:
                mv = memoryview(a)[lo:hi]
                while len(mv):
                    n = os.pwrite(fd, mv, at)
                    mv, at = mv[n:], at + n
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(dst, dst_opt, path, threads):
    # The read limit: the same bytes into one new array with `threads` threads reading 8 MiB pieces
    # in parallel (os.preadv releases the GIL), no checksums, no table rebuild. A loader has to do at
    # least this much; np.fromfile, one thread, would understate the limit on this VM by 2-3x.
    size = os.path.getsize(path)
    out = np.empty(size, dtype=np.uint8)
    mv, piece = memoryview(out), 8 << 20
    fd = os.open(path, os.O_RDONLY)
    try:
        def work(k):
            for off in range(k * piece, size, piece * threads):
                end = min(size, off + piece)
                if os.preadv(fd, [mv[off:end]], off) != end - off:
                    raise OSError(f"{path}: short read at {off}")
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        os.close(fd)
    raw_load.last = out


METHODS = {
    "recckpt": (recckpt_save, recckpt_load, "ckpt"),
    "recckpt-mmap": (recckpt_save, recckpt_mmap_load, "ckpt"),
    "torch": (torch_save, torch_load, "state.pt"),
    "torch-mmap": (torch_save, torch_mmap_load, "state.pt"),
    "safetensors": (st_save, st_load, "state.safetensors"),
    "dcp": (dcp_save, dcp_load, "dcp"),
    "raw": (raw_save, raw_load, "state.raw"),
}


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=8_000_000, help="ids in the table (default 8M)")
    ap.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    ap.add_argument("--dense-mb", type=int, default=64, help="MB of dense tensors (default 64)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="recckpt concurrency and DCP thread_count (default: CPU count)")
    ap.add_argument("--methods", default=",".join(ALL_METHODS), help=f"comma list of {ALL_METHODS}")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every method, interleaved (median)")
    ap.add_argument("--seed", type=int, default=0, help="seed of each round's method order (default 0)")
    ap.add_argument("--scale", action="store_true",
                    help="the 10 GB scale run: 13M ids (x 64 x 3 slots = 10 GB) unless --ids is given, recckpt and raw only, "
                         "source freed before loading, 1 round unless --repeat is given")
    ap.add_argument("--cache", choices=("cold", "warm", "both"), default="both",
                    help="page cache before each load: cold (dropped), warm (files read once first) or both "
                         "(default; --scale: cold)")
    ap.add_argument("--free-source", action="store_true",
                    help="save every method first, then free the source model before loading (less memory)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--in-process", action="store_true",
                    help="run every method in this process instead of a fresh process per method and round. "
                         "Faster to start, but a method's speed then depends on what the methods before it "
                         "left in the process's memory (on this VM up to 2x)")
    ap.add_argument("--warm-alone", action="store_true",
                    help="with --cache both and a fresh process per method: the warm load runs in a process of its "
                         "own that loads the files the first one saved and nothing else (what a restart does), "
                         "instead of after a cold load in the same process, whose freed memory this VM has "
                         "often returned to the host (benchmarks/README.md, 'What was tried' 17)")
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)  # a child's raw results (see run)
    ap.add_argument("--keep-files", action="store_true", help=argparse.SUPPRESS)  # a child: leave the files, and
    ap.add_argument("--warm-from", default=None, help=argparse.SUPPRESS)  # their fingerprint, for a warm child
    args = ap.parse_args(argv)
    explicit = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
    if args.scale:
        if "--ids" not in explicit:
            args.ids = 13_000_000  # x 64 x 3 float32 slots + ids = 10.0 GB
        if "--methods" not in explicit:
            args.methods = "recckpt,raw"
        if "--repeat" not in explicit:
            args.repeat = 1
        if "--cache" not in explicit:
            args.cache = "cold"  # the state and its files do not both fit in this machine's memory
        args.free_source = True
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r}; choose from {', '.join(ALL_METHODS)}")
    if args.warm_alone and (args.in_process or args.cache != "both"):
        ap.error("--warm-alone needs --cache both and a fresh process per method (not --in-process)")
    if args.ids < 1 or args.dim < 1 or args.threads < 1 or args.repeat < 1 or args.dense_mb < 0:
        ap.error("--ids, --dim, --threads, --repeat must be >= 1 and --dense-mb >= 0")
    return args


def run(args) -> dict:
    """Every method and round in a fresh process (the default) or all in this one (--in-process)."""
    if args.in_process:
        runs, state_bytes, build_s, floors = run_here(args)
        return summarize(args, runs, state_bytes, build_s, floors)
    root = args.dir or tempfile.mkdtemp(prefix="recckpt-compare-")
    runs, floors, state_bytes, build_s = {m: [] for m in args.methods}, [], 0, 0.0
    try:
        for r in range(args.repeat):
            for m in order_of(args.methods, r, args.seed):
                rec_path = os.path.join(root, f"record-{m}-{r}.json")
                child_dir = os.path.join(root, f"{m}-{r}")
                cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--record", rec_path,
                       "--methods", m, "--repeat", "1", "--ids", str(args.ids), "--dim", str(args.dim),
                       "--dense-mb", str(args.dense_mb), "--threads", str(args.threads),
                       "--seed", str(args.seed), "--dir", child_dir] + (["--free-source"] if args.free_source else [])
                first = cmd + (["--cache", "cold", "--keep-files"] if args.warm_alone else ["--cache", args.cache])
                child = _child(first, rec_path, m, r)
                state_bytes, build_s = child["state_bytes"], child["build_s"]
                rec = child["runs"][m][0]
                if args.warm_alone:   # the warm load alone in a new process, from the files the first one left
                    warm = _child(cmd + ["--cache", "warm", "--warm-from", child_dir], rec_path, m, r)
                    rec.update({k: v for k, v in warm["runs"][m][0].items() if k.startswith("load_warm")})
                    shutil.rmtree(child_dir, ignore_errors=True)
                runs[m].append(rec)
                print(f"  round {r} {m:<12} " + ", ".join(
                    f"{k.replace('_s', '')} {rec[k]:.2f} s (peak +{rec[k.replace('_s', '_peak_extra_bytes')] / 2**20:.0f} MiB)"
                    for k in ("save_s", "load_s", "load_warm_s") if k in rec), flush=True)
            floors.append(fresh_memory_floor(state_bytes, args.threads))  # the size the children reported
            print(f"  round {r} fresh-memory floor {floors[-1][0]:7.2f} s (CPU {floors[-1][1]:.2f} s)", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(args, runs, state_bytes, build_s, floors)


def _child(cmd: list[str], rec_path: str, m: str, r: int) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{m}, round {r}: the child process failed:\n{out.stdout}{out.stderr}")
    with open(rec_path) as f:
        return json.load(f)


def order_of(methods: list[str], r: int, seed: int = 0) -> list[str]:
    """A new order every round (seeded, so a run can be repeated). Rotating one order is not enough:
    each method would always follow the same other one, and on this VM the process before changes the
    next one's times (the same torch.save measured 1.3 s after one method and 3.1 s after another, in
    every round)."""
    return random.Random(seed * 1_000_003 + r).sample(methods, len(methods))


def run_here(args):
    """Every method, every round, in this process: (runs, state_bytes, build_s, floors)."""
    root = args.dir or tempfile.mkdtemp(prefix="recckpt-compare-")
    os.makedirs(root, exist_ok=True)
    # The objects that exist before the run (torch's modules; a test session's) are set aside for the
    # collections between phases, which then scan only what the run made: each full gc.collect() took
    # 0.23 s after `import torch` (57 of them, 13 s of a tiny run) and ~1 s inside a test session.
    gc.freeze()
    try:
        return _run_here(args, root)
    finally:
        gc.unfreeze()


def _run_here(args, root):
    if args.warm_from:
        return _warm_only(args, root)
    t0 = time.perf_counter()
    src, opt = build(args.ids, args.dim, args.dense_mb)
    build_s = time.perf_counter() - t0
    state_bytes = sum(v.numel() * v.element_size() for v in exported(src).values())
    dense_keys = list(src.dense.keys())
    fp = fingerprint(src)
    state = {"src": src, "opt": opt}
    del src, opt  # only `state` holds the source model, so --free-source can drop it
    print(f"state: {args.ids:,} ids x {args.dim} f32 x 3 slots + {args.dense_mb} MB dense = "
          f"{state_bytes / 1e9:.2f} GB (built in {build_s:.0f} s, RSS {rss_bytes() / 1e9:.2f} GB); "
          f"threads {args.threads}; {os.cpu_count()} CPUs; methods {', '.join(args.methods)}", flush=True)
    runs = {m: [] for m in args.methods}
    floors = []

    def do_save(m, r):
        p = method_path(root, m, r)
        remove(p)
        gc.collect()
        with PeakRss() as pk:
            t, c = time.perf_counter(), time.process_time()
            METHODS[m][0](state["src"], state["opt"], p, args.threads)
            dt, dc = time.perf_counter() - t, time.process_time() - c
        rec = {"save_s": dt, "save_cpu_s": dc, "save_peak_extra_bytes": pk.extra, "bytes_written": du(p)}
        print(f"  round {r} {m:<12} save {dt:7.2f} s  peak +{pk.extra / 2**20:7.0f} MiB", flush=True)
        return rec

    def load_once(m, r, rec, cache):
        p = method_path(root, m, r)
        (drop_cache if cache == "cold" else warm_cache)(p)
        dt, dc, peak = timed_load(m, p, dense_keys, args, fp, rec["bytes_written"])
        key = "load" if cache == "cold" else "load_warm"
        rec.update({f"{key}_s": dt, f"{key}_cpu_s": dc, f"{key}_peak_extra_bytes": peak})
        print(f"  round {r} {m:<12} load {dt:7.2f} s  peak +{peak / 2**20:7.0f} MiB  ({cache} cache)", flush=True)

    def do_load(m, r, rec):
        for cache in (("cold", "warm") if args.cache == "both" else (args.cache,)):
            load_once(m, r, rec, cache)
        if args.keep_files:   # for a warm load in a process of its own (--warm-alone)
            torch.save({"n": fp[0], "pick": fp[1], "vals": fp[2], "dense_keys": dense_keys, "state_bytes": state_bytes,
                        "build_s": build_s}, os.path.join(root, FINGERPRINT))
        else:
            remove(method_path(root, m, r))

    def do_floor(r):
        if args.record:  # a child: the parent measures the floor
            return
        floors.append(fresh_memory_floor(state_bytes, args.threads))
        print(f"  round {r} fresh-memory floor {floors[-1][0]:7.2f} s (CPU {floors[-1][1]:.2f} s)", flush=True)

    try:
        if args.free_source:
            # Every round's saves first; then the source model is dropped and every file is loaded.
            for r in range(args.repeat):
                for m in order_of(args.methods, r, args.seed):
                    runs[m].append(do_save(m, r))
            state.clear()
            gc.collect()
            print(f"  source freed: RSS {rss_bytes() / 1e9:.2f} GB", flush=True)
            for r in range(args.repeat):
                do_floor(r)
                for m in order_of(args.methods, r, args.seed):
                    do_load(m, r, runs[m][r])
        else:
            for r in range(args.repeat):
                do_floor(r)
                for m in order_of(args.methods, r, args.seed):
                    rec = do_save(m, r)
                    do_load(m, r, rec)
                    runs[m].append(rec)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"runs": runs, "state_bytes": state_bytes, "build_s": build_s}, f)
    return runs, state_bytes, build_s, floors


PHASES = ("save", "load", "load_warm")  # load = cold page cache
FINGERPRINT = "fingerprint.pt"   # what a --warm-from child checks its load against


def method_path(root: str, m: str, r: int) -> str:
    """Where method `m` writes round `r`'s checkpoint under `root`."""
    return os.path.join(root, f"{m}-{r}-{METHODS[m][2]}")


def timed_load(m: str, p: str, dense_keys, args, fp, nbytes: int) -> tuple[float, float, int]:
    """Method `m` loads `p` into a fresh model, checked against `fp` (raw: `nbytes` read back): (seconds,
    CPU seconds, peak extra RSS)."""
    dst, dst_opt = fresh_model(dense_keys, args.dim)
    gc.collect()
    with PeakRss() as pk:
        t, c = time.perf_counter(), time.process_time()
        METHODS[m][1](dst, dst_opt, p, args.threads)
        dt, dc = time.perf_counter() - t, time.process_time() - c
    if m == "raw":
        if raw_load.last.size != nbytes:
            raise SystemExit("raw: read back a different number of bytes")
        raw_load.last = None
    else:
        check(dst, fp, m)
    del dst, dst_opt
    gc.collect()
    return dt, dc, pk.extra


def _warm_only(args, root):
    """A --warm-from child: nothing built or saved; the files a first child left in `root` are read once
    (warm page cache), then loaded into a fresh model, timed and checked as in `_run_here`."""
    (m,) = args.methods
    meta = torch.load(os.path.join(root, FINGERPRINT), weights_only=True)
    fp = (meta["n"], meta["pick"], meta["vals"])
    p = method_path(root, m, 0)   # (the first child ran one round: round 0)
    warm_cache(p)
    dt, dc, peak = timed_load(m, p, meta["dense_keys"], args, fp, du(p))
    rec = {"load_warm_s": dt, "load_warm_cpu_s": dc, "load_warm_peak_extra_bytes": peak}
    runs = {m: [rec]}
    with open(args.record, "w") as f:
        json.dump({"runs": runs, "state_bytes": meta["state_bytes"], "build_s": meta["build_s"]}, f)
    return runs, meta["state_bytes"], meta["build_s"], []


def summarize(args, runs: dict, state_bytes: int, build_s: float, floors: list[tuple[float, float]]) -> dict:
    """Medians, speed ratios and targets. Every phase also has its CPU seconds (`<phase>_cpu_s`: user +
    system time of all the process's threads during it) and `cpu_ratios` compares those: on a machine
    shared with other jobs, wall times of the same run swing 2x while the CPU seconds of a warm load
    stay within a few percent, so a CPU ratio can still say which method does less work."""
    walls, cpus = [f[0] for f in floors], [f[1] for f in floors]
    med = {}
    for m, recs in runs.items():
        med[m] = {k: statistics.median(r[k] for r in recs) for k in recs[0]}
        for k in PHASES:
            if f"{k}_s" in med[m]:
                med[m][f"{k}_GBps"] = state_bytes / med[m][f"{k}_s"] / 1e9
                med[m][f"{k}_s_all"] = [r[f"{k}_s"] for r in recs]
    # speed ratios: how many times faster method a is than method b (b's seconds / a's seconds)
    ratios = {a: {b: {k: med[b][f"{k}_s"] / med[a][f"{k}_s"] for k in PHASES if f"{k}_s" in med[a]}
                  for b in med if b != a} for a in med}
    cpu_ratios = {a: {b: {k: med[b][f"{k}_cpu_s"] / med[a][f"{k}_cpu_s"] for k in PHASES
                          if f"{k}_cpu_s" in med[a] and med[a][f"{k}_cpu_s"] > 0}
                      for b in med if b != a} for a in med}
    out = {"state_bytes": state_bytes, "ids": args.ids, "dim": args.dim, "dense_mb": args.dense_mb,
           "threads": args.threads, "cpus": os.cpu_count(), "repeat": args.repeat, "seed": args.seed, "build_s": build_s,
           "methods": med, "ratios": ratios, "cpu_ratios": cpu_ratios,
           "targets": targets(med, state_bytes, statistics.median(walls) if walls else None),
           "fresh_memory_floor_s": statistics.median(walls) if walls else None,
           "fresh_memory_floor_s_all": walls,
           "fresh_memory_floor_cpu_s": statistics.median(cpus) if cpus else None,
           "fresh_memory_floor_cpu_s_all": cpus, "isolated": not args.in_process,
           "warm_alone": bool(args.warm_alone)}
    return out


def peers_of(med: dict) -> list[str]:
    return [m for m in med if m not in OURS + ("raw",)]


def targets(med: dict, state_bytes: int, floor: float | None = None) -> dict:
    """Issue 28's targets, as ratios measured in this run (left out where a needed method did not run).
    Load targets are given for recckpt's default load and, as `mmap_...`, for its mapped load
    (LoadConfig.mmap); recckpt-mmap saves exactly as recckpt does."""
    peers = peers_of(med)
    t = {}
    if "recckpt" in med:
        r = med["recckpt"]
        if peers:
            best_save = min(med[p]["save_s"] for p in peers)
            t["save_vs_best_peer"] = {"value": best_save / r["save_s"], "target": 1.0}
        if "raw" in med:   # the parallel pwrite + fsync of the same bytes
            t["save_vs_parallel_raw"] = {"value": med["raw"]["save_s"] / r["save_s"], "target": 0.9}
            if "load_s" in r and "load_s" in med["raw"]:   # the parallel pread into new memory, cold
                t["load_cold_vs_parallel_pread"] = {"value": med["raw"]["load_s"] / r["load_s"], "target": 0.9}
        limit = (256 << 20) + 0.05 * state_bytes
        t["save_peak_extra_bytes"] = {"value": r["save_peak_extra_bytes"], "target_max": limit}
        if floor and "load_warm_s" in r:
            t["load_warm_vs_fresh_memory_floor"] = {"value": r["load_warm_s"] / floor, "target_max": 1.3}
    for ours, prefix, want in (("recckpt", "", 1.0), ("recckpt-mmap", "mmap_", 2.0)):
        if ours not in med or not peers:
            continue
        for k, name in (("load", "load_cold_vs_best_peer"), ("load_warm", "load_warm_vs_best_peer")):
            if f"{k}_s" in med[ours] and (ours == "recckpt" or k == "load_warm"):
                best = min(med[p][f"{k}_s"] for p in peers)
                t[prefix + name] = {"value": best / med[ours][f"{k}_s"], "target": want}
    for v in t.values():
        v["met"] = v["value"] >= v["target"] if "target" in v else v["value"] <= v["target_max"]
    return t


def print_table(res: dict) -> None:
    med = res["methods"]
    gb = res["state_bytes"] / 1e9
    print(f"\n{res['ids']:,} ids x {res['dim']} x 3 slots + {res['dense_mb']} MB dense = {gb:.2f} GB, "
          f"{res['threads']} threads, {res['cpus']} CPUs, median of {res['repeat']}"
          + ("; warm loads each in a process of their own (--warm-alone)" if res.get("warm_alone") else ""))
    phases = [k for k in PHASES if f"{k}_s" in next(iter(med.values()))]
    title = {"save": "save", "load": "load cold", "load_warm": "load warm"}
    hdr = f"{'method':<12}" + "".join(f" | {title[k] + ' s':>12} {'GB/s':>6} {'/raw':>5} {'peak+MiB':>8}" for k in phases)
    print(hdr + f" | {'written GB':>10}")
    raw = med.get("raw")
    for m, r in med.items():
        line = f"{m:<12}"
        for k in phases:
            ratio = f"{r[f'{k}_GBps'] / raw[f'{k}_GBps']:5.2f}" if raw else "    -"
            line += (f" | {r[f'{k}_s']:12.2f} {r[f'{k}_GBps']:6.3f} {ratio} "
                     f"{r[f'{k}_peak_extra_bytes'] / 2**20:8.0f}")
        print(line + f" | {r['bytes_written'] / 1e9:10.3f}")
    for ours in OURS:
        if ours in med and len(med) > 1:
            print(f"\n{ours} speed ratio (other's seconds / {ours}'s seconds; > 1 means {ours} is faster):")
            for b, v in res["ratios"][ours].items():
                print(f"  vs {b:<12}" + "".join(f" {title[k]} {v[k]:5.2f}x " for k in phases))
    print("\nCPU seconds (user + system, all threads; steadier than wall time on a shared machine):")
    for m, r in med.items():
        print(f"  {m:<12}" + "".join(f" {title[k]} {r[f'{k}_cpu_s']:6.2f}" for k in phases if f"{k}_cpu_s" in r))
    if "recckpt" in med and len(med) > 1:
        print("recckpt CPU ratio (other's CPU seconds / recckpt's; > 1 means recckpt does less work):")
        for b, v in res["cpu_ratios"]["recckpt"].items():
            print(f"  vs {b:<12}" + "".join(f" {title[k]} {v[k]:5.2f}x " for k in phases if k in v))
    floor = res["fresh_memory_floor_s"]
    peers = peers_of(med)
    if floor:
        print(f"\nfresh-memory floor: filling {gb:.2f} GB of new memory with {res['threads']} threads takes "
              f"{floor:.2f} s ({gb / floor:.2f} GB/s); no load that fills new memory can be faster "
              f"(recckpt-mmap does not fill new memory for the table); CPU {res['fresh_memory_floor_cpu_s']:.2f} s.")
    for k in ("load", "load_warm"):
        if floor and peers and any(f"{k}_s" in med.get(o, {}) for o in OURS):
            best = min(peers, key=lambda p: med[p][f"{k}_s"])
            ours = ", ".join(f"{o} {med[o][f'{k}_s'] / floor:.2f}x" for o in OURS if f"{k}_s" in med.get(o, {}))
            print(f"  {title[k]}: {ours} the floor; the best peer ({best}) {med[best][f'{k}_s'] / floor:.2f}x")
    cfloor = res["fresh_memory_floor_cpu_s"]
    if cfloor and "load_warm_cpu_s" in med.get("recckpt", {}):
        print(f"  load warm in CPU seconds: recckpt {med['recckpt']['load_warm_cpu_s'] / cfloor:.2f}x the floor's")
    if res["targets"]:
        print("\ntargets (issue 28):")
        for k, v in res["targets"].items():
            in_bytes = k.endswith("_bytes")
            want = f">= {v['target']}" if "target" in v else (
                f"<= {v['target_max'] / 2**20:.0f} MiB" if in_bytes else f"<= {v['target_max']}")
            val = f"{v['value'] / 2**20:.0f} MiB" if in_bytes else f"{v['value']:.2f}"
            print(f"  {k:<34} {val:>10}  (want {want})  {'met' if v['met'] else 'NOT met'}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.record:  # a child of run(): raw results only
        run_here(args)
        return {}
    res = run(args)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
