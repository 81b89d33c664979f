"""A failed load leaves the model unchanged: what can be checked is checked before the first table is
touched (a user ownership function's results among it), and a failure part-way names what was applied."""
from __future__ import annotations

import re

import pytest
import torch

from helpers import stress_harness as h
from helpers.tables import table_contents
from recckpt.errors import LoadApplyError, LoadConfigError


def _saved(tmp_path):
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, 3)
    h.make_saver(str(tmp_path / "out"), m, e, r).save("c")


def _live(tmp_path):
    """A model at step 5 (different rows and values), with its saver; and a snapshot to compare with."""
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, 5)
    before = ({k: table_contents(getattr(m, k)) for k in ("user", "item")},
              {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}, dict(e), r.pos)
    return h.make_saver(str(tmp_path / "out"), m, e, r), m, e, r, before


def _unchanged(m, e, r, before):
    tables, dense, extras, pos = before
    for k in ("user", "item"):
        got = table_contents(getattr(m, k))
        assert got.keys() == tables[k].keys()
        for slot in got:
            assert got[slot].keys() == tables[k][slot].keys(), f"table {k} changed"
    for k, v in dense.items():
        assert torch.equal(m.state_dict()[k], v), k
    assert e["step"] == extras["step"] and r.pos == pos


def _boom(ids, world):
    raise RuntimeError("ownership service unavailable")


@pytest.mark.parametrize("fn, match", [
    (_boom, "raised RuntimeError: ownership service unavailable"),
    (lambda ids, world: (ids % world)[:-1], r"returned \d+ ranks for \d+ ids"),
    (lambda ids, world: ids % world + world, r"returned ranks in"),
    (lambda ids, world: (ids % world).float(), "returned torch.float32"),
])
def test_a_failing_ownership_function_changes_nothing(tmp_path, fn, match):
    _saved(tmp_path)
    s, m, e, r, before = _live(tmp_path)
    with pytest.raises(LoadConfigError, match=match) as ei:
        s.load(ckpt_id="c", load_conf={"ownership": fn, "io_state_on_resize": "drop"}, shard_id=0, shard_num=2)
    assert "Nothing was loaded" in str(ei.value) and re.search(r"table '(user|item)'", str(ei.value))
    _unchanged(m, e, r, before)


def test_a_good_ownership_function_still_loads(tmp_path):
    _saved(tmp_path)
    s, m, e, r, _ = _live(tmp_path)
    calls = []

    def own(ids, world):
        calls.append(len(ids))
        return ids % world

    s.load(ckpt_id="c", load_conf={"ownership": own, "io_state_on_resize": "drop"}, shard_id=1, shard_num=2)
    ids = m.user.ids()
    assert len(ids) and bool((ids % 2 == 1).all())
    assert e["step"] == 3
    assert sum(calls) >= 2 * (len(m.user) + len(m.item))  # the pre-check and the apply pass


def test_a_failure_part_way_names_what_was_applied(tmp_path):
    """The second table fails to allocate (as under a memory limit): the error is a recckpt error that
    says which table stopped, which were loaded before it and which objects were applied."""
    _saved(tmp_path)
    s, m, e, r, _ = _live(tmp_path)

    def no_memory(n):
        raise MemoryError(f"cannot reserve {n} rows")

    m.user.reserve = no_memory   # tables load in the checkpoint's order: item, then user
    with pytest.raises(LoadApplyError) as ei:
        s.load(ckpt_id="c")
    msg = str(ei.value)
    assert "MemoryError" in msg and "stopped in table 'user'" in msg
    assert "loaded before it: item" in msg and "already applied: state" in msg
    assert "dense state and IO state were not applied" in msg
