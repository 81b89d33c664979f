"""Crash trials for incremental checkpoints, compaction and retention (tests/stress/test_crash_incremental.py
runs a sample, the slow mark more).

A child process continues the newest committed state (loading it, which makes it the parent of its next
increment), then saves step after step: mostly increments, a full checkpoint every 4th step, and after
some steps `recckpt.compact` of the newest chain into `<id>c`; retention (max_keep=2) deletes old
chains as it goes. The parent SIGKILLs it at a random moment, then checks that the newest committed
checkpoint loads, in full and resharded on two ranks, to exactly the state of its step; that it is not
older than what the child reported done; and that every listed checkpoint verifies.
"""
from __future__ import annotations

import os
import random
import signal
import time

import torch

import recckpt
from helpers.forks import forkserver_context
from helpers.stress_harness import Trials
from recckpt import HashTable, SaveOptions, Saver
from recckpt.errors import CheckpointNotFoundError

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=2048, fsync=True)
DIM = 4


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", DIM)
        self.lin = torch.nn.Linear(2, 2)


def _value(ids: torch.Tensor, step: int) -> torch.Tensor:
    return ids.double().reshape(-1, 1) * 0.5 + step + torch.arange(DIM, dtype=torch.float64)


def apply_step(m: Model, step: int) -> None:
    """Move the model from the state of step - 1 to the state of `step` (step 0: the initial state)."""
    t = m.emb
    if step == 0:
        ids = torch.arange(-300, 300, dtype=torch.int64)
        t.import_rows(ids, {"embedding": _value(ids, 0).float()})
    else:
        ids = t.ids()
        touched = ids[(ids + step) % 5 == 0]
        t.write_rows("embedding", t.lookup(touched), _value(touched, step).float())
        t.remove_ids(ids[((ids * 7 + step) % 13 == 0) & ((ids + step) % 5 != 0)])
        new = 1000 * step + torch.arange(12, dtype=torch.int64)
        t.import_rows(new, {"embedding": _value(new, step).float()})
    with torch.no_grad():
        m.lin.weight.fill_(float(step))


def expected(step: int) -> dict[int, torch.Tensor]:
    m = Model()
    for s in range(step + 1):
        apply_step(m, s)
    return dict(zip(m.emb.ids().tolist(), m.emb.weight.clone()))


def step_of(ckpt_id: str) -> int:
    return int(ckpt_id[1:7])


def _saver(out_dir, m, extras):
    s = Saver(m, output_dir=out_dir, max_keep=2, options=OPTS)
    s.register_for_checkpointing("state", extras)
    return s


def _child(out_dir: str, progress: str) -> None:
    m, extras = Model(), {"step": -1}
    s = _saver(out_dir, m, extras)
    try:
        step = step_of(s.load().ckpt_id)
    except CheckpointNotFoundError:
        step = -1
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while True:
        step += 1
        apply_step(m, step)
        extras["step"] = step
        ckpt = f"s{step:06d}"
        s.save(ckpt, incremental=step % 4 != 0)
        os.write(fd, f"{step}\n".encode())
        if step % 3 == 2:
            recckpt.compact(os.path.join(out_dir, ckpt), os.path.join(out_dir, ckpt + "c"))
            os.write(fd, f"{step}c\n".encode())


def check_state(out_dir: str, step: int) -> str | None:
    """None when the newest checkpoint loads (whole, and on 2 ranks) to exactly `step`'s state."""
    want = expected(step)
    for world in (1, 2):
        got = {}
        for rank in range(world):
            m, extras = Model(), {}
            res = _saver(out_dir, m, extras).load(shard_id=rank, shard_num=world)
            if step_of(res.ckpt_id) != step:
                return f"newest checkpoint changed under the check: {res.ckpt_id}"
            if float(m.lin.weight.detach()[0, 0]) != step:
                return f"dense state is not step {step}'s"
            got.update(zip(m.emb.ids().tolist(), m.emb.weight.clone()))
        if set(got) != set(want):
            return f"world {world}: ids differ from step {step}'s ({len(got)} vs {len(want)})"
        bad = [i for i, row in want.items() if not torch.equal(got[i], row)]
        if bad:
            return f"world {world}: rows of {len(bad)} ids differ from step {step}'s (e.g. id {bad[0]})"
    return None


def _listing(out_dir: str) -> str:
    """What a failure report needs to tell a listing problem: the version file and which directories
    hold a manifest."""
    try:
        vf = open(os.path.join(out_dir, "checkpoint")).read().split()
    except OSError as e:
        vf = f"unreadable ({e})"
    dirs = {d: os.path.exists(os.path.join(out_dir, d, "manifest.json")) for d in sorted(os.listdir(out_dir))}
    return f"version file {vf}; directories (has manifest) {dirs}"


def run_kill_incremental(n: int, work_dir: str, seed: int = 0, max_delay: float = 1.2) -> Trials:
    t0 = time.perf_counter()
    rec = Trials("kill-incremental")
    rng = random.Random(seed)
    out_dir = os.path.join(work_dir, "ckpts")
    progress = os.path.join(work_dir, "progress")
    ctx = forkserver_context()
    for trial in range(n):
        p = ctx.Process(target=_child, args=(out_dir, progress), daemon=True)
        p.start()
        time.sleep(rng.uniform(0.3, max_delay))
        if not p.is_alive():
            rec.fail(f"trial {trial}: the saving child died by itself (exit code {p.exitcode})")
        else:
            os.kill(p.pid, signal.SIGKILL)
        p.join()
        rec.trials += 1
        done = open(progress).read().split() if os.path.exists(progress) else []
        ids = [i for i in Saver(Model(), output_dir=out_dir).checkpoints()]
        if not ids:
            if done:
                rec.fail(f"trial {trial}: nothing committed after {done[-1]} was reported")
            continue
        newest = ids[-1]
        if done and step_of(newest) < int(done[-1].rstrip("c")):
            rec.fail(f"trial {trial}: newest committed {newest} is older than reported {done[-1]}; "
                     f"{_listing(out_dir)}")
        diff = check_state(out_dir, step_of(newest))
        if diff:
            rec.fail(f"trial {trial}: {newest}: {diff}")
        for ckpt in ids:
            rep = recckpt.verify(os.path.join(out_dir, ckpt))
            if not rep.ok:
                rec.fail(f"trial {trial}: listed {ckpt} does not verify: {rep.problems[0]}")
    rec.seconds = time.perf_counter() - t0
    return rec
