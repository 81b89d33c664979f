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
    assert [n for n, _ in recckpt.list_checkpoints(out).damaged] == ["ckpt_2"]
    with pytest.raises(CheckpointExistsError, match=r"ckpt_2 holds a checkpoint whose manifest does not verify.*"
                                                    r"recckpt.delete\(.*\['ckpt_2'\]\)"):
        _train(model2, opt2, mgr2, 2)
    assert recckpt.delete(out, ["ckpt_2"]) == ["ckpt_2"]
    assert not os.path.exists(os.path.join(out, "ckpt_2"))
    assert recckpt.list_checkpoints(out).damaged == []
    mgr2.global_step = 1                    # the step that failed is trained again and now saves
    _train(model2, opt2, mgr2, 2)
    assert [c.ckpt_id for c in recckpt.list_checkpoints(out).checkpoints] == ["ckpt_1", "ckpt_2"]
    assert recckpt.verify(os.path.join(out, "ckpt_2")).ok


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
