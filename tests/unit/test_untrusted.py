"""Untrusted checkpoints cannot run code, read outside their directory, or make us allocate what is not
on disk: no default path unpickles; allow_pickle=True goes through torch.load(weights_only=True); hostile
indexes and manifests (re-signed, so only structural validation stands in the way) are refused."""
from __future__ import annotations

import os
import pathlib
import re
import struct
import time

import pytest
import torch

from helpers import hostile, stress_harness as h
from recckpt import Saver
from recckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from recckpt.format import extras as extras_fmt

PKG = pathlib.Path(__file__).resolve().parents[2] / "recckpt"


class Evil:
    """Pickles to a call of os.mkdir(marker): unpickling it anywhere creates the marker directory."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _evil_checkpoint(tmp_path, monkeypatch):
    """A checkpoint as a hostile writer would make it: recckpt's own save refuses state that
    weights_only would refuse, so that check is switched off here."""
    marker = tmp_path / "PWNED"
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path / "out")
    s.register_for_checkpointing("obj", Evil(marker), allow_pickle=True)
    with monkeypatch.context() as m:
        m.setattr(extras_fmt, "check_loadable", lambda name, data: None)
        s.save("c")
    assert not marker.exists()
    return tmp_path / "out", marker


def test_pickled_payload_is_refused_without_allow_pickle(tmp_path, monkeypatch):
    out, marker = _evil_checkpoint(tmp_path, monkeypatch)
    s = Saver(torch.nn.Linear(2, 2), output_dir=out)
    s.register_for_checkpointing("obj", {})
    with pytest.raises(IncompatibleCheckpointError, match=r"'obj' was saved with pickle.*allow_pickle=True"):
        s.load()
    assert not marker.exists()


def test_pickled_payload_is_not_executed_even_with_allow_pickle(tmp_path, monkeypatch):
    out, marker = _evil_checkpoint(tmp_path, monkeypatch)
    s = Saver(torch.nn.Linear(2, 2), output_dir=out)
    s.register_for_checkpointing("obj", {}, allow_pickle=True)
    with pytest.raises(IncompatibleCheckpointError, match=r"extras\.safetensors: object 'obj'.*weights_only=True"):
        s.load()
    assert not marker.exists()


def test_unregistered_pickled_object_is_never_unpickled(tmp_path, monkeypatch):
    out, marker = _evil_checkpoint(tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match="'obj' is not registered"):
        Saver(torch.nn.Linear(2, 2), output_dir=out).load(load_conf={"strict": False})
    assert not marker.exists()


@pytest.mark.parametrize("rel", ["manifest.json", "index.json", "dense.safetensors", "extras.safetensors",
                                 "io_state/worker-00000.safetensors", "sparse/worker-00000.index.json",
                                 "sparse/shard-00000-000.bin"])
def test_a_pickle_planted_in_any_file_does_not_run(tmp_path, rel):
    marker = tmp_path / "PWNED"
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, 3)
    ckpt = h.make_saver(str(tmp_path / "out"), m, e, r).save("c")
    import io
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    open(os.path.join(ckpt, rel), "wb").write(buf.getvalue())
    if rel != "manifest.json" and not rel.endswith(".bin"):
        hostile.resign(ckpt, rel)   # the attacker re-signs, so checksums pass
    m, e, r = h.Model(), {}, h.Reader()
    with pytest.raises(CorruptCheckpointError, match=re.escape(rel)):
        h.make_saver(str(tmp_path / "out"), m, e, r).load(ckpt_id="c")
    assert not marker.exists()


def test_allow_pickle_round_trips_state_the_codec_refuses(tmp_path):
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s.register_for_checkpointing("tags", {"a": {1, 2}, "z": 3 + 4j}, allow_pickle=True)
    s.register_for_checkpointing("plain", {"n": 1}, allow_pickle=True)   # representable: never pickled
    s.save("c")
    tree = _extras_kinds(tmp_path / "c")
    assert tree == {"tags": "pickled_value", "plain": "value"}
    s2 = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s2.register_for_checkpointing("tags", {}, allow_pickle=True)
    s2.register_for_checkpointing("plain", {})
    s2.load()
    assert s2.extra("tags") == {"a": {1, 2}, "z": 3 + 4j} and s2.extra("plain") == {"n": 1}


def _extras_kinds(ckpt):
    from recckpt.format import safetensors_io, tree_codec
    data = open(ckpt / "extras.safetensors", "rb").read()
    tensors, meta = safetensors_io.read(data, "x")
    tree = tree_codec.decode(meta[tree_codec.TREE_KEY], tensors, "x")
    return {k: v["kind"] for k, v in tree["objects"].items()}


def test_default_path_refuses_unrepresentable_state_at_save(tmp_path):
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s.register_for_checkpointing("tags", {1, 2})
    with pytest.raises(Exception, match="without pickle"):
        s.save("c")


def test_no_default_path_unpickles():
    """Source check: the only torch.load in recckpt passes weights_only=True; pickle is never loaded."""
    loads = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bpickle\.(loads?|Unpickler)\b", text), path
        assert "numpy.load" not in text and "np.load(" not in text, path
        for m in re.finditer(r"torch\.load\(([^\n]*)", text):
            loads.append(path.name)
            assert "weights_only=True" in m.group(1), (path, m.group(0))
    assert "extras.py" in loads, loads   # the scan does see the one real call


# ------------------------------------------------------------------------------- hostile metadata
def _ckpt(tmp_path):
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, 4)
    return h.make_saver(str(tmp_path / "out"), m, e, r).save("c")


def _load(tmp_path):
    m, e, r = h.Model(), {}, h.Reader()
    t0 = time.perf_counter()
    try:
        h.make_saver(str(tmp_path / "out"), m, e, r).load(ckpt_id="c")
    finally:
        assert time.perf_counter() - t0 < 30, "a hostile file must fail fast"


@pytest.mark.parametrize("bad_path", ["../outside.bin", "/etc/passwd", "sparse/../../outside.bin", "a\x00b",
                                      "sparse\\shard.bin", "./sparse/x.bin", "sparse//x.bin", ""])
def test_index_paths_cannot_leave_the_checkpoint(tmp_path, bad_path):
    ckpt = _ckpt(tmp_path)
    outside = tmp_path / "out" / "outside.bin"
    idx = hostile.read_json(ckpt, "index.json")
    outside.write_bytes(open(os.path.join(ckpt, idx["files"][0]["path"]), "rb").read())
    idx["files"][0]["path"] = bad_path
    hostile.write_json(ckpt, "index.json", idx)
    with pytest.raises(CorruptCheckpointError, match=r"index\.json: field files\[0\]\.path"):
        _load(tmp_path)


@pytest.mark.parametrize("field", ["dense", "extras", "io_state"])
def test_manifest_paths_cannot_leave_the_checkpoint(tmp_path, field):
    ckpt = _ckpt(tmp_path)
    m = hostile.read_json(ckpt, "manifest.json")
    if field == "io_state":
        m["io_state"] = {"0": "../../x"}
    else:
        m[field] = "../" + m[field]
    hostile.write_json(ckpt, "manifest.json", m)
    with pytest.raises(CorruptCheckpointError, match="manifest.json: field .*not a relative path inside"):
        _load(tmp_path)


def test_offsets_beyond_the_file_are_refused_before_reading(tmp_path):
    ckpt = _ckpt(tmp_path)
    idx = hostile.read_json(ckpt, "index.json")
    idx["tables"]["user"]["segments"]["offset"][0] = 1 << 60
    hostile.write_json(ckpt, "index.json", idx)
    with pytest.raises(CorruptCheckpointError, match="ends beyond its file"):
        _load(tmp_path)


def test_huge_claimed_sizes_and_rows_allocate_nothing(tmp_path):
    """An index claiming a 2**50-byte shard file and a manifest claiming the rows to match: the size is
    checked against the file on disk before any buffer or table reservation is sized from them."""
    ckpt = _ckpt(tmp_path)
    idx = hostile.read_json(ckpt, "index.json")
    segs = idx["tables"]["user"]["segments"]
    extra = (1 << 32) - 1 - segs["rows"][0]   # the most rows a version 4 segment may hold
    segs["rows"][0] += extra
    idx["files"][segs["file"][0]]["size"] = 1 << 50   # room for them, so that no size check fires first
    hostile.write_json(ckpt, "index.json", idx)
    m = hostile.read_json(ckpt, "manifest.json")
    m["tables"]["user"]["rows"] += extra
    # consistent, so that the index's own checks are what fire
    m["digests"]["tables"]["user"]["rows"] += extra
    m["shard_bytes"] = sum(f["size"] for f in idx["files"])
    hostile.write_json(ckpt, "manifest.json", m)
    # refused by the tiling rule (the claimed rows do not reach the claimed size) or, if they did, by the
    # CRC count (a matching CRC string would itself be gigabytes): before any allocation
    with pytest.raises(CorruptCheckpointError, match="do not tile the file|CRCs as"):
        _load(tmp_path)


def test_claimed_file_size_is_checked_before_any_reservation(tmp_path):
    ckpt = _ckpt(tmp_path)
    idx = hostile.read_json(ckpt, "index.json")
    idx["files"][0]["size"] = 1 << 50
    hostile.write_json(ckpt, "index.json", idx)
    w = hostile.read_json(ckpt, "sparse/worker-00000.index.json")
    w["files"][0]["size"] = 1 << 50
    hostile.write_json(ckpt, "sparse/worker-00000.index.json", w)
    # Refused before any reservation: by the tiling rule (the blocks cannot reach the claimed size) or,
    # for an index whose blocks did, by the size on disk.
    with pytest.raises(CorruptCheckpointError, match=r"the index recorded 1125899906842624|"
                                                     r"(blocks|segments) end at byte \d+ of 1125899906842624|"
                                                     r"shard files of 1125899906\d+ bytes, the manifest's shard_bytes"):
        _load(tmp_path)


def test_safetensors_header_length_is_capped(tmp_path):
    ckpt = _ckpt(tmp_path)
    p = os.path.join(ckpt, "dense.safetensors")
    data = bytearray(open(p, "rb").read())
    data[:8] = struct.pack("<Q", (1 << 63) + 5)
    open(p, "wb").write(bytes(data))
    hostile.resign(ckpt, "dense.safetensors")
    with pytest.raises(CorruptCheckpointError, match="dense.safetensors: safetensors header length"):
        _load(tmp_path)


def test_hostile_extras_tree_is_refused(tmp_path):
    from recckpt.format import extras
    with pytest.raises(CorruptCheckpointError, match="unknown kind"):
        extras.validate({"objects": {"x": {"kind": "exec", "state": 1}}, "sparse_optimizer": None}, "f")
    with pytest.raises(CorruptCheckpointError, match="uint8 byte tensor"):
        extras.validate({"objects": {"x": {"kind": "pickled_value", "state": "abc"}}}, "f")
    with pytest.raises(CorruptCheckpointError, match="'objects' is not an object"):
        extras.validate({"objects": [1]}, "f")


@pytest.mark.parametrize("node", [{"__counter__": {"ab": 1}}, {"__counter__": ["ab", "cd"]}, {"__odict__": "ab"},
                                  {"__dict__": [["a", 1, 2]]}, {"__counter__": [[{"x": 1}, 1]]}, {"__odict__": None}])
def test_hostile_dict_tags_of_a_state_tree_are_refused(node):
    """Pairs of a dict tag must be [key, value] lists: a string unpacked into two characters, so corrupt
    trees decoded into made-up Counters (a helper's review)."""
    import json

    from recckpt.format import tree_codec
    with pytest.raises(CorruptCheckpointError, match="invalid state tree"):
        tree_codec.decode(json.dumps({"v": node}), {}, "extras.safetensors")


# ------------------------------------------------------------------ links inside a checkpoint
def _linked_checkpoint(tmp_path, target_rel):
    import torch as _torch

    from recckpt import HashTable as _HT, SaveOptions as _SO, Saver as _Saver

    m = _torch.nn.Module()
    m.t = _HT("t", dim=4)
    m.lin = _torch.nn.Linear(2, 2)
    with _torch.no_grad():
        m.t(_torch.arange(100))
    _Saver(m, output_dir=str(tmp_path / "run"), options=_SO(fsync=False)).save("c")
    ckpt = tmp_path / "run" / "c"
    victim = tmp_path / "outside.bin"          # a file the attacker wants read: same bytes, so CRCs match
    victim.write_bytes((ckpt / target_rel).read_bytes())
    (ckpt / target_rel).unlink()
    os.symlink(victim, ckpt / target_rel)
    return ckpt, m


@pytest.mark.parametrize("target_rel", ["dense.safetensors", "index.json", "sparse/shard-00000-000.bin",
                                        "manifest.json"])
def test_a_file_linked_out_of_the_checkpoint_is_refused(tmp_path, target_rel):
    import torch as _torch

    from recckpt import HashTable as _HT, Saver as _Saver

    ckpt, _ = _linked_checkpoint(tmp_path, target_rel)
    m2 = _torch.nn.Module()
    m2.t = _HT("t", dim=4)
    m2.lin = _torch.nn.Linear(2, 2)
    with pytest.raises(CorruptCheckpointError, match=r"symbolic link"):
        _Saver(m2, output_dir=str(tmp_path / "new")).load(ckpt_path=str(ckpt), direct_path=True)
    assert len(m2.t) == 0


def test_a_linked_checkpoint_directory_itself_is_fine(tmp_path):
    import torch as _torch

    from recckpt import HashTable as _HT, SaveOptions as _SO, Saver as _Saver

    m = _torch.nn.Module()
    m.t = _HT("t", dim=4)
    with _torch.no_grad():
        m.t(_torch.arange(10))
    _Saver(m, output_dir=str(tmp_path / "run"), options=_SO(fsync=False)).save("c")
    os.symlink(tmp_path / "run" / "c", tmp_path / "latest")
    m2 = _torch.nn.Module()
    m2.t = _HT("t", dim=4)
    _Saver(m2, output_dir=str(tmp_path / "new")).load(ckpt_path=str(tmp_path / "latest"), direct_path=True)
    assert len(m2.t) == 10


def test_a_linked_sparse_directory_leading_outside_is_refused(tmp_path):
    """A directory link on the way to a shard file (not the file itself) that leads out of the checkpoint:
    the quick inside-check (plain names, no linked directory) must hand it to the full check, which refuses."""
    import shutil

    import torch as _torch

    from recckpt import HashTable as _HT, SaveOptions as _SO, Saver as _Saver

    m = _torch.nn.Module()
    m.t = _HT("t", dim=4)
    with _torch.no_grad():
        m.t(_torch.arange(100))
    _Saver(m, output_dir=str(tmp_path / "run"), options=_SO(fsync=False)).save("c")
    ckpt = tmp_path / "run" / "c"
    shutil.move(str(ckpt / "sparse"), str(tmp_path / "elsewhere"))   # same bytes, so every CRC matches
    os.symlink(tmp_path / "elsewhere", ckpt / "sparse")
    m2 = _torch.nn.Module()
    m2.t = _HT("t", dim=4)
    with pytest.raises(CorruptCheckpointError, match=r"outside the checkpoint"):
        _Saver(m2, output_dir=str(tmp_path / "new")).load(ckpt_path=str(ckpt), direct_path=True)
    assert len(m2.t) == 0
