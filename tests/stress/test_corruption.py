"""Corruption is always caught: one flipped byte or a truncation of any file of a checkpoint gives
CorruptCheckpointError naming the file, from a load by id and from recckpt.verify; restoring the newest
skips (with a warning) a checkpoint whose manifest no longer verifies."""
from __future__ import annotations

import logging
import os
import random

import pytest

import recckpt
from helpers import hostile, stress_harness as h
from recckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from recckpt.format.verifier import main as verify_main


def test_corruption_sweep_sample(tmp_path):
    rec = h.run_corruption(80, str(tmp_path), seed=5)
    assert rec.trials == 80
    assert not rec.failures, str(rec)


@pytest.mark.slow
def test_corruption_sweep_1000(tmp_path):
    rec = h.run_corruption(1000, str(tmp_path), seed=6)
    assert not rec.failures, str(rec)


def test_every_file_of_the_template_is_swept(tmp_path):
    """The sweep goes round-robin over files: 80 trials cover each kind of file several times."""
    ckpt = h.build_template(str(tmp_path))
    files = h._files(ckpt)
    kinds = {"manifest.json", "index.json", "dense.safetensors", "extras.safetensors"}
    assert kinds <= set(files)
    assert any(f.endswith(".bin") for f in files) and any(f.startswith("io_state/worker-00001") for f in files)
    assert any(f.endswith(".index.json") and f.startswith("sparse/") for f in files)
    assert len(files) <= 40


def test_verify_reports_an_intact_checkpoint(tmp_path, capsys):
    ckpt = h.build_template(str(tmp_path))
    rep = recckpt.verify(ckpt)
    assert rep.ok and rep.problems == [] and rep.ckpt_id == "c"
    assert rep.tables == {"user": 200 + (7 * 37) % 150, "item": 200 + (7 * 37) % 150}
    assert rep.files_checked == len(h._files(ckpt)) and rep.unlisted == []
    rep.raise_if_failed()
    assert verify_main([ckpt]) == 0 and "OK" in capsys.readouterr().out


def test_verify_lists_every_broken_file_and_unlisted_ones(tmp_path, capsys):
    ckpt = h.build_template(str(tmp_path))
    rng = random.Random(0)
    h.corrupt_one(ckpt, "dense.safetensors", rng)
    shard = next(f for f in h._files(ckpt) if f.endswith(".bin"))
    os.truncate(os.path.join(ckpt, shard), 10)
    open(os.path.join(ckpt, "sparse", "stray.txt"), "w").write("x")
    rep = recckpt.verify(ckpt)
    assert not rep.ok
    assert any("dense.safetensors" in p for p in rep.problems)
    assert any(shard in p and "truncated" in p for p in rep.problems)
    assert rep.unlisted == ["sparse/stray.txt"]
    with pytest.raises(CorruptCheckpointError, match="more problems"):
        rep.raise_if_failed()
    assert verify_main([ckpt]) == 1 and "CORRUPT" in capsys.readouterr().out
    with pytest.raises(CheckpointNotFoundError, match="is an output directory, not one checkpoint.*/c "):
        recckpt.verify(str(tmp_path))


def test_verify_catches_ids_in_the_wrong_bucket(tmp_path):
    """A writer bug (not bit rot): checksums fine, but ids sit in buckets their hash does not give."""
    import numpy as np

    from recckpt import _C
    ckpt = h.build_template(str(tmp_path))
    idx = hostile._parsed_index(ckpt)
    seg = idx.tables["user"][1][0]
    path = os.path.join(ckpt, idx.files[seg.file][0])
    col = seg.columns[0]
    data = bytearray(open(path, "rb").read())
    ids = np.frombuffer(bytes(data[col.offset:col.offset + col.length]), "<i8").copy()
    assert seg.file == 0 and len(ids) >= 2
    assert _C.bucket_of(ids[:1], 16)[0] != _C.bucket_of(ids[-1:], 16)[0]
    ids[[0, -1]] = ids[[-1, 0]]
    data[col.offset:col.offset + col.length] = ids.tobytes()
    open(path, "wb").write(bytes(data))
    # re-sign everything so that only the bucket check can notice
    hostile.resign_segment_crcs(ckpt, "user")
    rep = recckpt.verify(ckpt)
    assert any("not in the buckets" in p for p in rep.problems), rep.problems


def test_restore_newest_skips_a_checkpoint_whose_manifest_is_corrupt(tmp_path, caplog):
    for step in (1, 2):
        m, e, r = h.Model(), {}, h.Reader()
        h.set_step_state(m, e, r, step)
        h.make_saver(str(tmp_path), m, e, r, max_keep=None).save(f"s{step:06d}")
    h.corrupt_one(str(tmp_path / "s000002"), "manifest.json", random.Random(1))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        got, m, e, r = h.restore(str(tmp_path))
    assert got == 1 and h.check_restored_equals_step(m, e, r, 1) is None
    assert any("s000002" in rec.getMessage() and "skipping" in rec.getMessage() for rec in caplog.records)
    # asked for by id it is an error naming the file, never a silent fallback
    m, e, r = h.Model(), {}, h.Reader()
    with pytest.raises(CorruptCheckpointError, match=r"s000002/manifest\.json"):
        h.make_saver(str(tmp_path), m, e, r).load(ckpt_id="s000002")
