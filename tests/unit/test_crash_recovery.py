"""Start-up recovery: what a crashed save or delete leaves behind is removed (with a log line) at the
first save of a Saver on worker 0, never by loads, never the staging directory of a save in flight; the
version file is rebuilt; on stores without atomic rename, deletion removes the manifest first."""
from __future__ import annotations

import errno
import logging
import os
import uuid

import pytest

from helpers import stress_harness as h
from recckpt import Saver
from recckpt.errors import CheckpointSaveError
from recckpt.format import catalog
from recckpt.storage import open_storage
from recckpt.storage.faulty import FaultyStorage


def _saver(out, step=1, **kw):
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, step)
    return h.make_saver(str(out), m, e, r, **kw)


def test_first_save_removes_leftovers_with_a_log_line_and_rebuilds_the_version_file(tmp_path, caplog):
    _saver(tmp_path, 0, max_keep=None).save("s000000")
    for d in (".staging-s000001-abc", ".deleting-s000000-def"):
        os.makedirs(tmp_path / d / "sparse")
        (tmp_path / d / "sparse" / "x.bin").write_bytes(b"x" * 10)
    (tmp_path / ".checkpoint.tmp-1234").write_bytes(b"s000000\n")
    (tmp_path / "checkpoint").write_bytes(b"\xff garbage")
    (tmp_path / "notes").mkdir()   # the user's own directory: never touched
    s = _saver(tmp_path, 1, max_keep=None)
    s.load()   # loads never clean up: a reader may share the directory with a running job
    assert (tmp_path / ".staging-s000001-abc").exists()
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        s.save("s000001")
    msgs = [r.getMessage() for r in caplog.records]
    for d in (".staging-s000001-abc", ".deleting-s000000-def", ".checkpoint.tmp-1234"):
        assert not (tmp_path / d).exists()
        assert any(d in m and "interrupted" in m for m in msgs), msgs
    assert sorted(os.listdir(tmp_path)) == [".catalog.json", "checkpoint", "notes", "s000000", "s000001"]
    assert open(tmp_path / "checkpoint").read() == "s000000\ns000001\n"


def test_recovery_keeps_the_staging_of_other_workers_of_the_same_save(tmp_path):
    os.makedirs(tmp_path / ".staging-old-0000")
    s1 = _saver(tmp_path)
    s1.save("c", shard_id=1, shard_num=2)      # worker 1 first: its part waits in the staging dir
    stage = [d for d in os.listdir(tmp_path) if d.startswith(".staging-c-")]
    assert len(stage) == 1
    s0 = _saver(tmp_path)
    s0.save("c", shard_id=0, shard_num=2)      # worker 0's start-up recovery must keep it
    assert not (tmp_path / ".staging-old-0000").exists()
    assert Saver(h.Model(), output_dir=tmp_path).checkpoints() == ["c"]
    import recckpt
    rep = recckpt.verify(str(tmp_path / "c"))
    assert rep.ok and sorted(rep.tables) == ["item", "user"], rep


def test_recovery_runs_once_per_saver(tmp_path):
    s = _saver(tmp_path, max_keep=None)
    s.save("s000001")
    os.makedirs(tmp_path / ".staging-x-1")   # appears while this Saver runs: not its business any more
    s.save("s000002")
    assert (tmp_path / ".staging-x-1").exists()
    _saver(tmp_path, max_keep=None).save("s000003")
    assert not (tmp_path / ".staging-x-1").exists()


def _memory_url():
    return f"memory://recovery-{uuid.uuid4().hex[:8]}"


def test_non_atomic_store_leftover_checkpoint_without_manifest_is_removed(tmp_path):
    url = _memory_url()
    _saver(url, 0).save("s000000")
    st = open_storage(url)
    # a save whose data was moved but whose manifest never got written; and a user directory
    st.makedirs("s000001/sparse")
    st.write_bytes("s000001/sparse/shard-00000-000.bin", b"xx")
    st.write_bytes("s000001/dense.safetensors", b"yy")
    st.makedirs("mine")
    st.write_bytes("mine/readme.txt", b"keep")
    assert Saver(h.Model(), output_dir=url).checkpoints() == ["s000000"]
    _saver(url, 2).save("s000002")
    assert not st.exists("s000001") and st.exists("mine/readme.txt")
    _saver(url, 1).save("s000001")   # the id is usable again


def test_non_atomic_delete_removes_the_manifest_first(tmp_path):
    url = _memory_url()
    _saver(url, 0).save("s000000")
    s = _saver(url, 1, max_keep=1)
    fs = s.storage = FaultyStorage(s.storage)
    s.save("s000001")  # recovery done; now fail the data removal of the next delete
    fs.arm("remove", 2, errno.EIO)   # remove #1: the manifest of s000000 (retention); #2: its data
    with pytest.warns(UserWarning, match="deleting old checkpoints failed"):
        s.save("s000002")
    st = open_storage(url)
    assert fs.fired == [("remove", errno.EIO, "s000001")]
    # invalidated (manifest gone, so not listed) although its data could not be removed
    assert Saver(h.Model(), output_dir=url).checkpoints() == ["s000002"]
    assert st.exists("s000001/sparse") and not st.exists("s000001/manifest.json")
    _saver(url, 3).save("s000003")   # a new Saver's start-up recovery removes the rest
    assert not st.exists("s000001")


def test_failed_commit_on_non_atomic_store_leaves_no_checkpoint_directory(tmp_path):
    url = _memory_url()
    _saver(url, 0).save("s000000")
    s = _saver(url, 1)
    fs = s.storage = FaultyStorage(s.storage)
    s.save("s000001")
    # the manifest is the last write of a save on this store: fail it
    probe = _saver(_memory_url(), 1)
    probe.save("a")
    probe.storage = pf = FaultyStorage(probe.storage)
    probe.save("b")
    n_writes = pf.counts()["write"]
    fs.arm("write", n_writes - 2, errno.ENOSPC)   # the last two writes are the version file's and the catalog's
    with pytest.raises(CheckpointSaveError, match="Nothing was committed"):
        s.save("s000002")
    assert fs.fired[0][2].endswith("s000002/manifest.json"), fs.fired
    assert not open_storage(url).exists("s000002")
    assert catalog.committed(open_storage(url))[-1][0] == "s000001"
