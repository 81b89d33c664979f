"""A Saver never extends a broken chain (issue 30 item 5): before an incremental save the parent's chain
is walked (every link's manifest present, its hash the one its child recorded); a link deleted or
replaced by hand makes the save full, with `full_reason` saying why, and the result loads."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import hostile
from helpers.tables import table_contents
from recckpt import HashTable, SaveOptions, Saver

OPTS = SaveOptions(num_buckets=16, fsync=False)


def _chain(out):
    t = HashTable("t", 4)
    m = torch.nn.ModuleDict({"t": t})
    s = Saver(m, output_dir=str(out), max_keep=None, options=OPTS)
    t.import_rows(torch.arange(100), {"embedding": torch.randn(100, 4)})
    s.save("c1")
    for k in (2, 3):
        t.import_rows(torch.arange(k * 10, k * 10 + 20), {"embedding": torch.full((20, 4), float(k))})
        s.save(f"c{k}", incremental=True)
    assert s.last_save.parent == "c2"
    return m, s


def _next(m, s):
    m["t"].import_rows(torch.arange(200, 210), {"embedding": torch.ones(10, 4)})
    s.save("c4", incremental=True)
    return s.last_save


def _loads(out, m):
    m2 = torch.nn.ModuleDict({"t": HashTable("t", 4)})
    Saver(m2, output_dir=str(out)).load(ckpt_id="c4")
    a, b = table_contents(m["t"])["embedding"], table_contents(m2["t"])["embedding"]
    assert set(a) == set(b) and all(torch.equal(a[i], b[i]) for i in a)


@pytest.mark.parametrize("damage", ["base_deleted", "middle_deleted", "middle_replaced"])
def test_a_broken_chain_gets_a_full_save(tmp_path, damage):
    out = tmp_path / "out"
    m, s = _chain(out)
    if damage == "base_deleted":
        shutil.rmtree(out / "c1")
        gone = "c1"
    elif damage == "middle_deleted":
        shutil.rmtree(out / "c2")
        gone = "c2"
    else:   # re-signed by hand: valid on its own, but not the link c3 was written on
        m2 = hostile.read_json(str(out / "c2"), "manifest.json")
        m2["metadata"] = {**m2.get("metadata", {}), "edited": "1"}
        hostile.write_json(str(out / "c2"), "manifest.json", m2)
        gone = "c2"
    last = _next(m, s)
    assert last.parent is None, last
    assert last.full_reason and "broken" in last.full_reason and f"/{gone}" in last.full_reason, last.full_reason
    _loads(out, m)


def test_an_intact_chain_still_gets_an_increment(tmp_path):
    out = tmp_path / "out"
    m, s = _chain(out)
    last = _next(m, s)
    assert last.parent == "c3" and last.full_reason is None
    _loads(out, m)
