"""Full-size stress run of the safety properties (docs/SAFETY.md): SIGKILL at random moments during
saves, single-byte flips / truncations of every file of a checkpoint, and ENOSPC/EIO at every storage
operation of a save. Prints trials, failures and time for each; exits non-zero on any failure.

    .venv/bin/python benchmarks/stress.py                 # 200 kills, 1000 corruptions, every fault
    .venv/bin/python benchmarks/stress.py --kills 20 --corruptions 100   # quick
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers import stress_harness as h  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--corruptions", type=int, default=1000)
    ap.add_argument("--faults", choices=["all", "sample", "none"], default="all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # Start-up recovery logs one line per leftover it removes: expected hundreds of times here.
    logging.getLogger("recckpt").setLevel(logging.ERROR)
    results = []
    with tempfile.TemporaryDirectory(prefix="recckpt-stress-") as d:
        if args.kills:
            os.makedirs(os.path.join(d, "kill"))
            results.append(h.run_kill(args.kills, os.path.join(d, "kill"), seed=args.seed))
            print(results[-1], flush=True)
        if args.corruptions:
            os.makedirs(os.path.join(d, "corruption"))
            results.append(h.run_corruption(args.corruptions, os.path.join(d, "corruption"), seed=args.seed))
            print(results[-1], flush=True)
        if args.faults != "none":
            limit = None if args.faults == "all" else 2
            results.append(h.run_faults(os.path.join(d, "faults-local"), limit_per_op=limit, seed=args.seed))
            print(results[-1], flush=True)
            fs = h.run_faults(f"memory://stress-faults-{os.getpid()}", limit_per_op=limit, seed=args.seed)
            fs.name = "faults (fsspec memory://)"
            results.append(fs)
            print(results[-1], flush=True)
    total = sum(r.trials for r in results)
    failed = sum(len(r.failures) for r in results)
    print(f"TOTAL: trials={total} failures={failed} time={sum(r.seconds for r in results):.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
