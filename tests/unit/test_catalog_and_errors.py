"""Version file, max_keep across restarts, and bad input: missing paths, garbled version files,
unsafe checkpoint ids, corrupted bytes."""
from __future__ import annotations

import os
import random

import pytest
import torch

from helpers.tables import assert_tables_equal
from recckpt import HashTable, SaveOptions, Saver
from recckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidCheckpointIdError,
)

OPTS = SaveOptions(num_buckets=16, chunk_bytes=128, segment_bytes=2048, fsync=False)


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = HashTable("t", dim=8)
        self.lin = torch.nn.Linear(3, 2)


def model(n=50, offset=0):
    m = M()
    with torch.no_grad():
        m.t(torch.arange(n) + offset)
    return m


def version_ids(d):
    return open(os.path.join(d, "checkpoint")).read().split()


def test_version_file_lists_committed_oldest_first(tmp_path):
    s = Saver(model(), output_dir=tmp_path, max_keep=None, options=OPTS)
    for k in (5, 1, 3):
        s.save(f"ckpt_{k}")
    assert version_ids(tmp_path) == ["ckpt_5", "ckpt_1", "ckpt_3"] == s.checkpoints()
    assert s.load().ckpt_id == "ckpt_3"


def test_max_keep_counts_checkpoints_from_before_a_restart(tmp_path):
    s = Saver(model(), output_dir=tmp_path, max_keep=3, options=OPTS)
    for k in range(3):
        s.save(f"a{k}")
    # the job restarts: a new Saver, same directory, smaller max_keep
    s2 = Saver(model(), output_dir=tmp_path, max_keep=2, options=OPTS)
    assert s2.checkpoints() == ["a0", "a1", "a2"], "nothing pruned before the first new commit"
    s2.save("b0")
    assert s2.checkpoints() == ["a2", "b0"] and version_ids(tmp_path) == ["a2", "b0"]
    assert sorted(os.listdir(tmp_path)) == [".catalog.json", "a2", "b0", "checkpoint"]


def test_max_keep_never_deletes_before_commit(tmp_path):
    s = Saver(model(), output_dir=tmp_path, max_keep=1, options=OPTS)
    s.save("good")
    s.register_for_checkpointing("bad", object())  # makes the next save fail mid-way
    with pytest.raises(Exception):
        s.save("next")
    assert s.checkpoints() == ["good"] and os.path.isdir(tmp_path / "good")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".staging")], "staging removed"
    m2 = model(0)
    Saver(m2, output_dir=tmp_path).load()
    assert len(m2.t) == 50


def test_missing_output_dir(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        Saver(model(), output_dir=tmp_path / "nope").load()


def test_empty_output_dir_and_unknown_id(tmp_path):
    s = Saver(model(), output_dir=tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        s.load()
    Saver(model(), output_dir=tmp_path, options=OPTS).save("c1")
    with pytest.raises(CheckpointNotFoundError, match=r"c2.*committed: \['c1'\]"):
        s.load(ckpt_id="c2")
    with pytest.raises(CheckpointNotFoundError, match="direct_path=True: .* is an output directory, not one checkpoint"):
        s.load(ckpt_path=str(tmp_path), direct_path=True)


@pytest.mark.parametrize("content", [b"", b"\n\n", b"\xff\xfe garbage \x00", b"../../etc\n", b"ckpt/1\n",
                                     b"does_not_exist\n"])
def test_empty_or_garbage_version_file_is_rebuilt_from_disk(tmp_path, content):
    src = model()
    s = Saver(src, output_dir=tmp_path, max_keep=None, options=OPTS)
    s.save("c1")
    s.save("c2")
    (tmp_path / "checkpoint").write_bytes(content)
    m2 = model(0)
    res = Saver(m2, output_dir=tmp_path).load()
    assert res.ckpt_id == "c2"
    assert_tables_equal(src.t, m2.t)
    s.save("c3")
    assert version_ids(tmp_path) == ["c1", "c2", "c3"]


def test_garbage_version_file_with_no_checkpoints(tmp_path):
    (tmp_path / "checkpoint").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        Saver(model(), output_dir=tmp_path).load()


@pytest.mark.parametrize("bad", ["a/b", "..", "a..b", "x\x00y", "", ".hidden", "/abs", "a\\b", "é", "x" * 201, 7,
                                 "checkpoint", "manifest.json"])
def test_unsafe_checkpoint_ids_are_rejected(tmp_path, bad):
    s = Saver(model(), output_dir=tmp_path, options=OPTS)
    with pytest.raises(InvalidCheckpointIdError):
        s.save(bad)
    with pytest.raises(InvalidCheckpointIdError):
        s.load(ckpt_id=bad)
    assert os.listdir(tmp_path) == []


def test_committed_checkpoint_is_never_overwritten(tmp_path):
    s = Saver(model(), output_dir=tmp_path, options=OPTS)
    s.save("c")
    before = (tmp_path / "c" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointExistsError, match="already exists"):
        s.save("c")
    assert (tmp_path / "c" / "manifest.json").read_bytes() == before


def all_files(ckpt):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(ckpt) for f in fs)


@pytest.mark.parametrize("trial", range(12))
def test_a_flipped_byte_fails_the_load_naming_the_file(tmp_path, trial):
    rng = random.Random(trial)
    src = model(300)
    s = Saver(src, output_dir=tmp_path, options=OPTS)
    s.register_for_checkpointing("x", {"v": torch.arange(10)})
    s.register_io_state("io", type("IO", (), {"dump_io_state": lambda self: {"p": 1},
                                              "load_io_state": lambda self, st: None})())
    s.save("c")
    files = all_files(tmp_path / "c")
    path = files[trial % len(files)]
    data = bytearray(open(path, "rb").read())
    pos = rng.randrange(len(data))
    data[pos] ^= 1 << rng.randrange(8)
    open(path, "wb").write(bytes(data))
    m2 = model(0)
    s2 = Saver(m2, output_dir=tmp_path)
    s2.register_for_checkpointing("x", {})
    s2.register_io_state("io", type("IO", (), {"dump_io_state": lambda self: {},
                                               "load_io_state": lambda self, st: None})())
    with pytest.raises(CorruptCheckpointError) as ei:
        s2.load(ckpt_id="c")
    rel = os.path.relpath(path, tmp_path / "c")
    assert rel in str(ei.value), (rel, str(ei.value))


def test_truncated_shard_file(tmp_path):
    Saver(model(300), output_dir=tmp_path, options=OPTS).save("c")
    shard = next(p for p in all_files(tmp_path / "c") if p.endswith(".bin"))
    os.truncate(shard, os.path.getsize(shard) - 1)
    with pytest.raises(CorruptCheckpointError, match=r"shard-00000-000\.bin.*truncated"):
        Saver(model(0), output_dir=tmp_path).load()


def test_dense_key_reserved_by_safetensors_is_refused_at_save(tmp_path):
    m = model()
    m.register_buffer("__metadata__", torch.ones(2))
    with pytest.raises(Exception, match="__metadata__"):
        Saver(m, output_dir=tmp_path, options=OPTS).save("c")
    assert Saver(model(), output_dir=tmp_path).checkpoints() == []


def test_an_unlisted_checkpoint_is_ordered_by_creation_not_appended(tmp_path):
    """Retention drops a checkpoint from the version file before deleting it; a crash in between leaves
    an old checkpoint committed but unlisted. It must not become the newest one a restart loads. A
    commit whose version-file update was lost (newer than all listed) still comes last."""
    from recckpt.format import catalog
    from recckpt.storage import open_storage
    saver = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=None)
    for i in range(4):
        saver.save(f"c{i}")
    st = open_storage(str(tmp_path))
    catalog.write_version_file(st, ["c1", "c2"])      # c0 half-retired; c3's version-file update lost
    assert [i for i, _ in catalog.committed(st)] == ["c0", "c1", "c2", "c3"]
    assert saver.latest_checkpoint() == "c3"
    catalog.write_version_file(st, ["c2", "c3"])      # retention dropped c0 and c1, then the process died
    assert [i for i, _ in catalog.committed(st)] == ["c0", "c1", "c2", "c3"]


def test_a_listing_says_who_rewrites_a_garbled_version_file_and_gc_does(tmp_path, caplog, capsys):
    """`ls` only reads: its warning must not claim to rebuild the version file (it said "rebuilding it"
    and left it garbled); it names who rewrites it, and that one (`recckpt gc`) does."""
    from recckpt.cli import main as cli_main
    m = M()
    m.t(torch.arange(10))
    s = Saver(m, output_dir=str(tmp_path), options=OPTS, max_keep=None)
    s.save("a")
    s.save("b")
    vf = tmp_path / "checkpoint"
    vf.write_bytes(b"\xff\xfe garbled")
    with caplog.at_level("WARNING", logger="recckpt"):
        assert cli_main(["ls", str(tmp_path)]) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "garbled" in said and "rebuilding" not in said and "recckpt gc` rewrites it" in said, said
    assert vf.read_bytes() == b"\xff\xfe garbled"   # ls wrote nothing
    assert cli_main(["gc", str(tmp_path)]) == 0
    assert vf.read_text().split() == ["a", "b"]
    capsys.readouterr()


def test_ls_says_which_increments_cannot_be_loaded_and_which_listed_ids_are_gone(tmp_path, capsys):
    """A chain whose middle link was deleted by hand, and an id the version file lists that is now a
    file: ls listed the increments as any other checkpoint and dropped the id without a word (exit 0,
    while every load of them fails)."""
    import shutil

    import recckpt
    from recckpt.cli import main as cli_main
    m = M()
    m.t(torch.arange(10))
    s = Saver(m, output_dir=str(tmp_path), options=OPTS, max_keep=None)
    for i, inc in (("c0", False), ("c1", True), ("c2", True), ("c3", True), ("f", False), ("x", False)):
        m.t.write_rows("embedding", torch.tensor([0]), torch.full((1, 8), float(len(i))))
        s.save(i, incremental=inc)
    ok = recckpt.list_checkpoints(str(tmp_path))
    assert not ok.broken and not ok.unfound, (ok.broken, ok.unfound)
    shutil.rmtree(tmp_path / "c1")
    shutil.rmtree(tmp_path / "x")
    (tmp_path / "x").write_text("not a checkpoint")
    got = recckpt.list_checkpoints(str(tmp_path))
    assert [c.ckpt_id for c in got.checkpoints] == ["c0", "c2", "c3", "f"]
    assert got.broken == [("c2", "its parent c1 is not a committed checkpoint"),
                          ("c3", "c1, a link of its chain, is not a committed checkpoint")], got.broken
    assert got.unfound == [("c1", "nothing"), ("x", "a file, not a checkpoint directory")], got.unfound
    assert cli_main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "broken: c2 (cannot be loaded: its parent c1" in out and "broken: c3" in out, out
    assert "unfound: x (the version file lists it, but it is a file" in out and "recckpt gc" in out, out
    with pytest.raises(CorruptCheckpointError, match="c1"):   # what ls says is what a load meets
        Saver(M(), output_dir=str(tmp_path)).load(str(tmp_path / "c2"), direct_path=True)
    # a parent deleted and saved again under its id is another checkpoint: the chain is still broken
    s.save("c1")
    got = recckpt.list_checkpoints(str(tmp_path))
    assert got.broken == [("c2", "its parent c1 was replaced by another checkpoint of that id"),
                          ("c3", "c1, a link of its chain, was replaced by another checkpoint of that id")], got.broken
    with pytest.raises(CorruptCheckpointError, match="c1"):
        Saver(M(), output_dir=str(tmp_path)).load(str(tmp_path / "c2"), direct_path=True)
