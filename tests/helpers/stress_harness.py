"""Crash, corruption and storage-fault trials, shared by the tests (a small sample) and
benchmarks/stress.py (full size). Each `run_*` returns a `Trials` record: count, failures (with a line
per failure saying what went wrong), seconds.

- kill: a child process saves step after step; the parent SIGKILLs it at a random moment, then checks
  that restoring gives the newest fully committed step with exactly that step's contents, that every
  listed checkpoint verifies, and that the next child's save succeeds.
- corruption: flip one byte or truncate one file of a saved checkpoint; loading it by id and verify()
  must both report CorruptCheckpointError naming that file; the model must not be told a wrong value.
- faults: fail each Python storage operation and engine write/fsync of a save in turn, with ENOSPC or
  EIO; the save must fail with CheckpointSaveError (or succeed when the fault hit post-commit
  housekeeping), every listed checkpoint must verify and load, and the next save must succeed.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import signal
import time
import warnings
from dataclasses import dataclass, field

import torch

import recckpt
from helpers.forks import forkserver_context
from recckpt import HashTable, SaveOptions, Saver
from recckpt.errors import CheckpointNotFoundError, CheckpointSaveError, CorruptCheckpointError
from recckpt.storage.faulty import OPS, FaultyStorage

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=True)


@dataclass
class Trials:
    name: str
    trials: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    not_reached: int = 0   # fault positions a save happened not to reach (timing-dependent op counts)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)

    def __str__(self) -> str:
        return (f"{self.name}: trials={self.trials} failures={len(self.failures)} time={self.seconds:.1f}s"
                + (f" not_reached={self.not_reached}" if self.not_reached else "")
                + "".join(f"\n  FAIL {f}" for f in self.failures[:20]))


# ------------------------------------------------------------------------------------ model state
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable("user", dim=8)
        self.item = HashTable("item", dim=4)
        self.lin = torch.nn.Linear(4, 3)


class Reader:
    """Registered IO state: a reader position."""

    def __init__(self, pos=0):
        self.pos = pos

    def dump_io_state(self):
        return {"pos": self.pos}

    def load_io_state(self, state):
        self.pos = state["pos"]


# Operations whose count per save varies from run to run (see run_faults).
TIMING_DEPENDENT_OPS = frozenset({"engine_write"})

def set_step_state(model: Model, extras: dict, reader: Reader, step: int) -> None:
    """Deterministic contents for `step`: a different id set and different values every step."""
    g = torch.Generator().manual_seed(step)
    n = 200 + (step * 37) % 150
    for table, dim in ((model.user, 8), (model.item, 4)):
        table.clear_rows()
        ids = torch.randperm(4 * n, generator=g)[:n] - 2 * n
        table.import_rows(ids, {"embedding": torch.randn(n, dim, generator=g)})
    with torch.no_grad():
        for p in model.lin.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    extras.clear()
    extras.update({"step": step, "w": torch.randn(5, generator=g)})
    reader.pos = step * 1000


def make_saver(out_dir, model, extras, reader, max_keep=2, opts=OPTS) -> Saver:
    s = Saver(model, output_dir=out_dir, max_keep=max_keep, concurrency=2, options=opts)
    s.register_for_checkpointing("state", extras)
    s.register_io_state("reader", reader)
    return s


def step_of(ckpt_id: str) -> int:
    return int(ckpt_id[1:])


def check_restored_equals_step(model, extras, reader, step) -> str | None:
    """None when the restored objects hold exactly `step`'s contents, else what differs."""
    em, ee, er = Model(), {}, Reader()
    set_step_state(em, ee, er, step)
    for name in ("user", "item"):
        a, b = getattr(model, name), getattr(em, name)
        ia, ib = a.ids(), b.ids()
        if not torch.equal(torch.sort(ia).values, torch.sort(ib).values):
            return f"table {name}: id sets differ from step {step}"
        pa, pb = torch.argsort(ia), torch.argsort(ib)
        if not torch.equal(a.weight[pa], b.weight[pb]):
            return f"table {name}: embeddings differ from step {step}"
    for k, v in em.state_dict().items():
        if isinstance(v, torch.Tensor) and not torch.equal(model.state_dict()[k], v):
            return f"dense {k} differs from step {step}"
    if extras.get("step") != step or not torch.equal(extras.get("w"), ee["w"]):
        return f"extras differ from step {step}: {extras.get('step')}"
    if reader.pos != er.pos:
        return f"io state {reader.pos} != {er.pos}"
    return None


def restore(out_dir):
    """(step or None, model, extras, reader) from the newest committed checkpoint."""
    m, e, r = Model(), {}, Reader()
    s = make_saver(out_dir, m, e, r)
    try:
        res = s.load()
    except CheckpointNotFoundError:
        return None, m, e, r
    return step_of(res.ckpt_id), m, s.extra("state"), r


def check_listed_verify(out_dir) -> list[str]:
    out = []
    s = Saver(Model(), output_dir=out_dir)
    for ckpt_id in s.checkpoints():
        rep = recckpt.verify(os.path.join(out_dir, ckpt_id))
        if not rep.ok:
            out.append(f"listed checkpoint {ckpt_id} does not verify: {rep.problems[0]}")
    return out


# ------------------------------------------------------------------------------------------- kill
def _child(out_dir: str, start: int, progress: str) -> None:
    m, e, r = Model(), {}, Reader()
    s = make_saver(out_dir, m, e, r)
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    step = start
    while True:
        set_step_state(m, e, r, step)
        s.save(f"s{step:06d}")
        os.write(fd, f"{step}\n".encode())   # one small append: complete or absent after a kill
        step += 1


def _reported(progress: str) -> list[int]:
    try:
        text = open(progress).read()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split("\n")[:-1] if x]


def run_kill(n: int, work_dir: str, seed: int = 0, max_delay: float = 0.4) -> Trials:
    """`n` SIGKILLs of a saving child at random moments."""
    t0 = time.perf_counter()
    rec = Trials("kill")
    rng = random.Random(seed)
    out_dir = os.path.join(work_dir, "ckpts")
    progress = os.path.join(work_dir, "progress")
    ctx = forkserver_context()
    next_step, last_seen = 0, None   # the step the next child saves first; the newest restored
    for trial in range(n):
        before = len(_reported(progress))
        p = ctx.Process(target=_child, args=(out_dir, next_step, progress), daemon=True)
        p.start()
        if trial % 2:
            # Let the restarted child finish one save first: proves the save after a kill succeeds,
            # then kill it somewhere later.
            deadline = time.monotonic() + 60
            while len(_reported(progress)) == before and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005)
            if len(_reported(progress)) == before:
                rec.fail(f"trial {trial}: the first save after a restart did not succeed "
                         f"(exit code {p.exitcode})")
        time.sleep(rng.uniform(0, max_delay))
        if not p.is_alive():
            rec.fail(f"trial {trial}: the saving child died by itself (exit code {p.exitcode})")
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.join()
        rec.trials += 1
        mine = _reported(progress)[before:]
        got, m, e, r = restore(out_dir)
        # Saves are sequential, so the newest committed step is this child's last reported save or the
        # one after it (committed, killed before reporting); if it reported none, the newest from before
        # or the child's first save.
        ok_steps = {mine[-1], mine[-1] + 1} if mine else {last_seen, next_step}
        if mine and mine != list(range(next_step, next_step + len(mine))):
            rec.fail(f"trial {trial}: child started at {next_step} reported {mine}")
        if got not in ok_steps:
            rec.fail(f"trial {trial}: restored step {got}, expected one of {sorted(ok_steps, key=str)}")
        elif got is not None:
            diff = check_restored_equals_step(m, e, r, got)
            if diff:
                rec.fail(f"trial {trial}: restored s{got:06d} but {diff}")
        rec.failures.extend(f"trial {trial}: {x}" for x in check_listed_verify(out_dir))
        if got is not None:
            last_seen = got
        next_step = (got + 1) if got is not None else next_step
    # After everything: one save to completion, and start-up recovery leaves nothing stale behind.
    m, e, r = Model(), {}, Reader()
    s = make_saver(out_dir, m, e, r)
    set_step_state(m, e, r, next_step)
    try:
        s.save(f"s{next_step:06d}")
    except Exception as ex:  # noqa: BLE001 - the record names it
        rec.fail(f"final save failed: {type(ex).__name__}: {ex}")
    stale = [x for x in os.listdir(out_dir) if x.startswith(".") and x != ".catalog.json"]
    if stale:
        rec.fail(f"left after start-up recovery and a save: {stale}")
    got, m, e, r = restore(out_dir)
    if got != next_step:
        rec.fail(f"final restore gave {got}, expected {next_step}")
    rec.seconds = time.perf_counter() - t0
    return rec


# ------------------------------------------------------------------------------------- corruption
def build_template(out_dir: str) -> str:
    """A checkpoint written by 2 workers with every kind of file; returns its directory."""
    for w in range(2):
        m, e, r = Model(), {}, Reader()
        set_step_state(m, e, r, 7)
        for t in (m.user, m.item):   # each worker holds its own half of the ids
            ids = t.ids()
            keep = ids % 2 == w
            emb = t.weight[keep].clone()
            t.clear_rows()
            t.import_rows(ids[keep], {"embedding": emb})
        s = make_saver(out_dir, m, e, r, opts=SaveOptions(num_buckets=16, chunk_bytes=256,
                                                          segment_bytes=2048, fsync=False))
        s.save("c", shard_id=w, shard_num=2)
    return os.path.join(out_dir, "c")


def _files(ckpt):
    return sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)


def corrupt_one(ckpt: str, rel: str, rng: random.Random) -> str:
    """Flip one bit of one byte, or truncate, file `rel`; returns a description."""
    path = os.path.join(ckpt, rel)
    data = bytearray(open(path, "rb").read())
    if rng.random() < 0.75 and data:
        pos = rng.randrange(len(data))
        bit = rng.randrange(8)
        data[pos] ^= 1 << bit
        what = f"flip bit {bit} of byte {pos}"
    else:
        cut = rng.randrange(len(data)) if data else 0
        data = data[:cut]
        what = f"truncate to {cut} bytes"
    with open(path, "wb") as f:
        f.write(data)
    return f"{rel}: {what}"


def check_corrupt_load(ckpt: str, rel: str) -> str | None:
    """None when loading the corrupted checkpoint by id fails with CorruptCheckpointError naming `rel`."""
    out_dir = os.path.dirname(ckpt)
    m, e, r = Model(), {}, Reader()
    s = make_saver(out_dir, m, e, r)
    worker = int(rel.split("worker-")[1][:5]) if rel.startswith("io_state/") else 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if rel.startswith("io_state/"):   # that worker's IO state is read only at the saved world size
                s.load(ckpt_id="c", shard_id=worker, shard_num=2)
            else:                             # one loader reads every table byte; IO state cannot resize
                s.load(ckpt_id="c", load_conf={"io_state_on_resize": "drop"})
    except CorruptCheckpointError as ex:
        if rel not in str(ex):
            return f"CorruptCheckpointError does not name {rel}: {ex}"
        return None
    except Exception as ex:  # noqa: BLE001
        return f"{type(ex).__name__} instead of CorruptCheckpointError: {ex}"
    return "the load succeeded"


def run_corruption(n: int, work_dir: str, seed: int = 0) -> Trials:
    t0 = time.perf_counter()
    rec = Trials("corruption")
    rng = random.Random(seed)
    template = build_template(os.path.join(work_dir, "template"))
    files = _files(template)
    trial_dir = os.path.join(work_dir, "trial")
    for i in range(n):
        rel = files[i % len(files)]   # every file in turn, positions at random
        shutil.rmtree(trial_dir, ignore_errors=True)
        shutil.copytree(os.path.dirname(template), trial_dir)
        ckpt = os.path.join(trial_dir, "c")
        what = corrupt_one(ckpt, rel, rng)
        rec.trials += 1
        problem = check_corrupt_load(ckpt, rel)
        if problem:
            rec.fail(f"{what}: load: {problem}")
        try:
            rep = recckpt.verify(ckpt)
            if rep.ok or not any(rel in p for p in rep.problems):
                rec.fail(f"{what}: verify: ok={rep.ok} problems={rep.problems[:2]}")
        except Exception as ex:  # noqa: BLE001
            rec.fail(f"{what}: verify raised {type(ex).__name__}: {ex}")
    rec.seconds = time.perf_counter() - t0
    return rec


# ------------------------------------------------------------------------------------------ faults
def run_faults(work_dir: str, errnos=(errno.ENOSPC, errno.EIO), limit_per_op: int | None = None,
               seed: int = 0) -> Trials:
    """Fail each storage operation of one save in turn (every occurrence, or `limit_per_op` of them
    chosen at random), with each errno."""
    t0 = time.perf_counter()
    rec = Trials("faults")
    # Post-commit housekeeping failures are logged as warnings by design; keep the output readable.
    logging.getLogger("recckpt").setLevel(logging.ERROR)
    rng = random.Random(seed)
    root = os.path.join(work_dir, "faults")
    m, e, r = Model(), {}, Reader()
    # Count the operations of one save (after the start-up recovery of a first save, which differs).
    probe = os.path.join(root, "probe")
    s = make_saver(probe, m, e, r, max_keep=1)
    set_step_state(m, e, r, 0)
    s.save("s000000")
    s.storage = fs = FaultyStorage(s.storage)
    counts: dict = {}
    for k in range(3):
        # The engine merges small writes and flushes when a writer thread goes idle, so its write count
        # depends on timing: take the minimum over a few saves as the positions every save reaches.
        fs.disarm()
        set_step_state(m, e, r, 1 + k)
        s.save(f"p{k:06d}")
        counts = {op: min(n, counts.get(op, n)) for op, n in fs.counts().items()}
    fs.disarm()
    cases = []
    for op in OPS:
        occ = list(range(1, counts[op] + 1))
        if limit_per_op is not None and len(occ) > limit_per_op:
            occ = sorted(rng.sample(occ, limit_per_op))
        cases += [(op, at, err) for at in occ for err in errnos]
    for k, (op, at, err) in enumerate(cases):
        out = os.path.join(root, f"case{k}")
        m, e, r = Model(), {}, Reader()
        s = make_saver(out, m, e, r, max_keep=1)
        set_step_state(m, e, r, 0)
        s.save("s000000")
        s.storage = fs = FaultyStorage(s.storage)
        fs.arm(op, at, err)
        set_step_state(m, e, r, 1)
        rec.trials += 1
        where = f"{op}#{at} {errno.errorcode[err]}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s.save("s000001")
            saved = True
        except CheckpointSaveError as ex:
            saved = False
            if errno.errorcode[err] not in str(ex) and os.strerror(err) not in str(ex):
                rec.fail(f"{where}: the error does not say what failed: {ex}")
        except Exception as ex:  # noqa: BLE001
            rec.fail(f"{where}: {type(ex).__name__} instead of CheckpointSaveError: {ex}")
            saved = False
        fired = fs.triggered
        fs.disarm()
        if not fired and op in TIMING_DEPENDENT_OPS and at > 1:
            rec.trials -= 1   # this save happened to merge writes and did fewer; not a trial of this position
            rec.not_reached += 1
            continue
        if not fired:
            rec.fail(f"{where}: the fault never fired (the save does fewer operations than counted)")
        listed = Saver(Model(), output_dir=out).checkpoints()
        if not set(listed) <= {"s000000", "s000001"} or not listed:
            rec.fail(f"{where}: listed {listed}")
        rec.failures.extend(f"{where}: {x}" for x in check_listed_verify(out))
        for ckpt_id in listed:
            m2, e2, r2 = Model(), {}, Reader()
            s2 = make_saver(out, m2, e2, r2)
            s2.load(ckpt_id=ckpt_id)
            diff = check_restored_equals_step(m2, s2.extra("state"), r2, step_of(ckpt_id))
            if diff:
                rec.fail(f"{where}: {ckpt_id}: {diff}")
        if not saved and "s000000" not in listed:
            rec.fail(f"{where}: the earlier checkpoint is no longer listed: {listed}")
        set_step_state(m, e, r, 2)
        try:
            s.save("s000002")
            m2, e2, r2 = Model(), {}, Reader()
            s2 = make_saver(out, m2, e2, r2)
            got = s2.load()
            diff = check_restored_equals_step(m2, s2.extra("state"), r2, 2) if got.ckpt_id == "s000002" else \
                f"newest is {got.ckpt_id}"
            if diff:
                rec.fail(f"{where}: after the next save: {diff}")
        except Exception as ex:  # noqa: BLE001
            rec.fail(f"{where}: the next save failed: {type(ex).__name__}: {ex}")
        shutil.rmtree(out, ignore_errors=True)
    rec.seconds = time.perf_counter() - t0
    return rec
