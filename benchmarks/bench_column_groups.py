"""Whole-row reads of a fixed-size table's rows: one column per slot (format version 4, `read_ranges`
straight into the rows) against column groups of 4 columns (format version 5, `read_strided`: each block's
groups read, checked, then placed into the rows), on the same rows, from the page cache (warm) and after
posix_fadvise(DONTNEED) (cold). Wall and CPU seconds (getrusage of this process, every thread), best and
median of --rounds, the two layouts alternated. Also the write side: ShardWriter with and without groups.

    python benchmarks/bench_column_groups.py [--rows 1000000] [--dim 64] [--slots 2] [--threads 4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recckpt import _C  # noqa: E402

B, CHUNK, SEG_BYTES = 4096, 256 << 10, 64 << 20


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _timed(fn) -> tuple[float, float]:
    c, t = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t, _cpu() - c


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: str, slots: list[np.ndarray], grouped: bool, threads: int):
    """One file of segments of about SEG_BYTES: (records, wall, cpu)."""
    n, rb = slots[0].shape[0], slots[0].shape[1]
    per = max(1, SEG_BYTES // (len(slots) * rb))
    w = _C.ShardWriter([path], B, CHUNK, 1 << 30)

    def go():
        for a in range(0, n, per):
            ids = np.arange(a, min(n, a + per), dtype=np.int64)
            w.submit(0, ids, [s[a:a + len(ids)] for s in slots], n, 0, [16 if grouped else 0] * len(slots), True)
        go.recs = w.finish(False)[0]
    wall, cpu = _timed(go)
    return go.recs, wall, cpu


def _requests(path, recs, dsts, grouped: bool, rb: int):
    """The engine requests that read every row of every slot into `dsts` (one [n, rb] array per slot)."""
    plain, strided, row0 = [], [], 0
    for r in recs:
        n = r["rows"]
        cols = r["columns"][1:]
        per = len(cols) // len(dsts)
        for s, dst in enumerate(dsts):
            mine = cols[s * per:(s + 1) * per]
            out = dst[row0:row0 + n].reshape(-1)
            if not grouped:
                c = mine[0]
                plain.append((path, c["offset"], c["length"], c["step"], c["crc32c"], 0, c["length"], out, 0))
            else:
                parts = [(c["offset"], c["length"], c["step"], c["crc32c"], c["length"] // n, 0, c["length"] // n,
                          16 * k, 0) for k, c in enumerate(mine)]
                strided.append((path, 0, n, out, rb, parts))
        row0 += n
    return plain, strided


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-bytes", type=int, default=None, help="read_strided's block_bytes (default: its own)")
    ap.add_argument("--direct", choices=("never", "auto", "always"), default="never",
                    help="read_strided's direct reads (default never: what a load asks for column groups, "
                         "ReadOptions.strided_direct)")
    a = ap.parse_args()
    kw = {"direct": {"never": _C.DIRECT_NEVER, "auto": _C.DIRECT_AUTO, "always": _C.DIRECT_ALWAYS}[a.direct]}
    if a.block_bytes is not None:
        kw["block_bytes"] = a.block_bytes
    rb = 4 * a.dim
    rng = np.random.default_rng(0)
    slots = [rng.integers(0, 256, size=(a.rows, rb), dtype=np.uint8) for _ in range(a.slots)]
    d = tempfile.mkdtemp(prefix="recckpt-bench-groups-")
    res = {}
    try:
        files = {}
        for rnd in range(a.rounds):
            for grouped in ((False, True) if rnd % 2 == 0 else (True, False)):
                path = os.path.join(d, f"g{int(grouped)}.bin")
                recs, wall, cpu = _write(path, slots, grouped, a.threads)
                files[grouped] = (path, recs)
                res.setdefault(("write", grouped), []).append((wall, cpu))
        dsts = [np.empty((a.rows, rb), np.uint8) for _ in slots]
        for d_ in dsts:
            d_.fill(1)   # the destination exists (a live table's storage), as in a load
        for temp in ("warm", "cold"):
            for rnd in range(a.rounds):
                for grouped in ((False, True) if rnd % 2 == 0 else (True, False)):
                    path, recs = files[grouped]
                    plain, strided = _requests(path, recs, dsts, grouped, rb)
                    if temp == "cold":
                        _drop(path)
                    else:   # warm: every page cached
                        _C.read_ranges(plain, a.threads) if plain else _C.read_strided(strided, a.threads, **kw)

                    def go():
                        _, errs = (_C.read_ranges(plain, a.threads) if plain else
                                   _C.read_strided(strided, a.threads, **kw))
                        assert not errs, errs[:1]
                    res.setdefault((temp, grouped), []).append(_timed(go))
                    for s, dst in zip(slots, dsts):
                        assert np.array_equal(s, dst)
                        dst.fill(1)
        # The device's pace for these bytes: one thread reading the grouped file front to back in 8 MiB
        # reads after DONTNEED (what a sequential reader such as DCP's gets from this disk), no placing.
        path = files[True][0]
        buf = bytearray(8 << 20)
        for rnd in range(a.rounds):
            _drop(path)

            def seq():
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            res.setdefault("seq", []).append(_timed(seq))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mb = a.rows * rb * a.slots / 2**20
    print(f"{a.rows} rows x {a.slots} slots of {a.dim} fp32 ({mb:.0f} MB), {a.threads} threads, {a.rounds} rounds, "
          f"read_strided block_bytes {a.block_bytes or 'default'}, direct {a.direct}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':22}{'v4: one column a slot':>34}{'v5: groups of 4 columns':>34}{'v5/v4 (median)':>18}")
    for what in ("write", "warm", "cold"):
        cells, meds = [], []
        for grouped in (False, True):
            v = res[(what, grouped)]
            wall, cpu = [x for x, _ in v], [y for _, y in v]
            meds.append((statistics.median(wall), statistics.median(cpu)))
            cells.append(f"{min(wall):.3f}/{statistics.median(wall):.3f} s, cpu {statistics.median(cpu):.3f} s")
        print(f"{what + ' (best/median)':22}{cells[0]:>34}{cells[1]:>34}"
              f"{meds[1][0] / meds[0][0]:>9.2f}x {meds[1][1] / meds[0][1]:.2f}x cpu")
    seq = statistics.median(w for w, _ in res["seq"])
    cold = statistics.median(w for w, _ in res[("cold", True)])
    print(f"cold sequential read of the v5 file (one thread, 8 MiB reads): {seq:.3f} s median; "
          f"v5's cold read takes {cold / seq:.2f}x it")


if __name__ == "__main__":
    main()
