"""How this machine's disk answers the read patterns a cold load can use, on one file of --mb MB whose
pages are dropped (posix_fadvise DONTNEED, checked with mincore) before each pattern:

- `seq`: one thread, buffered reads of --block bytes front to back (the kernel's read-ahead does the rest);
- `split`: --threads threads, each buffered through its own part of the file, front to back;
- `interleaved`: --threads threads on one descriptor taking consecutive blocks in turn (a shared work queue,
  as the engine's readers do);
- `direct`: the same interleaving with O_DIRECT (no page cache: no copy out of it, no read-ahead);
- `streams`: 16 regions read side by side in --block pieces (column groups of one slot), --threads threads;
- `warm`: `seq` again without a drop (what the copy out of the page cache alone costs).

Which of these is fastest decides how a cold load should read; it differs between machines (a virtual disk
with a host cache, a local NVMe), so it is measured rather than assumed. Patterns alternate in order every
round; medians and spreads are printed.

    python benchmarks/bench_disk_patterns.py [--mb 256] [--block 1048576] [--threads 4] [--rounds 3] [--dir DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time

_LIBC = ctypes.CDLL(None, use_errno=True)


def resident_fraction(path: str) -> float:
    """The fraction of the file's pages in the page cache (mincore over a read-only mapping)."""
    import numpy as np  # the address of a read-only mapping, without copying it
    n = os.path.getsize(path)
    pages = (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        rc = _LIBC.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(n), vec)
        del view   # the mapping closes only once no view holds it
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = resident_fraction(path)
    if left > 0.01:
        raise SystemExit(f"{path}: {left:.0%} of its pages stayed in the page cache after DONTNEED; "
                         f"the cold numbers would not be cold")


def _threads(n: int, fn) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def seq(path: str, size: int, block: int, threads: int) -> None:
    buf = bytearray(block)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def split(path: str, size: int, block: int, threads: int) -> None:
    per = -(-size // threads)

    def part(i):
        buf = bytearray(block)
        with open(path, "rb", buffering=0) as f:
            for off in range(i * per, min(size, (i + 1) * per), block):
                os.preadv(f.fileno(), [buf], off)
    _threads(threads, part)


def _queue(path: str, offsets: list[int], block: int, threads: int, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    lock, it = threading.Lock(), iter(offsets)

    def work(_):
        buf = mmap.mmap(-1, block)   # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                off = next(it, None)
            if off is None:
                return
            os.preadv(fd, [buf], off)
    try:
        _threads(threads, work)
    finally:
        os.close(fd)


def interleaved(path: str, size: int, block: int, threads: int) -> None:
    _queue(path, list(range(0, size, block)), block, threads)


def direct(path: str, size: int, block: int, threads: int) -> None:
    _queue(path, list(range(0, size, block)), block, threads, os.O_DIRECT)


def streams(path: str, size: int, block: int, threads: int) -> None:
    region = size // 16 // block * block
    _queue(path, [r * region + o for o in range(0, region, block) for r in range(16)], block, threads)


PATTERNS = {"seq": seq, "split": split, "interleaved": interleaved, "direct": direct, "streams": streams}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--block", type=int, default=1 << 20)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    a = ap.parse_args(argv)
    size = a.mb << 20
    d = tempfile.mkdtemp(prefix="recckpt-disk-", dir=a.dir)
    path = os.path.join(d, "f.bin")
    try:
        with open(path, "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(a.mb):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        times: dict[str, list[float]] = {}
        names = list(PATTERNS)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                drop(path)
                t = time.perf_counter()
                PATTERNS[name](path, size, a.block, a.threads)
                times.setdefault(name, []).append(time.perf_counter() - t)
            seq(path, size, a.block, a.threads)   # the file is now cached
            t = time.perf_counter()
            seq(path, size, a.block, a.threads)
            times.setdefault("warm", []).append(time.perf_counter() - t)
    finally:
        os.unlink(path)
        os.rmdir(d)
    print(f"{a.mb} MB, blocks of {a.block >> 10} KiB, {a.threads} threads, {a.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f}")
    out = {}
    for name, v in times.items():
        med = statistics.median(v)
        out[name] = {"median_s": med, "all_s": v, "gb_per_s": size / med / 1e9}
        print(f"  {name:12} {med:.3f} s median [{min(v):.3f}-{max(v):.3f}]  {size / med / 1e9:5.2f} GB/s")
    return out


if __name__ == "__main__":
    main()
