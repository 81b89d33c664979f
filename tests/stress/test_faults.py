"""Storage faults: ENOSPC and EIO injected at every write, fsync, rename, ... of a save, in the Python
storage layer and in the engine's shard writes. The save fails with CheckpointSaveError saying what
failed and what to do (or, for post-commit housekeeping, succeeds with a warning); earlier checkpoints
stay intact and loadable, nothing partial is listed, and the next save succeeds."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from helpers import stress_harness as h
from recckpt import _C, Saver
from recckpt.errors import CheckpointSaveError
from recckpt.storage.faulty import FaultyStorage


def test_fault_sweep_sample(tmp_path):
    rec = h.run_faults(str(tmp_path), limit_per_op=2, seed=3)
    # every op kind that a save performs, twice, two errnos (a save with retention rewrites the version
    # file once, before its deletes: 28 positions); a late engine-write position that a save happens not
    # to reach (the engine merges writes depending on timing) is counted apart
    assert rec.trials + rec.not_reached >= 28 and rec.trials >= 24, str(rec)
    assert not rec.failures, str(rec)


@pytest.mark.slow
def test_fault_sweep_every_operation(tmp_path):
    rec = h.run_faults(str(tmp_path), limit_per_op=None)
    assert not rec.failures, str(rec)


def test_fault_sweep_on_an_fsspec_store(tmp_path):
    """Stores without atomic rename: data moved first, manifest last; a fault anywhere leaves nothing
    listed that is partial."""
    rec = h.run_faults(f"memory://faults-{os.getpid()}-{id(tmp_path)}", limit_per_op=1, seed=4,
                       errnos=(errno.EIO,))
    assert rec.trials >= 6, str(rec)
    assert not rec.failures, str(rec)


def _saver(out, step, max_keep=2):
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, step)
    return h.make_saver(str(out), m, e, r, max_keep=max_keep)


def test_disk_full_in_the_engine_names_the_file_and_says_what_to_do(tmp_path):
    _saver(tmp_path, 0).save("s000000")
    s = _saver(tmp_path, 1)
    s.storage = FaultyStorage(s.storage).arm("engine_write", 2, errno.ENOSPC)
    with pytest.raises(CheckpointSaveError) as ei:
        s.save("s000001")
    msg = str(ei.value)
    assert "No space left on device" in msg and "shard-00000-" in msg and "free space" in msg, msg
    assert "Nothing was committed" in msg
    s.storage.disarm()
    assert Saver(h.Model(), output_dir=tmp_path).checkpoints() == ["s000000"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".staging")]
    s.save("s000001")
    assert Saver(h.Model(), output_dir=tmp_path).checkpoints() == ["s000000", "s000001"]


def test_out_of_memory_in_the_engine_fails_the_save_and_keeps_the_last_checkpoint(tmp_path):
    """A writer thread out of memory (the engine's "alloc" hook, here where a failed shard pwrite's message is
    built) fails the save naming the file; it used to std::terminate the training process."""
    _saver(tmp_path, 0).save("s000000")
    s = _saver(tmp_path, 1)
    _C._inject_fault("write", 1, errno.EIO)
    _C._inject_fault("alloc", 1)
    try:
        with pytest.raises(CheckpointSaveError) as ei:
            s.save("s000001")
        assert _C._fault_seen("alloc") == 1
    finally:
        _C._inject_fault("write", 0)
        _C._inject_fault("alloc", 0)
    msg = str(ei.value)
    assert "out of memory" in msg and "shard-" in msg and "Nothing was committed" in msg, msg
    step, m, e, r = h.restore(str(tmp_path))
    assert step == 0 and h.check_restored_equals_step(m, e, r, 0) is None
    s.save("s000001")
    assert Saver(h.Model(), output_dir=tmp_path).checkpoints() == ["s000000", "s000001"]


def test_fsync_failure_after_the_rename_says_the_checkpoint_is_committed_but_not_durable(tmp_path):
    _saver(tmp_path, 0).save("s000000")
    s = _saver(tmp_path, 1)
    fs = s.storage = FaultyStorage(s.storage)
    fs.disarm()
    # find the fsync of output_dir right after the commit rename: the first fsync after the 1st rename
    s2 = _saver(tmp_path / "probe", 1)
    s2.save("x")  # start-up recovery done
    probe = s2.storage = FaultyStorage(s2.storage)
    calls = []
    orig = probe.inner.fsync_dir
    probe.inner.fsync_dir = lambda p: (calls.append((p, probe.counts()["rename"], probe.counts()["fsync"])), orig(p))[1]
    s2.save("y")
    at = next(f for p, r, f in calls if p == "" and r == 1)
    fs.arm("fsync", at, errno.EIO)
    with pytest.raises(CheckpointSaveError, match="was committed, but making the commit durable failed"):
        s.save("s000001")
    assert fs.fired and fs.fired[0][2] == ""
    fs.disarm()
    assert "s000001" in Saver(h.Model(), output_dir=tmp_path).checkpoints()


def test_version_file_failure_after_commit_is_a_warning_and_repaired_by_the_next_save(tmp_path):
    _saver(tmp_path, 0, max_keep=None).save("s000000")
    s = _saver(tmp_path, 1, max_keep=None)
    s.storage = FaultyStorage(s.storage).arm("replace", 1, errno.ENOSPC)
    with pytest.warns(UserWarning, match="is committed, but updating the version file"):
        s.save("s000001")
    assert open(tmp_path / "checkpoint").read().split() == ["s000000"]   # stale
    assert Saver(h.Model(), output_dir=tmp_path).checkpoints() == ["s000000", "s000001"]  # still listed
    s.storage.disarm()
    s.save("s000002")
    assert open(tmp_path / "checkpoint").read().split() == ["s000000", "s000001", "s000002"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".") and n != ".catalog.json"]


def test_faulty_storage_rejects_unknown_ops(tmp_path):
    fs = FaultyStorage(Saver(torch.nn.Linear(1, 1), output_dir=tmp_path).storage)
    with pytest.raises(ValueError, match="unknown fault op"):
        fs.arm("chmod", 1)
    with pytest.raises(ValueError, match=">= 1"):
        fs.arm("write", 0)
