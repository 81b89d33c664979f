"""Incremental checkpoints (issue 16): what change tracking costs in training, and what increments save.

    python benchmarks/bench_incremental.py [--rows 4000000] [--dim 64] [--steps 30] [--batch 4096] [--rounds 3]

1. Tracking cost: lookup + backward + SparseAdam step on a HashTable with change tracking on and off,
   the same id batches, the two tables taking turns step by step; reports the median per-step ratio
   (target: on/off <= 1.05).
2. Increments: one table of `rows` rows, dim `dim`, Adam slots (embedding + adam.m + adam.v). For 1%,
   5% and 20% of the rows touched (all three slots rewritten, as an optimizer step does), an increment
   and then a full save of the same state, `rounds` times; bytes written and the best save times.
3. Chain loads: a base plus 1, 5 and 10 increments of 5% each, loaded against a full checkpoint of the
   same state; and `recckpt.compact` of the 10-increment chain against a full save of the result, with
   fsync off and on.
All ratios compare runs in this process, on this machine, in this run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import recckpt
from recckpt import HashTable, SaveOptions, Saver, SparseAdam


class Model(torch.nn.Module):
    def __init__(self, dim, track=True, capacity=0):
        super().__init__()
        self.emb = HashTable("emb", dim, track_changes=track, capacity=capacity)


def tracking_cost(rows, dim, steps, batch, rounds=10):
    """Median seconds of one training step with tracking on and off, and the median of the per-step
    ratios. The two tables take turns step by step (the order swapped every step), so that what the
    rest of a shared machine does lands on both sides alike."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, rows, (batch,), generator=gen) for _ in range(steps)]
    models = {}
    for track in (True, False):
        m = Model(dim, track, capacity=rows)
        m.emb(torch.arange(rows))
        opt = SparseAdam([m.emb], lr=0.01)
        models[track] = (m, opt)
    times = {True: [], False: []}
    for r in range(rounds):
        for i, ids in enumerate(batches):
            for track in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                m, opt = models[track]
                t0 = time.perf_counter()
                m.emb(ids).sum().backward()
                opt.step()
                opt.zero_grad()
                times[track].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return statistics.median(times[True]), statistics.median(times[False]), statistics.median(ratios)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def touch(table, frac, gen):
    n = len(table)
    rows = torch.randperm(n, generator=gen)[: max(1, int(n * frac))]
    for slot in ("embedding", "adam.m", "adam.v"):
        table.write_rows(slot, rows, torch.randn(rows.numel(), table.dim, generator=gen))


def timed(fn):
    # Start every timed step with no dirty pages left by the one before: the kernel writes them back in
    # the background, and that work would land on whichever step happens to run next.
    os.sync()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the loads (best of them counts)")
    ap.add_argument("--compaction-rounds", type=int, default=5,
                    help="alternating rounds of compaction and full save (best of them counts)")
    a = ap.parse_args()
    opts = SaveOptions(fsync=False)
    print(f"rows={a.rows} dim={a.dim} (Adam slots: {8 + 3 * 4 * a.dim} bytes a row)")

    on, off, ratio = tracking_cost(min(a.rows, 1_000_000), a.dim, a.steps, a.batch)
    print(f"\n| training step (lookup+backward+SparseAdam, batch {a.batch}) | ms a step (median) | "
          f"ratio (median of per-step ratios) |")
    print("|---|---|---|")
    print(f"| tracking off | {off * 1e3:.2f} | 1.000 |")
    print(f"| tracking on | {on * 1e3:.2f} | {ratio:.3f} |")

    root = a.dir or tempfile.mkdtemp(prefix="bench-incr-")
    try:
        gen = torch.Generator().manual_seed(1)
        m = Model(a.dim, capacity=a.rows)
        m.emb(torch.arange(a.rows))
        SparseAdam([m.emb], lr=0.01)._ensure_slots(m.emb)
        out = os.path.join(root, "run")
        s = Saver(m, output_dir=out, max_keep=None, options=opts)
        s.save("start")
        # Per round: touch the rows, save an increment, then a full checkpoint of the same state (the
        # next increment's parent); the best of the rounds counts for each.
        print("\n| save | bytes | bytes vs full | seconds (best) | full save of the same state, s | "
              "speed-up vs full |")
        print("|---|---|---|---|---|---|")
        prev = "start"
        for frac in (0.01, 0.05, 0.20):
            inc_t = full_t = float("inf")
            for r in range(a.rounds):
                touch(m.emb, frac, gen)
                inc, full = f"inc{frac}_{r}", f"full{frac}_{r}"
                inc_t = min(inc_t, timed(lambda: s.save(inc, incremental=True))[0])
                full_t = min(full_t, timed(lambda: s.save(full))[0])
                b, full_b = dir_bytes(os.path.join(out, inc)), dir_bytes(os.path.join(out, full))
                recckpt.delete(out, [inc, prev])
                prev = full
            print(f"| increment, {frac:.0%} touched | {b / 1e6:.1f} MB | {b / full_b:.3f} | {inc_t:.3f} | "
                  f"{full_t:.3f} | {full_t / inc_t:.1f}x |")
        shutil.rmtree(out)

        # chains of 5% increments
        out = os.path.join(root, "chain")
        s = Saver(m, output_dir=out, max_keep=None, options=opts)
        s.save("base")
        for k in range(1, 11):
            touch(m.emb, 0.05, gen)
            s.save(f"i{k}", incremental=True)
        s.save("full")   # the same state as i10, full

        def load(ckpt):
            m2 = Model(a.dim)
            SparseAdam([m2.emb], lr=0.01)._ensure_slots(m2.emb)
            return timed(lambda: Saver(m2, output_dir=out, options=opts).load(ckpt_id=ckpt))[0]

        # state of i1 / i5 as full checkpoints: replay is not possible, so compare with the full i10
        # state (same row count; every link adds no rows, so a full checkpoint of each state is as big).
        # Rounds alternate the loads, and each keeps its best: on a shared machine the other jobs' load
        # changes within seconds, and the best of a few rounds is what the code itself costs.
        names = ["full", "i1", "i5", "i10"]
        best = dict.fromkeys(names, float("inf"))
        for _ in range(a.rounds):
            for ck in names:
                best[ck] = min(best[ck], load(ck))
        full_load = best["full"]
        print("\n| load | seconds | vs full checkpoint of the same size |")
        print("|---|---|---|")
        print(f"| full | {full_load:.2f} | 1.00 |")
        for k in (1, 5, 10):
            t = best[f"i{k}"]
            print(f"| base + {k} increments (5% each) | {t:.2f} | {t / full_load:.2f} |")
        # Each round's outputs are deleted before the next: the page cache of a 2-core test machine then
        # holds the same data for every round. Both with fsync off (the page cache absorbs the writes:
        # what the CPU work costs) and with the default fsync on (the bytes reach the disk).
        print("\n| fsync | compaction of base + 10 increments, s | full save of the result, s | "
              "speed vs full save |")
        print("|---|---|---|---|")
        for fsync in (False, True):
            saver = Saver(m, output_dir=out, max_keep=None, options=SaveOptions(fsync=fsync))
            ct = st = float("inf")
            for _ in range(a.compaction_rounds):
                ct = min(ct, timed(lambda: recckpt.compact(os.path.join(out, "i10"), os.path.join(out, "folded"),
                                                           fsync=fsync))[0])
                st = min(st, timed(lambda: saver.save("full_again"))[0])
                recckpt.delete(out, ["folded", "full_again"])
            print(f"| {'on' if fsync else 'off'} | {ct:.2f} | {st:.2f} | {st / ct:.2f} |")
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
