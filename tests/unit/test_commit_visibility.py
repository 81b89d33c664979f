"""Before a commit, rank 0 checks that every file every rank wrote is where it commits, with its size
(issue 29 item 3), on a local disk and on an object store; a file that shows up late is waited for.
Here the shards are saved one after another from one process (no process group), and a file of shard
1 is taken away (or cut short) between its save and the committing save of shard 0;
tests/multiprocess/test_unshared_output_dir.py runs the real case (two ranks, two private disks)."""
from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

from helpers.tables import DictTable
from recckpt import SaveOptions, Saver
from recckpt.errors import CheckpointSaveError
from recckpt.state.protocol import SlotSpec


def model(rank):
    m = torch.nn.Module()
    m.t = DictTable("t", {"embedding": SlotSpec(torch.float32, (4,), "sparse")})
    m.t.set_rows(torch.arange(rank * 100, rank * 100 + 50), {"embedding": torch.full((50, 4), float(rank))})
    return m


def savers(url, visibility_s=0.5, storage_options=None):
    opts = SaveOptions(num_buckets=8, fsync=False, visibility_timeout_s=visibility_s)
    return [Saver(model(r), output_dir=url, max_keep=None, options=opts, storage_options=storage_options)
            for r in range(2)]


def save_shard1(s1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "written but not committed": it waits for shard 0
        s1.save("c", shard_id=1, shard_num=2)


def shard1_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if "-00001" in f)


def test_a_missing_file_of_another_rank_fails_the_save(tmp_path):
    out = str(tmp_path / "out")
    s0, s1 = savers(out)
    s0.save("before", shard_id=0, shard_num=1)
    save_shard1(s1)
    victim = [f for f in shard1_files(out) if f.endswith(".bin")][0]
    os.remove(victim)
    with pytest.raises(CheckpointSaveError) as e:
        s0.save("c", shard_id=0, shard_num=2)
    text = str(e.value)
    assert "not shared between the ranks" in text and "rank(s) 1" in text
    assert os.path.basename(victim) in text and "seen: missing" in text
    assert "shared filesystem" in text and "object store" in text
    assert s0.checkpoints() == ["before"]
    assert not [n for n in os.listdir(out) if n.startswith(".staging-")], "the failed save's staging is removed"


def test_a_short_file_fails_the_save(tmp_path):
    out = str(tmp_path / "out")
    s0, s1 = savers(out)
    save_shard1(s1)
    victim = shard1_files(out)[0]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(CheckpointSaveError, match=rf"{size} bytes; seen: {size - 1} bytes"):
        s0.save("c", shard_id=0, shard_num=2)
    assert s0.checkpoints() == []


def test_a_file_that_shows_up_late_is_waited_for(tmp_path, caplog):
    out = str(tmp_path / "out")
    s0, s1 = savers(out, visibility_s=30.0)
    save_shard1(s1)
    victim = shard1_files(out)[-1]
    os.rename(victim, victim + ".away")
    back = threading.Timer(0.5, os.rename, (victim + ".away", victim))
    back.start()
    with caplog.at_level("INFO", logger="recckpt"):
        s0.save("c", shard_id=0, shard_num=2)
    back.join()
    assert s0.checkpoints() == ["c"]
    assert any("not visible yet" in r.getMessage() for r in caplog.records)
    m = torch.nn.Module()
    m.t = DictTable("t", {"embedding": SlotSpec(torch.float32, (4,), "sparse")})
    assert Saver(m, output_dir=out).load().sparse_rows == 100


def test_an_object_store_missing_file_fails_the_save(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    s0, s1 = savers(url, storage_options=s3_server.options())
    save_shard1(s1)
    fs = s3_server.fs()
    victims = [p for p in fs.find(f"{s3_bucket}/run") if "-00001" in p]
    assert victims
    fs.rm(victims[0])
    with pytest.raises(CheckpointSaveError) as e:
        s0.save("c", shard_id=0, shard_num=2)
    text = str(e.value)
    assert "rank(s) 1" in text and "not in this store" in text and "endpoint_url" in text, text
    assert s0.checkpoints() == []


def test_parts_parked_in_process_are_dropped_after_the_timeout(tmp_path, caplog):
    """Issue 29 item 7: a shard saved from this process waits for the other shards; one that never
    comes left its part (and a protected staging directory) parked forever."""
    import time

    from recckpt.coordination import InProcessCoordinator
    out = str(tmp_path / "out")
    opts = SaveOptions(num_buckets=8, fsync=False, coordination_timeout_s=0.2)
    s1 = Saver(model(1), output_dir=out, options=opts)
    save_shard1(s1)
    probe = InProcessCoordinator(0, 2)
    assert list(probe.active_nonces(s1.storage.describe())) == ["c"]
    assert [n for n in os.listdir(out) if n.startswith(".staging-c-")]
    time.sleep(0.3)
    with caplog.at_level("WARNING", logger="recckpt"):
        assert probe.active_nonces(s1.storage.describe()) == {}
    assert any("dropped the parts of checkpoint 'c'" in r.getMessage() and "shard(s) [0]" in r.getMessage()
               for r in caplog.records)
    Saver(model(0), output_dir=out, options=opts).save("other")     # its start-up recovery may now clean up
    assert not [n for n in os.listdir(out) if n.startswith(".staging-c-")]


def test_a_single_shard_saves_recovery_leaves_parts_parked_in_process_alone(tmp_path):
    out = str(tmp_path / "out")
    s0, s1 = savers(out)
    save_shard1(s1)
    Saver(model(0), output_dir=out, options=SaveOptions(num_buckets=8, fsync=False)).save("other")
    s0.save("c", shard_id=0, shard_num=2)          # shard 1's staged files are still there: it commits
    assert s0.checkpoints() == ["other", "c"]
