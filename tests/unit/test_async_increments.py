"""Incremental checkpoints written in the background: the changes are taken when the snapshot is copied
(the training step), not when the background thread writes, so every increment holds the state at its
step, whatever training does meanwhile; CheckpointManager(async_save=True, increments=...) chains them."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers.tables import table_contents
from recckpt import CheckpointManager, HashTable, IncrementPolicy, SaveOptions, Saver, SparseAdam
from recckpt.errors import CheckpointSaveError
from recckpt.format import catalog
from recckpt.train.snapshot import HostBuffers

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4, track_changes=True)
        self.lin = torch.nn.Linear(4, 1)


def train_step(model, opt, ids):
    loss = model.lin(model.emb(ids)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.lin.zero_grad()


def loaded(out, ckpt_id):
    m = Model()
    Saver(m, SparseAdam([m.emb], lr=0.05), output_dir=out, options=OPTS).load(ckpt_id=ckpt_id)
    return table_contents(m.emb)


def assert_same(a, b):
    assert set(a) == set(b)
    for slot in a:
        assert set(a[slot]) == set(b[slot]), slot
        assert all(torch.equal(a[slot][i], b[slot][i]) for i in a[slot]), slot


def managed(out, **kw):
    """(model, its sparse optimizer, Saver, CheckpointManager(**kw)) on `out`, RNG state not saved."""
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    return model, opt, saver, CheckpointManager(saver, save_rng=False, **kw)


def train_with_removals(model, opt, mgr, *, steps: int, seed: int, batch: int, overlap: bool = False) -> dict:
    """Train `steps` steps (ids removed every third), the manager stepping after each; returns the table's
    contents at each save, keyed by checkpoint id. `overlap`: one more training step right after each
    save (it overlaps an async write)."""
    at_step = {}
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        train_step(model, opt, torch.randint(0, 300, (batch,), generator=gen))
        if step % 3 == 0:
            model.emb.remove_ids(torch.randint(0, 300, (10,), generator=gen))
        handle = mgr.step()
        if handle is not None:
            at_step[handle.ckpt_id] = table_contents(model.emb)   # the state the snapshot was taken of
        if overlap:
            train_step(model, opt, torch.randint(0, 300, (batch,), generator=gen))
    return at_step


def test_an_increment_copied_at_capture_holds_the_state_of_the_capture(tmp_path):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS)
    bufs = HostBuffers()
    train_step(model, opt, torch.arange(0, 200))
    saver.write("c0", saver.capture_copy(bufs))                  # full, from a snapshot: still a parent
    train_step(model, opt, torch.arange(150, 260))
    model.emb.remove_ids(torch.arange(0, 10))
    snap = saver.capture_copy(bufs, incremental=True)
    at_capture = table_contents(model.emb)
    copied = snap.tables[0].export_changes(snap.chain.marks["emb"], ["embedding"], 1000)
    assert copied.rows == 110 and copied.removed.numel() == 10     # only the changes were copied
    train_step(model, opt, torch.arange(100, 400))                # training goes on before the write
    model.emb.remove_ids(torch.arange(20, 30))
    saver.write("c1", snap, incremental=True)
    assert saver.last_save.parent == "c0" and saver.last_save.full_reason is None
    assert_same(loaded(tmp_path, "c1"), at_capture)
    saver.save("c2", incremental=True)   # what changed after the capture is in the next increment
    assert saver.last_save.parent == "c1"
    assert_same(loaded(tmp_path, "c2"), table_contents(model.emb))


def test_without_a_parent_the_capture_is_whole_and_says_why(tmp_path):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, options=OPTS)
    train_step(model, opt, torch.arange(50))
    snap = saver.capture_copy(HostBuffers(), incremental=True)
    assert snap.chain is None and "has not committed" in snap.full_reason
    saver.write("c0", snap, incremental=True)
    assert saver.last_save.parent is None and "has not committed" in saver.last_save.full_reason
    with pytest.raises(ValueError, match="capture_copy"):
        saver.write("c1", saver.capture(), incremental=True)    # a snapshot without marks


def _snapshot_after(tmp_path, parent: str, first: torch.Tensor, then: torch.Tensor):
    """A model saved as `parent` after training on `first`, trained on `then`, and a snapshot of its changes:
    (model, opt, saver, the snapshot's buffers, the snapshot)."""
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS)
    train_step(model, opt, first)
    saver.save(parent)
    train_step(model, opt, then)
    bufs = HostBuffers()
    return model, opt, saver, bufs, saver.capture_copy(bufs, incremental=True)


def test_a_parent_gone_before_the_background_write_fails_the_save_and_nothing_is_committed(tmp_path):
    model, opt, saver, _, snap = _snapshot_after(tmp_path, "c0", torch.arange(50), torch.arange(40, 60))
    shutil.rmtree(tmp_path / "c0")
    with pytest.raises(CheckpointSaveError,
                       match=r"checkpoint 'c1' was not written: its parent 'c0' is no longer committed.*next save writes a full"):
        saver.write("c1", snap, incremental=True)
    assert not saver.is_committed("c1")
    saver.save("c2", incremental=True)
    assert saver.last_save.parent is None and "no longer committed" in saver.last_save.full_reason
    assert_same(loaded(tmp_path, "c2"), table_contents(model.emb))


@pytest.mark.parametrize("full_every", [2, 3])
def test_manager_async_saves_increments_between_full_checkpoints(tmp_path, full_every):
    model, opt, saver, mgr = managed(tmp_path, save_interval=1, keep=None, async_save=True,
                                     increments=IncrementPolicy(full_every=full_every, max_chain_fraction=None))
    at_step = train_with_removals(model, opt, mgr, steps=7, seed=0, batch=60, overlap=True)
    mgr.close()
    parents = {}
    for ckpt_id in at_step:
        m = catalog.read_manifest(saver.storage, ckpt_id)
        parents[ckpt_id] = m.parent.ckpt_id if m.parent is not None else None
        assert_same(loaded(tmp_path, ckpt_id), at_step[ckpt_id])
    fulls = [c for c, p in parents.items() if p is None]
    assert len(fulls) == -(-7 // (full_every + 1))          # a full one, then full_every increments
    assert all(p is None or int(c.split("_")[1]) - 1 == int(p.split("_")[1]) for c, p in parents.items())


def test_an_async_incremental_step_reads_no_store_on_the_training_thread(tmp_path):
    """README: with async_save a step only snapshots; a thread writes. With increments, each saving step read
    the output directory's catalog (the increment decision) and the parent's manifest and chain (the
    capture) on the training thread: on an object store a request each, and a frozen endpoint stalled the
    step for the storage timeout and raised into the training loop. Now the decision's chain is read by the
    background writer after each commit, and the capture checks only this process's state (the write checks
    the store)."""
    import threading

    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS)
    mgr = CheckpointManager(saver, save_interval=1, keep=None, save_rng=False, async_save=True,
                            increments=IncrementPolicy(full_every=3, max_chain_fraction=None))
    on_training_thread = []
    storage = saver.storage
    for name in dir(storage):
        fn = getattr(storage, name)
        if name.startswith("_") or not callable(fn):
            continue

        def spy(*a, _fn=fn, _name=name, **kw):
            if threading.current_thread() is threading.main_thread():
                on_training_thread.append(_name)
            return _fn(*a, **kw)
        setattr(storage, name, spy)
    at_step = {}
    for step in range(1, 9):
        train_step(model, opt, torch.arange(step * 7, step * 7 + 30))
        if step > 1:
            on_training_thread.clear()
        handle = mgr.step()
        if step > 1:
            assert on_training_thread == [], (step, on_training_thread)
        at_step[handle.ckpt_id] = table_contents(model.emb)
    mgr.close()
    parents = {c: getattr(catalog.read_manifest(saver.storage, c).parent, "ckpt_id", None) for c in at_step}
    assert parents == {"ckpt_1": None, "ckpt_2": "ckpt_1", "ckpt_3": "ckpt_2", "ckpt_4": "ckpt_3",
                       "ckpt_5": None, "ckpt_6": "ckpt_5", "ckpt_7": "ckpt_6", "ckpt_8": "ckpt_7"}, parents
    for c, want in at_step.items():
        assert_same(loaded(tmp_path, c), want)


def test_a_write_that_fails_on_an_unanswering_store_keeps_the_chain(tmp_path, monkeypatch):
    """A write from a snapshot of changes that fails while the store does not answer: the parent may well be
    there, so the chain stays and the next increment builds on it once the store answers. A review found
    the first version dropping the chain on any failed read of the parent, saying that the parent was "no
    longer committed" (false), and making the next save full."""
    import recckpt.train.saver as saver_mod
    model, opt, saver, bufs, snap = _snapshot_after(tmp_path, "c1", torch.arange(30), torch.arange(20, 50))
    real = catalog.read_manifest

    def frozen(*a, **kw):
        raise TimeoutError("the endpoint does not answer")
    with monkeypatch.context() as mp:
        mp.setattr(saver_mod, "write_worker_part", frozen)
        mp.setattr(catalog, "read_manifest", lambda st, cid, *a, **kw: frozen() if cid == "c1" else real(st, cid, *a, **kw))
        with pytest.raises(CheckpointSaveError, match=r"'c1' could not be read \(TimeoutError: the endpoint does "
                                                      r"not answer\).*checks its parent again"):
            saver.write("c2", snap, incremental=True)
    assert saver.is_committed("c1") and saver.chain_parent() == "c1"
    train_step(model, opt, torch.arange(60, 70))
    stats = saver.write("c3", saver.capture_copy(bufs, incremental=True), incremental=True)
    assert (stats.parent, stats.full_reason) == ("c1", None)
    assert_same(loaded(tmp_path, "c3"), table_contents(model.emb))


@pytest.mark.parametrize("async_save", [False, True])
def test_ephemeral_saves_between_increments_are_not_their_parents(tmp_path, async_save):
    """Ephemeral checkpoints are full and deleted once a newer one commits: the regular increments chain on
    each other, holding every change (removals included) made since the regular checkpoint before, so
    no ephemeral is kept alive as a parent and `full_every` counts the regular chain."""
    from recckpt import EphemeralEveryNSteps
    model, opt, saver, mgr = managed(tmp_path, save_interval=4, policies=[EphemeralEveryNSteps(1)], keep=None,
                                     async_save=async_save,
                                     increments=IncrementPolicy(full_every=10, max_chain_fraction=None))
    at_step = train_with_removals(model, opt, mgr, steps=13, seed=1, batch=40)
    mgr.close()
    committed = [cid for cid, _ in catalog.committed(saver.storage)]
    parents = {}
    for cid in committed:
        m = catalog.read_manifest(saver.storage, cid)
        parents[cid] = m.parent.ckpt_id if m.parent is not None else None
    # keep=None keeps regular checkpoints; only the newest ephemeral (ckpt_13) survives
    assert parents == {"ckpt_4": None, "ckpt_8": "ckpt_4", "ckpt_12": "ckpt_8", "ckpt_13": None}
    for cid in ("ckpt_8", "ckpt_12", "ckpt_13"):
        assert_same(loaded(tmp_path, cid), at_step[cid])


@pytest.mark.parametrize("async_save", [False, True])
def test_after_restoring_an_ephemeral_checkpoint_the_next_scheduled_save_is_full_and_says_why(tmp_path, async_save):
    """A restored ephemeral checkpoint was taken as the parent, and a newer ephemeral's commit then deleted it:
    the next scheduled save was full with no reason given (a helper's review). It is never a parent now."""
    from recckpt import EphemeralEveryNSteps

    def job():
        return managed(tmp_path, save_interval=4, policies=[EphemeralEveryNSteps(1)], keep=None,
                       async_save=async_save, increments=IncrementPolicy(full_every=10, max_chain_fraction=None))

    gen = torch.Generator().manual_seed(2)
    model, opt, _, mgr = job()
    for _ in range(5):
        train_step(model, opt, torch.randint(0, 300, (40,), generator=gen))
        mgr.step()
    mgr.close()
    model, opt, saver, mgr = job()
    assert mgr.restore() == 5
    for _ in range(3):
        train_step(model, opt, torch.randint(0, 300, (40,), generator=gen))
        mgr.step()
    mgr.close()
    assert saver.last_save.ckpt_id == "ckpt_8" and saver.last_save.parent is None
    assert [cid for cid, _ in catalog.committed(saver.storage)] == ["ckpt_4", "ckpt_8"]
    assert_same(loaded(tmp_path, "ckpt_8"), table_contents(model.emb))


def test_an_incremental_save_after_loading_an_ephemeral_checkpoint_is_full_and_says_why(tmp_path):
    from recckpt.format.retention import META_EPHEMERAL
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    train_step(model, opt, torch.arange(50))
    Saver(model, opt, output_dir=tmp_path, options=OPTS, max_keep=None).write("e", metadata={META_EPHEMERAL: "1"})
    back = Model()
    saver = Saver(back, SparseAdam([back.emb], lr=0.05), output_dir=tmp_path, options=OPTS, max_keep=None)
    saver.load(ckpt_id="e")
    saver.save("f", incremental=True)
    assert saver.last_save.parent is None and "'e', is ephemeral" in saver.last_save.full_reason
