"""A fixed-size table keeps its rows through a replacing load, so slots the load leaves out must be reset
(`reset_slots`, docs/SPARSE_STATE.md). A table that cannot reset them is refused before anything is
applied, naming the table and the slots, instead of keeping optimizer state that belongs to other steps
next to the checkpoint's embeddings; one that can is reset, and only in the slots left out."""
from __future__ import annotations

import pytest
import torch

import recckpt
from helpers.fake_tables import FixedRows
from recckpt.errors import IncompatibleCheckpointError


class Resets(FixedRows):
    """FixedRows that starts left-out slots over at 0.5 and records what it was asked to reset."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.resets = []

    def reset_slots(self, slots):
        self.resets.append(list(slots))
        for s in slots:
            self.cols[s].fill_(0.5)


def _model(cls, seed):
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.t = cls("fixed", n=300, d=4)
    return m


def test_a_table_that_cannot_reset_left_out_slots_is_refused_before_anything_is_applied(tmp_path):
    src = _model(FixedRows, 0)
    recckpt.Saver(src, output_dir=str(tmp_path)).save("c")
    dst = _model(FixedRows, 1)
    before = {k: v.clone() for k, v in dst.t.cols.items()}
    with pytest.raises(IncompatibleCheckpointError) as e:
        recckpt.Saver(dst, output_dir=str(tmp_path)).load(load_conf={"exclude": ["sparse_opt"]})
    msg = str(e.value)
    assert "'fixed'" in msg and "adagrad.acc" in msg and "reset_slots" in msg and "merge" in msg, msg
    assert all(torch.equal(dst.t.cols[k], v) for k, v in before.items()), "nothing applied"
    # loading every slot, or merging, needs no reset
    recckpt.Saver(dst, output_dir=str(tmp_path)).load(load_conf={"exclude": ["sparse_opt"], "merge": True})
    assert torch.equal(dst.t.cols["embedding"], src.t.cols["embedding"])
    assert torch.equal(dst.t.cols["adagrad.acc"], before["adagrad.acc"])
    recckpt.Saver(dst, output_dir=str(tmp_path)).load()
    assert torch.equal(dst.t.cols["adagrad.acc"], src.t.cols["adagrad.acc"])


def test_left_out_slots_are_reset_and_loaded_ones_are_not(tmp_path):
    src = _model(FixedRows, 0)
    recckpt.Saver(src, output_dir=str(tmp_path)).save("c")
    dst = _model(Resets, 1)
    recckpt.Saver(dst, output_dir=str(tmp_path)).load(load_conf={"exclude": ["sparse_opt"]})
    assert dst.t.resets == [["adagrad.acc"]]
    assert torch.equal(dst.t.cols["embedding"], src.t.cols["embedding"])
    assert bool((dst.t.cols["adagrad.acc"] == 0.5).all())
    dst2 = _model(Resets, 1)
    recckpt.Saver(dst2, output_dir=str(tmp_path)).load()
    assert dst2.t.resets == [], "a load of every slot resets none (no pass over memory it then overwrites)"
    assert torch.equal(dst2.t.cols["adagrad.acc"], src.t.cols["adagrad.acc"])


def test_a_merge_into_a_smaller_fixed_table_is_refused_before_anything_is_applied(tmp_path):
    """merge=True loads a fixed-size table into a larger one (rows past the checkpoint's keep their values);
    into a smaller one the rows past its end have nowhere to go: refused before anything is applied (a
    registered object included), naming both row counts. Before, the row paths raised mid-load."""
    src = _model(FixedRows, 0)
    saver = recckpt.Saver(src, output_dir=str(tmp_path))
    saver.register_for_checkpointing("meta", {"step": 5})
    saver.save("c")
    torch.manual_seed(1)
    small = torch.nn.Module()
    small.t = FixedRows("fixed", n=200, d=4)
    before = {k: v.clone() for k, v in small.t.cols.items()}
    meta = {"step": 1}
    s = recckpt.Saver(small, output_dir=str(tmp_path))
    s.register_for_checkpointing("meta", meta)
    with pytest.raises(IncompatibleCheckpointError, match=r"has 300 rows, model table 'fixed' 200.*Nothing was loaded"):
        s.load(load_conf={"merge": True})
    assert all(torch.equal(small.t.cols[k], v) for k, v in before.items()) and meta == {"step": 1}
    big = torch.nn.Module()
    big.t = FixedRows("fixed", n=400, d=4)
    tail = {k: v[300:].clone() for k, v in big.t.cols.items()}
    recckpt.Saver(big, output_dir=str(tmp_path)).load(load_conf={"merge": True, "exclude": ["extra"]})
    for k in tail:
        assert torch.equal(big.t.cols[k][:300], src.t.cols[k]) and torch.equal(big.t.cols[k][300:], tail[k]), k
