"""CheckpointManager in a training loop: schedules, retention across restarts, async saves and their
failures, restore (empty, missing, corrupt output_dir), model bank precedence, exact resume."""
from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest
import torch

from helpers.tables import assert_tables_equal
from helpers.training_child import make_job, run, train_step
from recckpt import AsyncSaveError, CheckpointManager, EphemeralEveryNSteps, KeepPolicy, PreemptionHandler, Saver
from recckpt.errors import (
    CheckpointNotFoundError,
    CommitOutcomeUnknownError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    LoadConfigError,
)


def committed(out):
    with open(os.path.join(out, "checkpoint")) as f:
        return [line.strip() for line in f if line.strip()]


def on_disk(out):
    return sorted(n for n in os.listdir(out) if not n.startswith(".") and n != "checkpoint")


def train(job, steps):
    model, sopt, dopt, reader, mgr = job
    handles = []
    for _ in range(steps):
        train_step(model, sopt, dopt, reader)
        h = mgr.step()
        if h is not None:
            handles.append(h)
    return handles


# ------------------------------------------------------------------------------------------ schedule
def test_step_saves_on_schedule_and_restore_returns_the_step(tmp_path):
    job = make_job(tmp_path, interval=4)
    handles = train(job, 10)
    assert [h.ckpt_id for h in handles] == ["ckpt_4", "ckpt_8"]
    assert all(h.durable and h.stall_seconds > 0 for h in handles)
    assert committed(tmp_path) == ["ckpt_4", "ckpt_8"]
    assert job[4].save().ckpt_id == "ckpt_10"
    assert job[4].save() is job[4].saves[-1]  # saving the same step twice is one checkpoint

    fresh = make_job(tmp_path, interval=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh[4].restore() == 10 and fresh[4].global_step == 10 and fresh[4].restored_from == "ckpt_10"
    assert not [w for w in caught if "newer checkpoints" in str(w.message)]
    assert fresh[3].position == job[3].position
    assert_tables_equal(job[0].user, fresh[0].user)
    # rewinding: the newer checkpoints' steps will come again, and they cannot be overwritten
    with pytest.warns(UserWarning, match=r"newer checkpoints \['ckpt_8', 'ckpt_10'\].*CheckpointExistsError"):
        assert fresh[4].restore(global_step=4) == 4
    assert fresh[3].position == 4
    with pytest.raises(CheckpointNotFoundError, match="global step 5"):
        fresh[4].restore(global_step=5)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_right_after_restore_returns_the_restored_checkpoint(tmp_path, async_save):
    """A finished loop restarted (or one killed after its final save): restore() lands on the step, and the
    loop's final save() at that step is that checkpoint. Before, it wrote the step again and failed with
    CheckpointExistsError (sync) or AsyncSaveError (async)."""
    job = make_job(tmp_path, interval=4, async_save=async_save)
    train(job, 6)
    job[4].save()
    job[4].wait()
    fresh = make_job(tmp_path, interval=4, async_save=async_save)
    assert fresh[4].restore() == 6
    h = fresh[4].save()
    assert (h.ckpt_id, h.step, h.state) == ("ckpt_6", 6, "durable") and h.wait() == os.path.join(tmp_path, "ckpt_6")
    fresh[4].wait()
    assert fresh[4].saves == [] and committed(tmp_path) == ["ckpt_4", "ckpt_6"]
    train(fresh, 2)                       # the run goes on: step 8 saves as scheduled
    fresh[4].wait()
    assert committed(tmp_path) == ["ckpt_4", "ckpt_6", "ckpt_8"]


def test_retention_with_ephemeral_and_keep_every_k_across_restarts(tmp_path):
    kw = dict(interval=10, policies=[EphemeralEveryNSteps(3)], keep=KeepPolicy(max_keep=2, keep_every_n_steps=20))
    train(make_job(tmp_path, **kw), 25)
    # regular 10, 20; ephemeral 3..24 of which only the newest (24) survives
    assert on_disk(tmp_path) == ["ckpt_10", "ckpt_20", "ckpt_24"]
    job = make_job(tmp_path, **kw)
    assert job[4].restore() == 24
    train(job, 2)   # step 26 is not a save step: nothing newer, the restore point stays
    assert on_disk(tmp_path) == ["ckpt_10", "ckpt_20", "ckpt_24"]
    train(job, 1)   # 27: ephemeral, newer than 24 → 24 goes
    assert on_disk(tmp_path) == ["ckpt_10", "ckpt_20", "ckpt_27"]
    job2 = make_job(tmp_path, **kw)
    job2[4].restore()
    train(job2, 23)  # to 50: regular 30, 40, 50; keep newest 2 (40, 50) + every 20th (20, 40)
    assert on_disk(tmp_path) == ["ckpt_20", "ckpt_40", "ckpt_50"]   # 48 was ephemeral, 50 is newer
    assert committed(tmp_path) == ["ckpt_20", "ckpt_40", "ckpt_50"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_reads_only_the_new_manifest(tmp_path, monkeypatch, async_save):
    """Listing the checkpoints reads the catalog, not every manifest (one remote request each on fsspec
    stores): the version file update and the keep policy after a save share one listing, which reads
    no manifest: the catalog has the others, and the saver holds the one it has just committed."""
    from recckpt.format import catalog
    job = make_job(tmp_path, interval=1, async_save=async_save, keep=KeepPolicy(max_keep=4))
    train(job, 6)
    job[4].wait()
    real, reads = catalog.read_manifest, []
    monkeypatch.setattr(catalog, "read_manifest", lambda st, d: reads.append(d) or real(st, d))
    train(job, 1)
    job[4].wait()
    assert committed(tmp_path) == ["ckpt_4", "ckpt_5", "ckpt_6", "ckpt_7"]
    assert reads == []


def test_a_version_file_failure_after_retention_does_not_fail_the_committed_save(tmp_path, monkeypatch):
    from recckpt.format import catalog
    job = make_job(tmp_path, interval=1, keep=KeepPolicy(max_keep=1))
    train(job, 1)

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    real = catalog.write_version_file
    monkeypatch.setattr(catalog, "write_version_file", broken)
    with pytest.warns(UserWarning, match="version file"):
        train(job, 1)       # ckpt_2 commits; the version file is rewritten before any delete, and fails
    # so retention deleted nothing: a crash now could not leave the version file naming a deleted one
    assert job[4].saves[-1].durable and job[4].saver.checkpoints() == ["ckpt_1", "ckpt_2"]
    monkeypatch.setattr(catalog, "write_version_file", real)
    train(job, 1)           # the next save's retention catches up
    assert job[4].saver.checkpoints() == ["ckpt_3"] and committed(tmp_path) == ["ckpt_3"]


def test_manager_validates_combinations(tmp_path):
    saver = Saver(torch.nn.Linear(1, 1), output_dir=tmp_path)
    with pytest.raises(ValueError, match="more often"):
        CheckpointManager(saver, 5, policies=[EphemeralEveryNSteps(5)], save_rng=False)
    with pytest.raises(ValueError, match="max_keep must be an integer >= 1.*async"):
        CheckpointManager(saver, 5, keep=0, async_save=True, save_rng=False)
    with pytest.raises(TypeError, match="needs a recckpt.Saver"):
        CheckpointManager(object(), 5)


# --------------------------------------------------------------------------------------------- async
class SlowWrite:
    """Wraps saver.write: the background write waits until released, so the test controls timing."""

    def __init__(self, saver):
        self.saver, self.inner, self.release = saver, saver.write, threading.Event()
        saver.write = self

    def __call__(self, *a, **kw):
        assert self.release.wait(30)
        return self.inner(*a, **kw)


def test_async_save_is_a_consistent_snapshot_staged_then_durable(tmp_path):
    job = make_job(tmp_path, interval=None, async_save=True)
    model, sopt, dopt, reader, mgr = job
    train(job, 3)
    slow = SlowWrite(mgr.saver)
    h = mgr.save()
    assert h.state == "staged" and not h.durable
    expected = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    ref = make_job(str(tmp_path) + "_ref")[0]
    ref.load_state_dict(model.state_dict())
    ref.user.import_rows(model.user.ids(), {s: model.user.slot(s).clone() for s in model.user.slot_names})
    train(job, 5)           # training goes on and changes everything while the write waits
    assert not torch.equal(expected["mlp.0.weight"], model.mlp[0].weight)
    slow.release.set()
    assert h.wait(30).endswith("ckpt_3") and h.durable and h.bytes_written > 0
    loaded = make_job(tmp_path)
    loaded[4].restore()
    assert torch.equal(loaded[0].mlp[0].weight, expected["mlp.0.weight"])
    assert_tables_equal(ref.user, loaded[0].user)
    assert loaded[3].position == 3


def test_async_one_in_flight_and_buffers_reused(tmp_path):
    job = make_job(tmp_path, interval=2, async_save=True)
    mgr = job[4]
    slow = SlowWrite(mgr.saver)
    train(job, 2)
    first = mgr.saves[-1]
    assert first.state == "staged"
    threading.Timer(0.3, slow.release.set).start()
    t0 = time.perf_counter()
    train(job, 2)           # the next save waits for the first
    assert time.perf_counter() - t0 >= 0.25 and first.durable
    mgr.wait()
    ptrs = {k: b.data_ptr() for k, b in mgr._buffers._bufs.items()}
    assert any(k[:2] == ("sparse", "user") for k in ptrs) and any(k[0] == "dense" for k in ptrs)
    mgr.step()              # no training: tables did not grow, so every buffer is reused as is
    mgr.save().wait()
    assert {k: b.data_ptr() for k, b in mgr._buffers._bufs.items()} == ptrs
    assert committed(tmp_path) == ["ckpt_2", "ckpt_4", "ckpt_5"]


class Boom(OSError):
    pass


@pytest.mark.parametrize("surface", ["step", "save", "wait", "exit"])
def test_background_failure_surfaces_at_next_call_and_keeps_older(tmp_path, monkeypatch, surface):
    job = make_job(tmp_path, interval=2, async_save=True, keep=1)
    model, sopt, dopt, reader, mgr = job
    train(job, 2)
    mgr.wait()
    assert committed(tmp_path) == ["ckpt_2"]
    storage = mgr.saver.storage
    real = storage.open_write

    def failing(path, *a, **kw):
        if "ckpt_4" in path:
            raise Boom("disk full")
        return real(path, *a, **kw)

    monkeypatch.setattr(storage, "open_write", failing)
    train(job, 2)           # step 4 stages a save that fails in the background
    h = mgr.saves[-1]
    with pytest.raises(AsyncSaveError, match="ckpt_4.*disk full.*earlier checkpoints are intact"):
        if surface == "step":
            h._done.wait(30)
            train_step(model, sopt, dopt, reader)
            try:
                mgr.step()
            finally:   # the training step happened: it is counted, raise or not (a loop that catches
                assert mgr.global_step == 5   # and goes on must not fall a step behind its checkpoints)
        elif surface == "save":
            h._done.wait(30)
            mgr.save()
        elif surface == "wait":
            mgr.wait()
        else:
            with mgr:
                pass
    assert h.state == "failed"
    with pytest.raises(AsyncSaveError):
        h.wait()
    mgr.wait()              # reported once, not again
    assert committed(tmp_path) == ["ckpt_2"] and on_disk(tmp_path) == ["ckpt_2"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".staging")]
    monkeypatch.setattr(storage, "open_write", real)
    fresh = make_job(tmp_path)
    assert fresh[4].restore() == 2


def test_a_failure_found_while_draining_for_the_next_save_does_not_cancel_that_save(tmp_path, monkeypatch):
    """The previous async save fails only once the next save is draining it. Raising there would cancel
    this step's save on this rank, while ranks that saw the failure earlier save this step: on many
    ranks they would then save different checkpoints. The save goes ahead; the failure is reported by
    the next call."""
    import threading
    job = make_job(tmp_path, interval=2, async_save=True, keep=None)
    model, sopt, dopt, reader, mgr = job
    storage = mgr.saver.storage
    real_open, real_drain = storage.open_write, mgr._writer.drain
    draining = threading.Event()

    def failing(path, *a, **kw):
        if "ckpt_2" in path:
            assert draining.wait(30)      # fail only once the next save has started draining
            raise Boom("disk full")
        return real_open(path, *a, **kw)

    drains = []

    def drain():
        drains.append(1)
        if len(drains) == 2:              # the first drain is ckpt_2's own (nothing in flight yet)
            draining.set()
        real_drain()

    monkeypatch.setattr(storage, "open_write", failing)
    monkeypatch.setattr(mgr._writer, "drain", drain)
    train(job, 4)                         # step 2 fails in the background while step 4 drains it
    with pytest.raises(AsyncSaveError, match="ckpt_2.*disk full"):
        mgr.wait()
    assert [h.ckpt_id for h in mgr.saves] == ["ckpt_2", "ckpt_4"]
    assert committed(tmp_path) == ["ckpt_4"]


def _fail_ckpt_2_once(monkeypatch, storage, release: threading.Event) -> None:
    """ckpt_2's (background) write fails with "disk full", once `release` is set."""
    real_open = storage.open_write

    def failing(path, *a, **kw):
        if "ckpt_2" in path:
            assert release.wait(30)
            raise Boom("disk full")
        return real_open(path, *a, **kw)
    monkeypatch.setattr(storage, "open_write", failing)


def test_a_failure_reported_by_a_saving_step_does_not_cancel_that_steps_save(tmp_path, monkeypatch):
    """The previous async save's failure is recorded just before a step that saves. When a rank learns of
    it depends on when its background write ended; a rank that skipped this step's save for it would
    leave the other ranks saving alone. So step() saves, then raises the earlier failure."""
    job = make_job(tmp_path, interval=2, async_save=True, keep=None)
    model, sopt, dopt, reader, mgr = job
    release = threading.Event()           # fail only after step 3 has looked for failures
    _fail_ckpt_2_once(monkeypatch, mgr.saver.storage, release)
    train(job, 3)                         # step 2 starts a save that fails once released
    h = mgr.saves[-1]
    release.set()
    assert h._done.wait(30) and h.state == "failed"
    train_step(model, sopt, dopt, reader)
    with pytest.raises(AsyncSaveError, match="ckpt_2.*disk full"):
        mgr.step()                        # step 4: a saving step
    assert mgr.global_step == 4
    assert [x.ckpt_id for x in mgr.saves] == ["ckpt_2", "ckpt_4"]
    mgr.wait()                            # ckpt_4 is durable; the failure was reported once
    assert committed(tmp_path) == ["ckpt_4"]


def test_an_earlier_failure_is_raised_even_when_the_steps_own_save_fails(tmp_path, monkeypatch):
    """step() takes the previous async save's failure before its own save. When that save itself raised
    (here its snapshot runs out of memory), the taken failure was dropped: never raised by any later call.
    Now it is raised, with the step's own error as its cause."""
    job = make_job(tmp_path, interval=2, async_save=True, keep=None)
    model, sopt, dopt, reader, mgr = job
    real_capture = mgr.saver.capture_copy
    release = threading.Event()           # fail only after step 3 has looked for failures
    _fail_ckpt_2_once(monkeypatch, mgr.saver.storage, release)

    def no_memory(*a, **kw):
        if mgr.global_step == 4:
            raise MemoryError("cannot allocate host buffers")
        return real_capture(*a, **kw)

    monkeypatch.setattr(mgr.saver, "capture_copy", no_memory)
    train(job, 3)                         # step 2 starts a save that fails once released
    h = mgr.saves[-1]
    release.set()
    assert h._done.wait(30) and h.state == "failed"
    train_step(model, sopt, dopt, reader)
    with pytest.raises(AsyncSaveError, match="ckpt_2.*disk full") as e:
        mgr.step()                        # step 4: its snapshot fails
    assert isinstance(e.value.__cause__, MemoryError)
    mgr.wait()                            # reported once
    assert committed(tmp_path) == []


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("rank0_committed", [True, False])
def test_a_save_whose_outcome_was_lost_is_looked_up_before_saving_the_step_again(
        tmp_path, monkeypatch, async_save, rank0_committed):
    """As on a rank that handed its part to rank 0 and never heard the outcome: the save raises
    CommitOutcomeUnknownError (wrapped for async saves). Saving the same step again must not write a
    second time when rank 0 did commit it (that would fail on this rank alone), and must when not."""
    job = make_job(tmp_path, async_save=async_save)
    model, sopt, dopt, reader, mgr = job
    train_step(model, sopt, dopt, reader)
    mgr.step()
    real, calls = mgr.saver.write, []

    def lost_outcome(ckpt_id, *a, **kw):
        calls.append(ckpt_id)
        if len(calls) > 1:
            return real(ckpt_id, *a, **kw)
        if rank0_committed:
            real(ckpt_id, *a, **kw)
        raise CommitOutcomeUnknownError(f"rank 1: coordination of checkpoint {ckpt_id!r} failed during "
                                        f"waiting for the outcome")

    monkeypatch.setattr(mgr.saver, "write", lost_outcome)
    with pytest.raises(CommitOutcomeUnknownError, match="ckpt_1") as info:
        mgr.save()
        mgr.wait()
    assert isinstance(info.value, AsyncSaveError) == async_save
    assert "Nothing of it was committed" not in str(info.value)
    assert mgr.saver.checkpoints() == (["ckpt_1"] if rank0_committed else [])
    h = mgr.save()   # the same step again
    h.wait()
    assert h.durable and h.ckpt_id == "ckpt_1" and mgr.saver.checkpoints() == ["ckpt_1"]
    assert calls == (["ckpt_1"] if rank0_committed else ["ckpt_1", "ckpt_1"])


# ------------------------------------------------------------------------------------------- restore
def test_restore_on_empty_and_missing_output_dir_does_nothing(tmp_path):
    for out in (tmp_path / "empty", tmp_path / "missing"):
        if out.name == "empty":
            out.mkdir()
        model, _, _, reader, mgr = make_job(out, interval=3)
        before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        assert mgr.restore() is None and mgr.global_step == 0 and mgr.restored_from is None
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(global_step=3)


def test_restore_of_a_checkpoint_without_rng_state_seeds_the_rngs_from_its_step(tmp_path):
    """A checkpoint written by Saver.save(step=...) (or by a manager with save_rng=False) holds no RNG state:
    it is a restore point all the same. The RNGs are seeded from (step, rank), with a warning; IO state the
    job registered itself (the reader) is still required."""
    model, sopt, dopt, reader, _ = make_job(tmp_path / "job", interval=100)
    plain = Saver(model, sparse_optim=sopt, output_dir=tmp_path)
    plain.register_for_checkpointing("dense_opt", dopt)
    plain.register_io_state("reader", reader)
    plain.save("ckpt_5", step=5)
    draws = []
    for seed in (1, 2):
        model2, _, _, _, mgr2 = make_job(tmp_path, interval=100, seed=seed)
        with pytest.warns(UserWarning, match=r"__rng__.*holds none of it.*seeded from \(step 5, rank 0\)"):
            assert mgr2.restore() == 5
        assert mgr2.restored.io_state_dropped == ["__rng__"] and mgr2.restored.io_state == ["reader"]
        assert_tables_equal(model2.user, model.user)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])   # seeded from the step, whatever the job's own seed was

    class Position:
        def dump_io_state(self):
            return 0

        def load_io_state(self, state):
            pass

    bare = Saver(make_job(tmp_path / "other", interval=100)[0], output_dir=tmp_path)
    bare.register_io_state("reader", Position())
    bare.register_io_state("sampler", Position())
    with pytest.raises(IncompatibleCheckpointError, match="IO state 'sampler' is not in the checkpoint"):
        bare.load(ckpt_id="ckpt_5", load_conf={"exclude": ["extra"]})


def _corrupt_shard(ckpt_dir):
    sparse = os.path.join(ckpt_dir, "sparse")
    name = sorted(n for n in os.listdir(sparse) if not n.endswith(".json"))[0]
    path = os.path.join(sparse, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_on_corrupted_output_dir_falls_back_to_older(tmp_path):
    job = make_job(tmp_path, interval=3)
    train(job, 9)
    _corrupt_shard(tmp_path / "ckpt_9")
    with open(tmp_path / "ckpt_6" / "manifest.json", "wb") as f:
        f.write(b"{not json")
    with open(tmp_path / "checkpoint", "wb") as f:
        f.write(b"\xff\xfe garbage")
    with pytest.raises(CorruptCheckpointError, match="ckpt_9"):
        make_job(tmp_path)[4].restore(global_step=9)   # an explicit step never falls back
    fresh = make_job(tmp_path, interval=3)
    with pytest.warns(UserWarning) as caught:
        assert fresh[4].restore() == 3       # 9 fails its checksum, 6's manifest is unreadable
    texts = [str(w.message) for w in caught]
    assert any("ckpt_9" in t and "corrupt" in t for t in texts)
    # the steps lost are on the manager too, not only in warnings a job may silence
    skipped = fresh[4].restore_skipped
    assert len(skipped) == 2 and "ckpt_9 (step 9) is corrupt" in skipped[0] and "ckpt_6 (step 6)" in skipped[1], skipped
    assert fresh[3].position == 3
    # Every later restore skips them too, and their ids stay taken (never overwritten): the run saves those
    # steps under new ids (a job restarted by its scheduler failed at every first save), and keeps the
    # damaged ones for a look
    assert not any("newer checkpoints" in t for t in texts), texts
    assert [h.ckpt_id for h in train(fresh, 6)] == ["ckpt_6.1", "ckpt_9.1"]
    fresh[4].wait()
    assert (tmp_path / "ckpt_9" / "manifest.json").exists()
    again = make_job(tmp_path, interval=3)
    assert again[4].restore() == 9 and again[4].restored_from == "ckpt_9.1" and again[4].restore_skipped == []
    assert again[4].restore(global_step=9) == 9 and again[4].restored_from == "ckpt_9.1"
    # skipped again on another restart: the next free suffix
    _corrupt_shard(tmp_path / "ckpt_9.1")
    third = make_job(tmp_path, interval=3)
    with pytest.warns(UserWarning):
        assert third[4].restore() == 6
    assert [h.ckpt_id for h in train(third, 3)] == ["ckpt_9.2"]
    third[4].wait()
    for cid in ("ckpt_3", "ckpt_6.1", "ckpt_9.2"):
        _corrupt_shard(tmp_path / cid)
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError, match="ckpt_3") as e:
        make_job(tmp_path)[4].restore()
    # the last one's error says that the newer ones were skipped, and what to do (a helper's attack)
    assert "had skipped" in str(e.value) and "newer checkpoint(s) as corrupt" in str(e.value) and "recckpt verify" in str(e.value), e.value


def test_a_step_saved_again_after_a_damaged_one_keeps_the_older_restore_points(tmp_path):
    """A helper's attack on the re-saved ids: with keep=2, retention counted the damaged ckpt_9 beside
    ckpt_9.1 and deleted the intact ckpt_6; a damaged ckpt_9.1 (manifest) made every restart pick ckpt_9.1
    again and fail on the taken id; a damaged plain ckpt_9 manifest did the same with ckpt_9."""
    job = make_job(tmp_path, interval=3, keep=2)
    train(job, 9)
    job[4].wait()
    _corrupt_shard(tmp_path / "ckpt_9")
    fresh = make_job(tmp_path, interval=3, keep=2)
    with pytest.warns(UserWarning):
        assert fresh[4].restore() == 6
    assert [h.ckpt_id for h in train(fresh, 3)] == ["ckpt_9.1"]
    fresh[4].wait()
    # the damaged commit of step 9 counts for no kept place: the intact older one stays
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt_6", "ckpt_9.1"]
    # a manifest that does not verify: never listed, its id still taken
    with open(tmp_path / "ckpt_9.1" / "manifest.json", "r+b") as f:
        f.write(b"#")
    again = make_job(tmp_path, interval=3, keep=2)
    with pytest.warns(UserWarning):
        assert again[4].restore() == 6
    assert [h.ckpt_id for h in train(again, 3)] == ["ckpt_9"]   # (retention had deleted the damaged ckpt_9)
    again[4].wait()
    # keeping everything: ckpt_9 skipped by its load, ckpt_9.1 by the listing: the next free id
    other = tmp_path / "other"
    job = make_job(other, interval=3)
    train(job, 9)
    job[4].wait()
    _corrupt_shard(other / "ckpt_9")
    fresh = make_job(other, interval=3)
    with pytest.warns(UserWarning):
        assert fresh[4].restore() == 6
    assert [h.ckpt_id for h in train(fresh, 3)] == ["ckpt_9.1"]
    fresh[4].wait()
    with open(other / "ckpt_9.1" / "manifest.json", "r+b") as f:
        f.write(b"#")
    for want in ("ckpt_9.2", None):   # each restart comes up, and saves the step under a free id
        again = make_job(other, interval=3)
        with pytest.warns(UserWarning):
            got = again[4].restore()
        if want is None:
            assert got == 9 and again[4].restored_from == "ckpt_9.2"
            break
        assert got == 6 and [h.ckpt_id for h in train(again, 3)] == [want]
        again[4].wait()
    # a plain id whose manifest does not verify is passed over as well
    third = tmp_path / "third"
    job = make_job(third, interval=3)
    train(job, 9)
    job[4].wait()
    with open(third / "ckpt_9" / "manifest.json", "r+b") as f:
        f.write(b"#")
    fresh = make_job(third, interval=3)
    with pytest.warns(UserWarning):
        assert fresh[4].restore() == 6
    assert [h.ckpt_id for h in train(fresh, 3)] == ["ckpt_9.1"]


def test_retention_counts_only_the_last_commit_of_a_step():
    from recckpt.format.retention import CkptEntry, KeepPolicy
    entries = [CkptEntry(c, s, False) for c, s in (("ckpt_3", 3), ("ckpt_6", 6), ("ckpt_9", 9), ("ckpt_9.1", 9))]
    assert KeepPolicy(max_keep=2).doomed(entries) == ["ckpt_3", "ckpt_9"]
    assert KeepPolicy(max_keep=None, keep_every_n_steps=3).doomed(entries) == []   # keep all: all kept
    assert KeepPolicy(max_keep=1, keep_every_n_steps=9).doomed(entries) == ["ckpt_3", "ckpt_6", "ckpt_9"]
    # only a manager's re-saves (<id>.<n>) supersede: distinct checkpoints of one step (a Saver's saves
    # with one step=, a compaction beside its source) each keep their place (a review)
    same_step = [CkptEntry(c, 1, False) for c in ("epoch1_a", "epoch1_b", "epoch1_c", "epoch1_d")]
    assert KeepPolicy(max_keep=3).doomed(same_step) == ["epoch1_a"]
    chain = [CkptEntry(c, s, False) for c, s in (("ckpt_9", 9), ("ckpt_9.1", 9), ("ckpt_9.2", 9), ("x.1", 9))]
    assert KeepPolicy(max_keep=2).doomed(chain) == ["ckpt_9", "ckpt_9.1"]


def test_a_save_left_without_a_manifest_does_not_change_the_next_id(tmp_path):
    """An object store writes a save in place: a save killed mid-write leaves ckpt_9/ without a manifest,
    which start-up recovery removes. It is not a damaged checkpoint, and the step keeps its plain id."""
    import fsspec
    out = f"memory://{tmp_path.name}"
    job = make_job(out, interval=3)
    train(job, 6)
    job[4].wait()
    fsspec.filesystem("memory").pipe(f"/{tmp_path.name}/ckpt_9/sparse/shard-00000-000.bin", b"x" * 100)
    fresh = make_job(out, interval=3)
    assert fresh[4].restore() == 6 and fresh[4].restore_skipped == []
    assert [h.ckpt_id for h in train(fresh, 3)] == ["ckpt_9"]


# ---------------------------------------------------------------------------------------- model bank
def test_model_bank_applies_in_order_and_restore_takes_precedence(tmp_path):
    bank_a, bank_b, out = tmp_path / "a", tmp_path / "b", tmp_path / "run"
    ja = make_job(bank_a, seed=1)
    train(ja, 3)
    ja[4].save()
    jb = make_job(bank_b, seed=2)
    train(jb, 5)
    jb[4].save()

    job = make_job(out, interval=2)
    res = job[4].load_model_bank([
        {"path": str(bank_a)},                                           # an output_dir: its newest
        {"path": str(bank_b / "ckpt_5"), "load": ["sparse"], "tables": ["item"]},  # one table, later wins
    ])
    assert [r.ckpt_id for r in res] == ["ckpt_3", None]
    assert_tables_equal(ja[0].user, job[0].user)
    assert_tables_equal(jb[0].item, job[0].item, slots=["embedding"])
    assert torch.equal(job[0].mlp[0].weight, ja[0].mlp[0].weight)
    assert job[3].position == 0 and job[4].global_step == 0   # the bank never loads reader/step state
    assert job[4].restore() is None                            # fresh output_dir: the bank stays
    assert_tables_equal(ja[0].user, job[0].user)

    train(job, 2)
    job[4].wait()
    own = {k: v.clone() for k, v in job[0].state_dict().items() if isinstance(v, torch.Tensor)}
    again = make_job(out, interval=2)
    again[4].load_model_bank([{"path": str(bank_b)}])
    assert again[4].restore() == 2                             # output_dir wins over the bank
    assert all(torch.equal(own[k], v) for k, v in again[0].state_dict().items() if k in own)
    assert_tables_equal(job[0].user, again[0].user)
    with pytest.raises(ValueError, match="'path'"):
        again[4].load_model_bank([{"load": ["sparse"]}])
    # A restarted run never reads the bank: a source that is gone by now cannot fail the restart.
    assert again[4].load_model_bank([{"path": str(tmp_path / "nope")}]) == []
    with pytest.raises(CheckpointNotFoundError, match="model bank source #0"):
        make_job(tmp_path / "fresh")[4].load_model_bank([{"path": str(tmp_path / "nope")}])


def test_model_bank_sources_are_not_read_when_output_dir_has_a_checkpoint(tmp_path, monkeypatch):
    bank, out = tmp_path / "bank", tmp_path / "run"
    jb = make_job(bank, seed=1)
    train(jb, 3)
    jb[4].save()
    job = make_job(out, interval=2)
    train(job, 2)
    job[4].wait()
    again = make_job(out, interval=2)
    loads = []
    real = again[4].saver.load
    monkeypatch.setattr(again[4].saver, "load", lambda *a, **kw: loads.append(kw) or real(*a, **kw))
    assert again[4].load_model_bank([{"path": str(bank), "resume_step": True}]) == []
    assert loads == [] and again[4].global_step == 0
    assert again[4].restore() == 2 and len(loads) == 1


def test_model_bank_resume_step_continues_the_step_count(tmp_path):
    bank, out = tmp_path / "bank", tmp_path / "run"
    jb = make_job(bank, seed=1, interval=7)
    train(jb, 7)
    jb[4].wait()
    saved_w = jb[0].mlp[0].weight.detach().clone()
    jb[0].mlp[0].weight.data.fill_(0.25)          # changed after the save: must not be what loads
    job = make_job(out, interval=5)
    res = job[4].load_model_bank([{"path": str(bank), "resume_step": True, "load": ["sparse", "dense", "extra"]}])
    assert [r.ckpt_id for r in res] == ["ckpt_7"] and job[4].global_step == 7
    assert_tables_equal(jb[0].user, job[0].user, slots=["embedding"])   # sparse_opt was not asked for
    assert torch.equal(job[0].mlp[0].weight, saved_w)
    train(job, 3)                                   # steps 8..10: saves ckpt_10 into the new output_dir
    job[4].wait()
    assert committed(out) == ["ckpt_10"]
    with pytest.raises(ValueError, match="resume_step must be a bool"):
        make_job(tmp_path / "x")[4].load_model_bank([{"path": str(bank), "resume_step": "yes"}])


# ---------------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("async_save", [False, True])
def test_resume_in_process_gives_identical_losses(tmp_path, async_save):
    whole = run(tmp_path / "whole", 24, interval=5, async_save=async_save)
    first = run(tmp_path / "cut", 13, interval=5, async_save=async_save)
    rest = run(tmp_path / "cut", 24, interval=5, async_save=async_save)   # restores ckpt_10
    assert first == whole[:13]
    assert rest == whole[10:]


def test_without_rng_state_the_resume_differs(tmp_path):
    """Control for the test above: the comparison is sensitive to RNG state (dropout, new ids)."""
    whole = run(tmp_path / "whole", 16, interval=5, save_rng=False)
    run(tmp_path / "cut", 12, interval=5, save_rng=False)
    rest = run(tmp_path / "cut", 16, interval=5, save_rng=False)
    assert rest != whole[10:]


# -------------------------------------------------------------------------------------- preemption
def test_user_signal_saves_at_the_next_step_boundary(tmp_path):
    handler = PreemptionHandler(signals=(signal.SIGUSR1,), exit_after_save=False)
    prev = signal.getsignal(signal.SIGUSR1)
    job = make_job(tmp_path, interval=100, async_save=True, preemption=handler)
    assert signal.getsignal(signal.SIGUSR1) != prev
    try:
        train(job, 3)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.requested == signal.SIGUSR1 and committed_or_none(tmp_path) == []
        train(job, 1)
        assert job[4].preempted and job[4].saves[-1].durable
        assert committed(tmp_path) == ["ckpt_4"]
    finally:
        job[4].close()
    assert signal.getsignal(signal.SIGUSR1) == prev


def test_a_served_preemption_request_saves_once_when_the_loop_goes_on(tmp_path):
    """With exit_after_save=False the request stayed set: every later step wrote another preemption
    checkpoint (a helper's long-running-job attack)."""
    handler = PreemptionHandler(signals=(signal.SIGUSR1,), exit_after_save=False)
    job = make_job(tmp_path, interval=100, preemption=handler)
    try:
        train(job, 2)
        os.kill(os.getpid(), signal.SIGUSR1)
        handles = train(job, 4)
        assert job[4].preempted and handler.requested is None
        assert committed(tmp_path) == ["ckpt_3"]
        # the step that saved for the signal says so, as a step that saves for a policy does (it said None)
        assert [h.ckpt_id for h in handles] == ["ckpt_3"] and handles[0].durable
    finally:
        job[4].close()


@pytest.mark.parametrize("mode,saved", [("dropped", ["ckpt_1"]), ("shared", ["ckpt_1"]), ("close", [])])
def test_sigterm_is_never_swallowed_by_a_manager_that_is_gone(tmp_path, mode, saved):
    """dropped: a manager dropped without close() kept its handler installed; a later manager's preemption
    save passed SIGTERM on to it, which only set a flag nobody read, so the process went on training (and
    saved at every step). shared: a handler given to the next phase's manager was switched off when the old
    manager was freed (a review of the first fix). close: a signal after the last step was dropped by
    close(). In each, the process now ends by SIGTERM, after the preemption checkpoint where a step
    served it (each install of a handler is a link of its own, which passes signals on once retired)."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = os.path.join(os.path.dirname(__file__), "..", "helpers", "dropped_preemption_child.py")
    run = subprocess.run([sys.executable, child, str(tmp_path), mode], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == -signal.SIGTERM and "alive" not in run.stdout, (run.returncode, run.stdout, run.stderr)
    assert committed_or_none(tmp_path) == saved   # the second phase's preemption checkpoint, at its first step


@pytest.mark.parametrize("mode", ["two", "two-reversed"])
def test_sigterm_makes_every_live_manager_of_the_process_save_before_it_ends(tmp_path, mode):
    """Two managers with preemption in one process (two models, two output dirs): only the one installed
    last heard the signal, so the other's final checkpoint was never written (a helper's attack)."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = os.path.join(os.path.dirname(__file__), "..", "helpers", "dropped_preemption_child.py")
    run = subprocess.run([sys.executable, child, str(tmp_path), mode], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == -signal.SIGTERM and "alive" not in run.stdout, (run.returncode, run.stdout, run.stderr)
    assert committed_or_none(str(tmp_path / "a")) == ["ckpt_1"] and committed_or_none(str(tmp_path / "b")) == ["ckpt_1"]


def committed_or_none(out):
    return committed(out) if os.path.exists(os.path.join(out, "checkpoint")) else []


def test_a_manager_of_several_shards_without_a_process_group_is_refused_by_name(tmp_path):
    """It raised torch's own ValueError ("Default process group has not been initialized")."""
    from recckpt import HashTable
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    with pytest.raises(InvalidArgumentError, match=r"shard_num=2 needs an initialised torch.distributed"):
        CheckpointManager(Saver(m, output_dir=str(tmp_path)), 1, shard_id=0, shard_num=2)


def test_an_async_failure_is_reported_even_when_the_next_save_fails_before_it_is(tmp_path):
    """A step drains a failed async save without raising it (docs/DISTRIBUTED.md); the next save failing
    too overwrote it, so the first failure was only logged (a helper's attack on 2-rank crashes). Now the
    first is raised, naming the later ones."""
    import time as _time

    from recckpt import HashTable

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = HashTable("t", dim=4)
            self.lin = torch.nn.Linear(4, 1)

    m = M()
    m.t(torch.arange(10))
    mgr = CheckpointManager(Saver(m, output_dir=str(tmp_path)), 2, async_save=True)
    real = mgr.saver.write

    def failing(ckpt_id, *a, **k):
        if ckpt_id == "ckpt_2":
            _time.sleep(0.5)   # still in flight when step 3 looks; drained, not raised, by step 4
        raise OSError(28, f"injected ENOSPC in {ckpt_id}")

    mgr.saver.write = failing
    raised = []
    for s in range(1, 7):
        try:
            mgr.step()
        except AsyncSaveError as e:
            raised.append(str(e))
    mgr.saver.write = real
    try:
        mgr.wait()
    except AsyncSaveError as e:
        raised.append(str(e))
    # however the saves interleave with the steps, every failure reaches the caller, once
    told = " ".join(raised)
    for ckpt in ("ckpt_2", "ckpt_4", "ckpt_6"):
        assert told.count(f"'{ckpt}'") == 1, raised


def test_the_list_of_saves_is_bounded(tmp_path, monkeypatch):
    """A job saving at every interval for weeks grew `saves` by a handle (with its lock and event) each time
    (a helper's long-running-job attack); it keeps the last SAVES_KEPT."""
    from recckpt.train import manager as manager_module
    monkeypatch.setattr(manager_module, "SAVES_KEPT", 3)
    job = make_job(tmp_path, interval=1)
    train(job, 5)
    job[4].close()
    assert [h.ckpt_id for h in job[4].saves] == ["ckpt_3", "ckpt_4", "ckpt_5"]


def test_a_refused_manager_leaves_its_saver_as_it_was_and_the_next_manager_works(tmp_path):
    """The constructor set the Saver's retention and registered the RNG state before its last checks: a
    refused `async_save` left a max_keep=1 Saver keeping everything, and every later manager on that Saver
    (after a refused one, or after close()) failed with "'__rng__' is already registered" (a helper's attack)."""
    from recckpt import HashTable
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    saver = Saver(m, output_dir=str(tmp_path), max_keep=1)
    for bad in ({"keep": None, "async_save": "yes"}, {"preemption": "yes"}):
        with pytest.raises(InvalidArgumentError):
            CheckpointManager(saver, 1, **bad)
        assert saver.keep == KeepPolicy(max_keep=1)
    for _ in range(2):   # a manager, closed, then another on the same Saver
        mgr = CheckpointManager(saver, 1)
        mgr.restore()
        mgr.step()
        mgr.close()
    assert saver.checkpoints() == ["ckpt_2"]
    for use in (mgr.step, mgr.save):   # a closed manager handles no preemption: it saves no more
        with pytest.raises(InvalidArgumentError, match=r"after close\(\)"):
            use()


def test_restore_checks_its_arguments_before_it_finds_the_directory_empty(tmp_path):
    """A typo in load_conf passed the first run (nothing to restore) and failed only the resume after a
    preemption; a global_step of another type was looked up and reported as missing beside the step."""
    from recckpt import HashTable
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    mgr = CheckpointManager(Saver(m, output_dir=str(tmp_path)), 1)
    for kw in ({"load_conf": {"bogus": 1}}, {"load_conf": 5}, {"global_step": "1"}, {"global_step": True},
               {"global_step": -1}):
        with pytest.raises((LoadConfigError, InvalidArgumentError)):
            mgr.restore(**kw)
    assert mgr.restore() is None
