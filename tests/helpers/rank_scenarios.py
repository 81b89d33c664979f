"""What each rank runs in the multi-process tests (spawned processes import this module by name)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from helpers.ranks import FaultyTable, Holder, Reader, all_ids, check_rows, owned_table, save_npy
from recckpt import SaveOptions, Saver, partition
from recckpt.errors import CheckpointSaveError, IncompatibleCheckpointError

# Small checksum chunks so the partial-read overhead (<= 2 chunks per column and segment) stays small
# next to a rank's share of the table; see docs/DISTRIBUTED.md for the bound.
OPTS = SaveOptions(chunk_bytes=16 << 10, fsync=False, coordination_timeout_s=60)


def save_sharded(rank, world, out, ckpt_id, n_ids):
    """Every rank saves the ids it owns; dense values differ per rank so a test can tell whose copy
    of the replicated dense state was written."""
    from recckpt.coordination import groups as coordination_groups
    t = owned_table(rank, world, all_ids(n_ids))
    s = Saver(Holder(t, dense_value=float(rank)), output_dir=out, options=OPTS, max_keep=None)
    s.register_io_state("reader", Reader(pos=100 * rank))
    s.register_for_checkpointing("note", {"world": world})
    path = s.save(ckpt_id, step=7)      # shard_id / shard_num from the process group
    groups = list(coordination_groups.built().values())
    return {"path": path, "rows": int(t.ids.numel()), "committed": s.checkpoints(),
            "dedicated_group": len(groups) == 1 and groups[0] is not dist.group.WORLD
                               and dist.get_backend(groups[0]) == "gloo"}


def _load(out, ckpt_id, rank, world, npy, **conf):
    from helpers.ranks import SPEC, DictTable
    t = DictTable("emb", SPEC)
    s = Saver(Holder(t, dense_value=-1.0), output_dir=out)
    res = s.load(ckpt_id=ckpt_id, shard_id=rank, shard_num=world, load_conf={"load": ["sparse", "sparse_opt"], **conf})
    check_rows(t)
    save_npy(npy, t.ids)
    return {"bytes_read": res.bytes_read, "rows": int(t.ids.numel()),
            "partition_ok": bool((partition(t.ids, world) == rank).all())}


def load_everywhere(rank, world, out, tmp):
    """Run on 3 ranks: resharded loads of 'n4' (4 → 3, 4 → 2, 4 → 1) and 'n2' (2 → 3, 2 → 2)."""
    from helpers.ranks import SPEC, DictTable
    res = {}
    # defaults come from the process group (rank, 3)
    t = DictTable("emb", SPEC)
    s = Saver(Holder(t, dense_value=-1.0), output_dir=out)
    r = s.load(ckpt_id="n4", load_conf={"load": ["sparse", "sparse_opt", "dense"]})
    check_rows(t)
    save_npy(os.path.join(tmp, f"n4-3-{rank}.npy"), t.ids)
    res["n4-3"] = {"bytes_read": r.bytes_read, "rows": int(t.ids.numel()),
                   "partition_ok": bool((partition(t.ids, 3) == rank).all()),
                   "dense": float(s.model.lin.weight[0, 0])}
    res["n2-3"] = _load(out, "n2", rank, 3, os.path.join(tmp, f"n2-3-{rank}.npy"))
    res["own-3"] = _load(out, "n4", rank, 3, os.path.join(tmp, f"own-3-{rank}.npy"),
                         ownership=lambda ids, w: ids % w)
    if rank < 2:
        res["n4-2"] = _load(out, "n4", rank, 2, os.path.join(tmp, f"n4-2-{rank}.npy"))
        # same world size as the save: IO state loads
        rd = Reader(pos=-1)
        s = Saver(Holder(DictTable("emb", SPEC)), output_dir=out)
        s.register_io_state("reader", rd)
        s.register_for_checkpointing("note", {})
        s.load(ckpt_id="n2", shard_id=rank, shard_num=2)
        res["n2-io"] = rd.pos
    if rank == 0:
        res["n4-1"] = _load(out, "n4", 0, 1, os.path.join(tmp, "n4-1-0.npy"))
        # IO state on a resize: error by default (naming both sizes), or dropped on request
        rd = Reader(pos=-1)
        s = Saver(Holder(DictTable("emb", SPEC)), output_dir=out)
        s.register_io_state("reader", rd)
        s.register_for_checkpointing("note", {})
        try:
            s.load(ckpt_id="n4")
            res["io_error"] = None
        except IncompatibleCheckpointError as e:
            res["io_error"] = str(e)
        res["io_untouched_after_error"] = rd.pos == -1 and len(s.model.emb.ids) == 0
        r = s.load(ckpt_id="n4", load_conf={"io_state_on_resize": "drop"})
        res["io_drop"] = {"dropped": r.io_state_dropped, "pos": rd.pos, "rows": len(s.model.emb.ids)}
    return res


def failures(rank, world, out, timeout_s, sleep_s):
    """ok1 → a rank raising mid-write → a rank sleeping past the timeout → ok2."""
    opts = SaveOptions(chunk_bytes=16 << 10, fsync=False, coordination_timeout_s=timeout_s)
    ids = all_ids(4000, seed=5)
    report = {}

    def attempt(ckpt_id, fault=None, sleep=0.0, who=-1):
        t = owned_table(rank, world, ids, cls=FaultyTable, fault=fault if rank == who else None,
                        sleep_s=sleep)
        s = Saver(Holder(t), output_dir=out, options=opts, max_keep=None)
        t0 = time.monotonic()
        try:
            s.save(ckpt_id)
            err = None
        except CheckpointSaveError as e:
            err = str(e)
        return {"error": err, "seconds": time.monotonic() - t0, "committed": s.checkpoints()}

    report["ok1"] = attempt("ok1")
    report["raise"] = attempt("boom", "raise", who=1)
    report["sleep"] = attempt("slow", "sleep", sleep_s, who=2)
    report["ok2"] = attempt("ok2")
    report["staging_left"] = sorted(n for n in os.listdir(out) if n.startswith(".staging"))
    return report


def stalled_committer(rank, world, out, timeout_s, sleep_s, when, via_snapshot=False):
    """Rank 0 stalls past the coordination timeout inside its commit step, `when` = "before" or "after"
    the commit itself, so the other ranks time out waiting for the outcome after handing their parts
    over. Then two incremental saves, "d" (from a snapshot of changes with `via_snapshot`, as an async
    save writes) and "e". Reports what each rank's saves did."""
    import warnings

    import recckpt.train.saver as saver_mod
    if rank == 0:
        real = saver_mod.finalize

        def stalled(*a, **kw):
            if when == "before":
                time.sleep(sleep_s)
            out_ = real(*a, **kw)
            if when == "after":
                time.sleep(sleep_s)
            return out_
        saver_mod.finalize = stalled
    opts = SaveOptions(chunk_bytes=16 << 10, fsync=False, coordination_timeout_s=timeout_s)
    t = owned_table(rank, world, all_ids(3000, seed=7))
    s = Saver(Holder(t), output_dir=out, options=opts, max_keep=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            s.save("c")
            err = None
        except CheckpointSaveError as e:
            err = f"{type(e).__name__}: {e}"
    if rank == 0:
        saver_mod.finalize = real
    # The ranks must still agree on the coordination group: the next save works everywhere. Where every
    # rank knows "c" committed, it is an increment on it; where only rank 0 does, the ranks see that their
    # parents differ before writing, and all write a full checkpoint (or, from snapshots of changes, all
    # refuse). Either way the save after it is an increment on it again.
    rep = {"error": err, "warnings": [str(w.message) for w in caught]}
    for name, snapshot in (("d", via_snapshot), ("e", False)):
        try:
            if snapshot:
                from recckpt.train.snapshot import HostBuffers
                stats = s.write(name, s.capture_copy(HostBuffers(), rank, incremental=True), incremental=True)
            else:
                stats = s.write(name, incremental=True)
            rep[name] = {"error": None, "parent": stats.parent, "full_reason": stats.full_reason}
        except CheckpointSaveError as e:
            rep[name] = {"error": f"{type(e).__name__}: {e}"}
    return rep


def save_duplicates(rank, world, out):
    """A job with a bad routing: ids 5 and 6 live on both ranks, with rank-specific values."""
    from helpers.ranks import SPEC, DictTable, rows_for
    ids = torch.tensor([5, 6, 100 + rank, 200 + rank], dtype=torch.int64)
    t = DictTable("emb", SPEC)
    t.set_rows(ids, rows_for(ids, salt=1000.0 * rank))
    s = Saver(Holder(t), output_dir=out, options=OPTS, max_keep=None)
    s.save("dup", step=10 + rank)       # rank 1 saved at the newer step
    s.save("dup_tie", step=3)
    return True


def manager_world(rank, world, out):
    """CheckpointManager under a process group: defaults follow the group, disagreeing values are refused,
    and a restore that one rank finds corrupt is skipped by every rank."""
    from recckpt import CheckpointManager
    got = {}
    saver = Saver(Holder(owned_table(rank, world, all_ids(500))), output_dir=out, options=OPTS, max_keep=None)
    mgr = CheckpointManager(saver, 1, save_rng=False)
    got["default"] = [mgr.shard_id, mgr.shard_num]
    try:
        CheckpointManager(Saver(Holder(owned_table(rank, world, all_ids(10))), output_dir=out), 1,
                          shard_id=0, shard_num=1, save_rng=False)
        got["explicit_single"] = "accepted"
    except ValueError as e:
        got["explicit_single"] = str(e)
    try:  # the same for a direct Saver.save: each rank would commit its own rows alone as 'solo'
        Saver(Holder(owned_table(rank, world, all_ids(10))), output_dir=out).save("solo", shard_id=0, shard_num=1)
        got["saver_explicit_single"] = "accepted"
    except ValueError as e:
        got["saver_explicit_single"] = str(e)
    mgr.step()                      # ckpt_1
    mgr.step()                      # ckpt_2
    if rank == world - 1:           # this rank's share of ckpt_2 is damaged; rank 0 reads fine
        import glob
        import os
        shard = sorted(p for p in glob.glob(os.path.join(out, "ckpt_2", "sparse", "*")) if not p.endswith(".json"))[-1]
        with open(shard, "r+b") as f:
            data = bytearray(f.read())
            for i in range(len(data) // 3, len(data) - 64, 97):   # many flips: whatever range this rank reads
                data[i] ^= 0xFF
            f.seek(0)
            f.write(data)
    fresh = CheckpointManager(Saver(Holder(owned_table(rank, world, all_ids(5), salt=9.0)), output_dir=out,
                                    options=OPTS), 1, save_rng=False)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got["restored"] = fresh.restore()
        except Exception as e:  # noqa: BLE001 - reported to the test
            got["restored"] = f"{type(e).__name__}: {e}"
    got["warnings"] = [str(w.message) for w in caught]
    return got


# ------------------------------------------------------------------------------ incremental chains
CHAIN_STEPS = 3


def chain_ops(ids: torch.Tensor, k: int):
    """Step k of the chain workload on `ids` (a rank's ids, or all): (ids updated, ids removed, ids
    inserted). The row of an id written at step k is rows_for(id, salt=k)."""
    touched = ids[ids % 7 == k]
    gone = ids[(ids % 11 == k) & (ids % 7 != k)]
    new = k * 10 ** 12 + torch.arange(300, dtype=torch.int64)
    return touched, gone, new


def chain_expected(n_ids: int, upto: int) -> dict[int, float]:
    """id → salt of its row after step `upto` (0: the base), computed on all ids at once."""
    ids = all_ids(n_ids)
    salt = dict.fromkeys(ids.tolist(), 0.0)
    for k in range(1, upto + 1):
        touched, gone, new = chain_ops(torch.tensor(sorted(salt), dtype=torch.int64), k)
        for i in touched.tolist():
            salt[i] = float(k)
        for i in gone.tolist():
            del salt[i]
        for i in new.tolist():
            salt[i] = float(k)
    return salt


def chain_save(rank, world, out, n_ids):
    """Each rank trains its own ids (updates, removals, inserts of ids it owns) and saves a base and
    CHAIN_STEPS increments together."""
    from helpers.ranks import DIM, rows_for
    from recckpt import HashTable
    ids = all_ids(n_ids)
    mine = ids[partition(ids, world) == rank]
    t = HashTable("emb", DIM)
    t.import_rows(mine, {"embedding": rows_for(mine)["embedding"]})
    s = Saver(Holder(t), output_dir=out, options=OPTS, max_keep=1)
    s.save("base")
    parents = []
    for k in range(1, CHAIN_STEPS + 1):
        touched, gone, new = chain_ops(t.ids(), k)
        t.write_rows("embedding", t.lookup(touched), rows_for(touched, salt=float(k))["embedding"])
        t.remove_ids(gone)
        new = new[partition(new, world) == rank]
        t.import_rows(new, {"embedding": rows_for(new, salt=float(k))["embedding"]})
        s.save(f"inc{k}", incremental=True)
        parents.append(s.last_save.parent if rank == 0 else None)
    return {"parents": parents, "committed": s.checkpoints()}


def chain_load(rank, world, out, ckpt_id):
    """Load `ckpt_id` (a chain) on this rank; returns the ids and the salt of each row."""
    from helpers.ranks import DIM, rows_for
    from recckpt import HashTable
    t = HashTable("emb", DIM)
    res = Saver(Holder(t), output_dir=out, options=OPTS).load(ckpt_id=ckpt_id)
    ids = t.ids()
    emb = t.slot("embedding")[t.lookup(ids)]
    salt = (emb[:, 0] - rows_for(ids)["embedding"][:, 0]).tolist()
    return {"ids": ids.tolist(), "salt": salt, "rows": res.sparse_rows,
            "own": bool((partition(ids, world) == rank).all())}


def chain_save_async(rank, world, out, n_ids):
    """chain_save through CheckpointManager(async_save=True, increments=...): checkpoint ckpt_{k+1} is the
    state after chain step k, and step k+1 already changes the table while ckpt_{k+1} is written in the
    background. Returns the parent of every checkpoint (rank 0)."""
    from helpers.ranks import DIM, rows_for
    from recckpt import CheckpointManager, HashTable, IncrementPolicy
    from recckpt.format import catalog
    ids = all_ids(n_ids)
    mine = ids[partition(ids, world) == rank]
    t = HashTable("emb", DIM)
    t.import_rows(mine, {"embedding": rows_for(mine)["embedding"]})
    s = Saver(Holder(t), output_dir=out, options=OPTS, max_keep=None)
    mgr = CheckpointManager(s, 1, keep=None, save_rng=False, async_save=True,
                            increments=IncrementPolicy(full_every=10, max_chain_fraction=None))
    for k in range(CHAIN_STEPS + 1):
        if k:
            touched, gone, new = chain_ops(t.ids(), k)
            t.write_rows("embedding", t.lookup(touched), rows_for(touched, salt=float(k))["embedding"])
            t.remove_ids(gone)
            new = new[partition(new, world) == rank]
            t.import_rows(new, {"embedding": rows_for(new, salt=float(k))["embedding"]})
        mgr.step()
    mgr.close()
    found = dict(catalog.committed(s.storage))
    return {c: (m.parent.ckpt_id if m.parent is not None else None) for c, m in found.items()}


def manager_lost_outcome(rank, world, out, timeout_s, sleep_s, async_save):
    """CheckpointManager with increments (sync or async) whose save of ckpt_2 rank 0 commits only after the
    other ranks gave up waiting for its outcome (CommitOutcomeUnknownError there). Once ckpt_2 is seen
    committed, the next save is an increment on it on every rank, as on rank 0, and the chain loads the
    live rows. Returns what each rank saw."""
    import recckpt.train.saver as saver_mod
    from helpers.ranks import DIM, rows_for
    from recckpt import CheckpointManager, HashTable, IncrementPolicy
    ids = all_ids(3000, seed=11)
    mine = ids[partition(ids, world) == rank]
    t = HashTable("emb", DIM)
    t.import_rows(mine, {"embedding": rows_for(mine)["embedding"]})
    opts = SaveOptions(chunk_bytes=16 << 10, fsync=False, coordination_timeout_s=timeout_s)
    s = Saver(Holder(t), output_dir=out, options=opts, max_keep=None)
    rep = {"errors": [], "kinds": {}}
    mgr = CheckpointManager(s, 1, keep=None, save_rng=False, async_save=async_save,
                            increments=IncrementPolicy(full_every=10, max_chain_fraction=None),
                            on_save=lambda ev: rep["kinds"].__setitem__(ev.ckpt_id, ev.kind))

    def train(k):
        touched = t.ids()[t.ids() % 5 == k]
        t.write_rows("embedding", t.lookup(touched), rows_for(touched, salt=float(k))["embedding"])

    def step():
        try:
            mgr.step()
            mgr.wait()
        except CheckpointSaveError as e:
            rep["errors"].append(f"{type(e).__name__}: {e}")

    step()                                  # ckpt_1: full
    train(1)
    real = saver_mod.finalize
    if rank == 0:
        def stalled(*a, **kw):
            time.sleep(sleep_s)
            return real(*a, **kw)
        saver_mod.finalize = stalled
    step()                                  # ckpt_2: the other ranks give up while rank 0 sleeps
    saver_mod.finalize = real
    deadline = time.monotonic() + 60
    while not s.is_committed("ckpt_2") and time.monotonic() < deadline:
        time.sleep(0.1)
    train(2)
    step()                                  # ckpt_3
    mgr.close()
    from recckpt.format import catalog
    m3 = catalog.read_manifest(s.storage, "ckpt_3")
    rep["parent"] = m3.parent.ckpt_id if m3.parent is not None else None
    t2 = HashTable("emb", DIM)
    Saver(Holder(t2), output_dir=out, options=opts).load(ckpt_id="ckpt_3", shard_id=rank, shard_num=world)
    live = t.ids()
    rep["same_rows"] = bool(sorted(t2.ids().tolist()) == sorted(live.tolist()) and torch.equal(
        t2.slot("embedding")[t2.lookup(live)], t.slot("embedding")[t.lookup(live)]))
    return rep


def unshared_restore(rank, world, base):
    """Each rank restores from its own disk's `<base>/node<rank>` (what a node-local output_dir gives a
    multi-node job): every rank's ckpt_1 there is another checkpoint. Reports the error and whether the
    model changed."""
    import os

    from recckpt import CheckpointManager
    table = owned_table(rank, world, all_ids(5), salt=9.0)
    model = Holder(table)
    before = (table.ids.clone(), model.lin.weight.detach().clone())
    mgr = CheckpointManager(Saver(model, output_dir=os.path.join(base, f"node{rank}"), options=OPTS), 1,
                            save_rng=False)
    try:
        got = {"restored": mgr.restore()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        got = {"error": f"{type(e).__name__}: {e}"}
    got["unchanged"] = bool(torch.equal(table.ids, before[0]) and torch.equal(model.lin.weight, before[1]))
    return got


def mixed_layouts(rank, world, out, option):
    """Rank 1 saves with another SaveOptions.`option` than rank 0; then both save with the same."""
    import dataclasses

    from recckpt.errors import InvalidArgumentError
    t = owned_table(rank, world, all_ids(3000, seed=7))
    other = {"num_buckets": 1024, "chunk_bytes": 64 << 10}[option]
    mine = dataclasses.replace(OPTS, coordination_timeout_s=30, **({option: other} if rank == 1 else {}))
    rep = {}
    try:
        Saver(Holder(t), output_dir=out, options=mine, max_keep=None).save("x")
        rep["error"] = None
    except InvalidArgumentError as e:
        rep["error"] = str(e)
    Saver(Holder(t), output_dir=out, options=OPTS, max_keep=None).save("y")
    rep["committed"] = Saver(Holder(t), output_dir=out).checkpoints()
    return rep


def taken_id_seen_by_one_rank(rank, world, out):
    """Another job commits 'c5' into the output directory after rank 1 checked that id and before rank 0
    does; both ranks then save 'c5', and after that 'c6'. Reports each save's error and the ids committed."""
    import dataclasses

    from recckpt.errors import CheckpointExistsError
    t = owned_table(rank, world, all_ids(2000, seed=3))
    opts = dataclasses.replace(OPTS, coordination_timeout_s=30)
    go = os.path.join(out, "..", "rank1-checking")
    rep = {}
    if rank == 0:
        while not os.path.exists(go):
            time.sleep(0.01)
        time.sleep(1.0)   # rank 1 has checked 'c5' by now and waits for rank 0 in begin
        import subprocess
        import sys
        other_job = ("import torch, recckpt; m = torch.nn.Module(); m.t = recckpt.HashTable('t', 4); "
                     f"m.t(torch.arange(10)); recckpt.Saver(m, output_dir={out!r}, max_keep=None).save('c5')")
        subprocess.run([sys.executable, "-c", other_job], check=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE",
                                                                                    "LOCAL_RANK", "MASTER_"))})
    else:
        os.makedirs(out, exist_ok=True)
        open(go, "w").close()
    s = Saver(Holder(t), output_dir=out, options=opts, max_keep=None)
    start = time.monotonic()
    try:
        s.save("c5")
        rep["c5"] = None
    except CheckpointExistsError as e:
        rep["c5"] = f"CheckpointExistsError: {e}"
    except CheckpointSaveError as e:
        rep["c5"] = f"{type(e).__name__}: {e}"
    rep["c5_s"] = time.monotonic() - start
    try:
        s.save("c6")
        rep["c6"] = None
    except CheckpointSaveError as e:
        rep["c6"] = f"{type(e).__name__}: {e}"
    rep["committed"] = s.checkpoints()
    return rep


def lone_first_save(rank, world, out, rendezvous_s):
    """Only rank 0 calls save (a habit from DDP), with a coordination timeout shorter than building the
    save group may take (`rendezvous_s`, lowered from 120 s for the test); rank 1 stays alive meanwhile.
    Reports rank 0's error and how long it waited."""
    import dataclasses

    from recckpt.coordination import groups
    groups.RENDEZVOUS_MIN_S = rendezvous_s
    rep = {}
    if rank == 0:
        t = owned_table(rank, world, all_ids(100))
        start = time.monotonic()
        try:
            Saver(Holder(t), output_dir=out, options=dataclasses.replace(OPTS, coordination_timeout_s=1)).save("x")
            rep["error"] = None
        except CheckpointSaveError as e:
            rep["error"] = str(e)
        rep["waited_s"] = time.monotonic() - start
    else:
        time.sleep(rendezvous_s + 4)
    return rep


class _KillOnLoad:
    """A registered object whose load_state_dict SIGKILLs its process on the chosen rank, after leaving the
    report the test harness reads (a killed rank writes none)."""

    def __init__(self, rank, kill_rank, report_dir):
        self.rank, self.kill_rank, self.report_dir, self.v = rank, kill_rank, report_dir, 1

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, state):
        if self.rank == self.kill_rank:
            import json
            import os
            import signal
            with open(os.path.join(self.report_dir, f"rank-{self.rank}.json"), "w") as f:
                json.dump({"rank": self.rank, "result": {"killed": True}}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        self.v = state["v"]


def restore_with_a_rank_killed(rank, world, out, report_dir):
    """Both ranks save ckpt_1 through a CheckpointManager; then rank 1 is SIGKILLed in the middle of the
    restore. Rank 0 reports its error, how long it waited, and whether its table was loaded."""
    import dataclasses

    from recckpt import CheckpointManager
    opts = dataclasses.replace(OPTS, coordination_timeout_s=10)

    def manager(salt):
        saver = Saver(Holder(owned_table(rank, world, all_ids(500), salt=salt)), output_dir=out, options=opts)
        saver.register_for_checkpointing("counter", _KillOnLoad(rank, 1, report_dir))
        return CheckpointManager(saver, 1, save_rng=False), saver
    mgr, _ = manager(0.0)
    mgr.step()                      # ckpt_1
    fresh, saver = manager(9.0)
    start = time.monotonic()
    rep = {}
    try:
        rep["restored"] = fresh.restore()
    except Exception as e:  # noqa: BLE001 - reported to the test
        rep["error"] = f"{type(e).__name__}: {e}"
    rep["waited_s"] = time.monotonic() - start
    try:
        check_rows(saver.model.emb, 0.0)
        rep["loaded"] = True
    except AssertionError:
        rep["loaded"] = False
    return rep


class _KillOnSave(_KillOnLoad):
    """IO state (saved by every rank) whose dump SIGKILLs its process on the chosen rank once armed (the
    save is under way there), after leaving the report the harness reads."""

    armed = False

    wait_for: tuple = ()   # (ranks, step): before the kill, wait until those ranks have marked that step

    def dump_io_state(self):
        if self.armed and self.rank == self.kill_rank:
            if self.wait_for:
                _wait_for_arrivals(*self.wait_for)
            self.load_state_dict(None)   # (its kill, with the report)
        return {"v": self.v}

    def load_io_state(self, state):
        self.v = state["v"]


def _wait_for_arrivals(ranks, step: str, limit_s: float = 60.0) -> None:
    """Until each of `ranks` has marked `step` (its text's start) in recckpt's arrival keys of saves: a kill
    after this finds them already waiting in that step. Otherwise the first survivor to see the dead peer
    may read the store while another survivor is still writing its part, and truly name it as behind."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):   # recckpt marks in the job's store itself, not a prefixed view
        store = store.underlying_store
    keys = [f"recckpt/arrivals/save/{r}" for r in ranks]
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        # a mark is "<its count>|<step>" (recckpt.coordination.arrivals)
        if all(store.check([k]) and store.get(k).decode().partition("|")[2].startswith(step) for k in keys):
            return
        time.sleep(0.02)
    raise AssertionError(f"ranks {ranks} did not mark {step!r} within {limit_s:g}s")


def save_with_a_rank_killed(rank, world, out, report_dir):
    """Every rank saves ckpt 'a'; then rank 1 is SIGKILLed inside save 'b'. The survivors report their
    error: it must name rank 1 as the one that never reached the step they waited in."""
    import dataclasses
    opts = dataclasses.replace(OPTS, coordination_timeout_s=10)
    saver = Saver(Holder(owned_table(rank, world, all_ids(300), salt=1.0)), output_dir=out, options=opts)
    killer = _KillOnSave(rank, 1, report_dir)
    killer.wait_for = ([r for r in range(world) if r != 1], "gathering worker parts")
    saver.register_io_state("reader", killer)
    saver.save("a")
    killer.armed = True
    rep = {}
    try:
        saver.save("b")
    except Exception as e:  # noqa: BLE001 - reported to the test
        rep["error"] = f"{type(e).__name__}: {e}"
    # the next save must rebuild the save group, with rank 1 gone: within the coordination timeout
    start = time.monotonic()
    try:
        saver.save("c")
    except Exception as e:  # noqa: BLE001 - reported to the test
        rep["next_error"] = f"{type(e).__name__}: {e}"
    rep["next_s"] = time.monotonic() - start
    return rep
