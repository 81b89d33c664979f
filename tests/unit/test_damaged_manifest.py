"""A committed checkpoint whose manifest is later damaged (one flipped bit). Listings skip it and restore()
falls back to the older one, as docs/SAFETY.md says; but its id stays taken. Before, nothing said so:
restore() only logged, `recckpt ls` and `gc` showed nothing, the save at that step again raised "already
exists ... delete it first", and `recckpt.delete` refused it as "not committed". Now restore() warns,
`ls` lists it as damaged, the save's error names the cause and the call that frees the id, and
`recckpt.delete` removes it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import recckpt
from recckpt.errors import CheckpointExistsError

from .test_parent_races import _job, _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_damaged_newest_manifest_is_reported_and_can_be_deleted(tmp_path):
    out = str(tmp_path / "out")
    model, opt, mgr = _job(out)
    for step in (1, 2):
        _train(model, opt, mgr, step)
    path = os.path.join(out, "ckpt_2", "manifest.json")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))

    model2, opt2, mgr2 = _job(out)
    with pytest.warns(UserWarning, match=r"restore skips \['ckpt_2'\].*do not verify.*recckpt.delete"):
        assert mgr2.restore() == 1
    ls = subprocess.run([sys.executable, "-m", "recckpt", "ls", out], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT))
    assert ls.returncode == 0 and "damaged: ckpt_2 (its manifest does not verify" in ls.stdout, ls.stdout
    for fmt in ([], ["--json"]):   # a health check fails on it (a listing does not)
        check = subprocess.run([sys.executable, "-m", "recckpt", "ls", out, "--check", *fmt], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        assert check.returncode == 1 and "ckpt_2" in check.stdout, (check.returncode, check.stdout, check.stderr)
    assert [n for n, _ in recckpt.list_checkpoints(out).damaged] == ["ckpt_2"]
    with pytest.raises(CheckpointExistsError, match=r"ckpt_2 holds a checkpoint whose manifest does not verify.*"
                                                    r"recckpt.delete\(.*\['ckpt_2'\]\)"):
        mgr2.saver.save("ckpt_2")           # a save under the id says so
    # the manager's save of step 2 passes over the taken id (every restart used to fail on it)
    _train(model2, opt2, mgr2, 2)
    assert [c.ckpt_id for c in recckpt.list_checkpoints(out).checkpoints] == ["ckpt_1", "ckpt_2.1"]
    assert recckpt.verify(os.path.join(out, "ckpt_2.1")).ok
    assert recckpt.delete(out, ["ckpt_2"]) == ["ckpt_2"]
    assert not os.path.exists(os.path.join(out, "ckpt_2"))
    assert recckpt.list_checkpoints(out).damaged == []


@pytest.mark.parametrize("edit", ["io_state_beyond", "worker_steps_twice", "ckpt_id_path"])
def test_manifest_worker_keys_and_id_are_checked(tmp_path, edit):
    """Fields a manifest was taken at its word for (a helper's hostile-input attack): an IO state of worker
    9999999 in a checkpoint of one worker passed verify and load, then broke `open().io_state` and inspect;
    worker keys "0" and "00" counted as one worker, the last silently winning; an id with a path and
    control characters in it showed up in listings. Each is now a CorruptCheckpointError naming the field."""
    import torch

    from recckpt.errors import CorruptCheckpointError
    m = torch.nn.Module()
    m.t = recckpt.HashTable("t", 2)
    m.t(torch.arange(5))
    s = recckpt.Saver(m, output_dir=str(tmp_path))
    class Reader:
        def dump_io_state(self):
            return {"pos": 1}

        def load_io_state(self, state):
            pass

    s.register_io_state("reader", Reader())
    s.save("c", step=3)
    from helpers.hostile import read_json, write_json
    obj = read_json(str(tmp_path / "c"), "manifest.json")
    if edit == "io_state_beyond":
        obj["io_state"]["9999999"] = obj["io_state"].pop("0")
        want = "io_state"
    elif edit == "worker_steps_twice":
        obj["worker_steps"]["00"] = 7
        want = "worker_steps"
    else:
        obj["ckpt_id"] = "../../x\n\x1b[31m"
        want = "ckpt_id"
    write_json(str(tmp_path / "c"), "manifest.json", obj)
    with pytest.raises(CorruptCheckpointError, match=want):
        recckpt.open(str(tmp_path / "c"))
    assert not recckpt.verify(str(tmp_path / "c")).ok


@pytest.mark.parametrize("damage", ["params_not_a_list", "state_a_list", "names_too_many", "state_beyond"])
def test_a_damaged_optimizer_state_is_corrupt_for_verify_and_load(tmp_path, damage):
    """A registered optimizer's saved state whose groups or state are not what a torch.optim state_dict holds,
    or whose recorded parameter names are too many: the load raised a bare TypeError or AttributeError, and
    verify said OK (a helper's hostile-input attack). Both now say CorruptCheckpointError, naming
    extras.safetensors, and the model is left as it was."""
    import json
    import struct

    import torch

    from helpers.hostile import resign
    from recckpt.errors import CorruptCheckpointError

    def model():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.lin = torch.nn.Linear(3, 2)
        return m, torch.optim.Adam(m.parameters(), lr=0.1)

    m, opt = model()
    m.lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    s = recckpt.Saver(m, output_dir=str(tmp_path))
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    ck = str(tmp_path / "c")
    path = os.path.join(ck, "extras.safetensors")
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    tree = json.loads(header["__metadata__"]["recckpt.tree"])
    entry = tree["objects"]["opt"]
    if damage == "params_not_a_list":
        entry["state"]["param_groups"][0]["params"] = 5
    elif damage == "state_a_list":
        entry["state"]["state"] = [1, 2]
    elif damage == "names_too_many":
        entry["param_names"] = entry["param_names"] + ["extra.weight"]
    else:
        entry["state"]["state"]["__dict__"].append([7, entry["state"]["state"]["__dict__"][0][1]])
    header["__metadata__"]["recckpt.tree"] = json.dumps(tree, separators=(",", ":"))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data[8 + n:])
    resign(ck, "extras.safetensors")
    assert not recckpt.verify(ck).ok
    m2, opt2 = model()
    before = [p.detach().clone() for p in m2.parameters()]
    s2 = recckpt.Saver(m2, output_dir=str(tmp_path))
    s2.register_for_checkpointing("opt", opt2)
    with pytest.raises(CorruptCheckpointError, match="extras.safetensors"):
        s2.load()
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters())) and not opt2.state


def test_verify_finds_an_id_stored_twice(tmp_path):
    """One worker's segment holding an id twice (checksums re-signed): verify said OK, export wrote the
    id twice, and only a load found it, after applying other tables (a helper's hostile-input attack).
    verify now names the file, the table and the id."""
    import numpy as np
    import torch

    from helpers.hostile import _parsed_index, resign_segment_crcs
    m = torch.nn.Module()
    m.user = recckpt.HashTable("user", 4)
    m.user(torch.arange(300))
    recckpt.Saver(m, output_dir=str(tmp_path), options=recckpt.SaveOptions(num_buckets=16)).save("b")
    ck = str(tmp_path / "b")
    assert recckpt.verify(ck).ok
    doc = _parsed_index(ck)
    seg = doc.tables["user"][1][0]
    path = os.path.join(ck, doc.files[seg.file][0])
    data = bytearray(open(path, "rb").read())
    k = seg.dir_entries
    starts = np.frombuffer(bytes(data[seg.buckets.offset + 4 * k:seg.buckets.offset + 8 * k]), "<u4")
    c = seg.columns[0]
    ids = np.frombuffer(bytes(data[c.offset:c.offset + c.length]), "<i8").copy()
    ends = list(starts[1:]) + [len(ids)]
    first = next(s for s, e in zip(starts, ends) if e - s >= 2)
    ids[first + 1] = ids[first]      # the same bucket: only a uniqueness check can tell
    data[c.offset:c.offset + c.length] = ids.tobytes()
    open(path, "wb").write(bytes(data))
    resign_segment_crcs(ck, "user")
    report = recckpt.verify(ck)
    assert not report.ok and any(f"id {int(ids[first])} is stored twice" in p and "'user'" in p
                                 for p in report.problems), report.problems
    # A load says the same: one worker wrote it, so the repeat is damage, not ids routed inconsistently
    # between workers (whose advice, duplicates='newest', cannot pick between one worker's two copies).
    for conf in (None, {"duplicates": "newest"}):
        m2 = torch.nn.Module()
        m2.user = recckpt.HashTable("user", 4)
        with pytest.raises(recckpt.errors.CorruptCheckpointError) as e:
            recckpt.Saver(m2, output_dir=str(tmp_path)).load(ckpt_id="b", load_conf=conf)
        assert "'user'" in str(e.value) and "damaged" in str(e.value) and "routed" not in str(e.value), str(e.value)
