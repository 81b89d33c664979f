"""The engine's read-ahead hint, on and off, on the same checkpoint.

    python benchmarks/bench_readahead.py [--ids 2000000] [--rounds 8] [--cache cold|warm]

Builds compare.py's state, saves it once with recckpt, then loads it `--rounds` times per setting,
each load in a fresh process (in one process, a load's speed depends on what the previous load left
in memory, which hides the setting's own effect), alternating which setting goes first in each
round. Prints every time and the median ratio off/on (> 1: the read-ahead helps).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402

from recckpt import _C, ReadOptions  # noqa: E402

SETTINGS = {"on": _C.DEFAULT_READAHEAD_BYTES, "off": 0}


def child(path: str, setting: str, cache: str, ids: int, dim: int, threads: int) -> None:
    read_options = ReadOptions(readahead_bytes=SETTINGS[setting])
    dst, dst_opt = compare.fresh_model(compare.dense_keys(64), dim)
    (compare.drop_cache if cache == "cold" else compare.warm_cache)(path)
    t = time.perf_counter()
    compare.recckpt_load(dst, dst_opt, path, threads, read_options)
    dt = time.perf_counter() - t
    if len(dst.table) != ids:
        raise SystemExit(f"loaded {len(dst.table)} rows, saved {ids}")
    print(dt)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "SETTING"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], a.cache, a.ids, a.dim, a.threads)
        return {}
    root = tempfile.mkdtemp(prefix="recckpt-readahead-")
    path = os.path.join(root, "ckpt")
    times = {k: [] for k in SETTINGS}
    try:
        src, opt = compare.build(a.ids, a.dim, 64)
        compare.recckpt_save(src, opt, path, a.threads)
        del src, opt
        names = list(SETTINGS)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        for r in range(a.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", path, name, "--cache", a.cache,
                       "--ids", str(a.ids), "--dim", str(a.dim), "--threads", str(a.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"load with read-ahead {name} failed:\n{out.stderr}{out.stdout}")
                times[name].append(float(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"read-ahead {k:<4} load s: {' '.join(f'{x:.2f}' for x in v)}   median {med[k]:.2f}")
    ratio = med["off"] / med["on"]
    print(f"{a.cache} cache: off / on = {ratio:.2f}x (> 1: the read-ahead helps)")
    return {"times": times, "ratio_off_over_on": ratio}


if __name__ == "__main__":
    main()
