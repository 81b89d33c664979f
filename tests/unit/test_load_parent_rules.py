"""Which loads may become the parent of the next incremental save, and loads that fail after the sparse
tables are applied. Found by a helper's attack:
- a load with a `slots` filter restarted the optimizer slots it left out, yet became the parent: the next
  increment folded onto the checkpoint's old optimizer state for every row not trained since (silent);
- a load of one worker's share (shard_id/shard_num) became the parent of a save by another world: the
  increment folded onto ids this process never held (silent);
- a dense state or IO state refused by the model's own code came out as a bare exception, with the
  tables already replaced and nothing saying so."""
from __future__ import annotations

import pytest
import torch

from helpers.tables import table_contents
from recckpt import Saver, SparseAdam
from recckpt.errors import LoadApplyError

from .test_parent_races import OPTS, Model


def train(model, opt, ids):
    model.emb.train()
    model.lin(model.emb(ids)).sum().backward()
    opt.step()
    opt.zero_grad()


def _saved(out):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.1)
    for k in range(3):
        train(model, opt, torch.arange(k * 10, k * 10 + 200))
    Saver(model, opt, output_dir=out, options=OPTS).save("c1")


def _assert_same(a, b):
    ca, cb = table_contents(a), table_contents(b)
    assert set(ca) == set(cb)
    for slot in ca:
        assert set(ca[slot]) == set(cb[slot]), slot
        for i in ca[slot]:
            assert torch.equal(ca[slot][i], cb[slot][i]), (slot, i)


@pytest.mark.parametrize("how", ["slots", "shard"])
def test_a_partial_load_is_not_the_parent_of_the_next_increment(tmp_path, how):
    out = str(tmp_path / "out")
    _saved(out)
    model = Model()
    opt = SparseAdam([model.emb], lr=0.1)
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    if how == "slots":
        saver.load(load_conf={"slots": ["embedding"]})   # adam.m / adam.v restart at 0
        assert saver.chain_parent() is None
    else:
        saver.load(shard_id=0, shard_num=2)               # about half the ids
    train(model, opt, torch.tensor([1000, 1001]))         # a few rows only
    saver.save("c2", incremental=True)                    # as the only worker
    assert saver.last_save.parent is None and saver.last_save.full_reason, saver.last_save
    if how == "shard":
        assert "worker 0 of 2's share of 'c1'" in saver.last_save.full_reason
    back = Model()
    Saver(back, SparseAdam([back.emb], lr=0.1), output_dir=out).load(ckpt_id="c2")
    _assert_same(back.emb, model.emb)                     # c2 is exactly what the process held


def test_a_full_load_at_the_saving_world_still_is_the_parent(tmp_path):
    out = str(tmp_path / "out")
    _saved(out)
    model = Model()
    opt = SparseAdam([model.emb], lr=0.1)
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    saver.load()
    train(model, opt, torch.tensor([1000, 1001]))
    saver.save("c2", incremental=True)
    assert saver.last_save.parent == "c1"


class Frozen(torch.nn.Linear):
    def _load_from_state_dict(self, *a, **kw):
        raise RuntimeError("layer is frozen")


class Reader:
    def dump_io_state(self):
        return {"pos": 3}

    def load_io_state(self, state):
        raise ValueError("reader refuses this state")


@pytest.mark.parametrize("what", ["dense", "io_state"])
def test_a_refusal_after_the_tables_were_applied_says_what_was_applied(tmp_path, what):
    out = str(tmp_path / "out")
    model = Model()
    opt = SparseAdam([model.emb], lr=0.1)
    train(model, opt, torch.arange(50))
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    saver.register_io_state("reader", Reader())
    saver.save("c1")
    dst = Model()
    if what == "dense":
        dst.lin = Frozen(4, 1)
    s2 = Saver(dst, SparseAdam([dst.emb], lr=0.1), output_dir=out, options=OPTS)
    s2.register_io_state("reader", Reader())
    with pytest.raises(LoadApplyError) as e:
        s2.load()
    msg = str(e.value)
    assert "Already applied: sparse tables emb; the sparse optimizer" in msg, msg
    if what == "dense":
        assert "load_state_dict refused the dense state (RuntimeError: layer is frozen)" in msg, msg
        assert "IO state was not applied" in msg and "Exclude 'dense'" in msg, msg
    else:
        assert "IO state object 'reader' refused its saved state (ValueError: reader refuses this state)" in msg
        assert "dense state loaded" in msg and "Exclude 'io_state'" in msg, msg
    assert len(dst.emb) == 50


def test_a_snapshot_of_changes_on_a_share_loaded_at_another_world_fails_once_then_saves_full(tmp_path):
    """The async path: a snapshot taken with incremental=True holds only changes, and at capture time the
    world of the coming write is not known. Written as another world than the load's, it cannot become
    full: the write fails with nothing committed, and the next capture is full."""
    from recckpt.errors import CheckpointSaveError
    from recckpt.train.snapshot import HostBuffers
    out = str(tmp_path / "out")
    _saved(out)
    model = Model()
    opt = SparseAdam([model.emb], lr=0.1)
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    saver.load(shard_id=0, shard_num=2)
    train(model, opt, torch.tensor([1000, 1001]))
    bufs = HostBuffers()
    snap = saver.capture_copy(bufs, 0, incremental=True)
    with pytest.raises(CheckpointSaveError, match="worker 0 of 2's share of 'c1'.*nothing was written"):
        saver.write("c2", snap, shard_id=0, shard_num=1, incremental=True)
    assert saver.checkpoints() == ["c1"]
    snap = saver.capture_copy(bufs, 0, incremental=True)
    saver.write("c2", snap, shard_id=0, shard_num=1, incremental=True)
    assert saver.last_save.parent is None and saver.checkpoints() == ["c2"]   # max_keep=1
    back = Model()
    Saver(back, SparseAdam([back.emb], lr=0.1), output_dir=out).load(ckpt_id="c2")
    _assert_same(back.emb, model.emb)
