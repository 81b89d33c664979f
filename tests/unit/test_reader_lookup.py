"""`CheckpointView.lookup`: the rows of given ids, for a server that needs some embeddings and not the
table (the reader had no way but to read the whole table). Checked against a whole read (`iter_rows`) on a
multi-worker hash-bucketed table, a chain with updated and removed ids, and a fixed-size table
(row_range buckets, row runs), with absent ids, repeats, ids outside a fixed-size table and a bucket
spread past LOOKUP_MAX_RUNS."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import recckpt
from helpers.checkpoints import make_checkpoint, table_rows
from helpers.fake_tables import FixedRows, Holder
from recckpt import SaveOptions, Saver
from recckpt.errors import InvalidArgumentError
from recckpt.tools.reader import CheckpointView
from unit.test_incremental import run_chain


def _whole(view, table, slots):
    got = {}
    for ids, cols in view.iter_rows(table, slots):
        for i, k in enumerate(ids.tolist()):
            got[k] = {s: cols[s][i].copy() for s in slots}
    return got


def _check(view, table, ids, slots, truth):
    found, rows = view.lookup(table, ids, slots)
    assert found.tolist() == [int(i) in truth for i in ids]
    for j, i in enumerate(ids.tolist()):
        for s in slots:
            want = truth[i][s] if i in truth else np.zeros_like(rows[s][j])
            np.testing.assert_array_equal(rows[s][j], want, err_msg=f"id {i} slot {s}")


def test_hash_table_of_three_workers(tmp_path):
    data = table_rows(3000)
    make_checkpoint(str(tmp_path / "run"), "c", data, workers=3)
    view = recckpt.open(str(tmp_path / "run" / "c"))
    slots = ["embedding", "freq"]
    truth = _whole(view, "user", slots)
    g = np.random.default_rng(1)
    present = g.choice(data["ids"], 7)
    ids = np.concatenate([present, present[:2], np.array([12345, -7], dtype=np.int64)])   # repeats, absent
    _check(view, "user", ids, slots, truth)
    _check(view, "user", g.choice(data["ids"], 500), slots, truth)     # many buckets: one range
    _check(view, "user", np.array([], dtype=np.int64), slots, truth)


def test_only_the_buckets_of_the_ids_are_read(tmp_path, monkeypatch):
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(3000), workers=1)
    view = recckpt.open(str(tmp_path / "run" / "c"))
    seen = []
    real = CheckpointView.iter_rows

    def spy(self, table, slots=None, chunk_rows=65536, shard=None, *, buckets=None, **kw):
        seen.append(buckets)
        return real(self, table, slots, chunk_rows, shard, buckets=buckets, **kw)
    monkeypatch.setattr(CheckpointView, "iter_rows", spy)
    one = table_rows(3000)["ids"][5:6]
    found, _ = view.lookup("user", one)
    assert found.tolist() == [True]
    assert len(seen) == 1 and seen[0][1] - seen[0][0] == 1, seen


def test_a_chain_gives_the_newest_rows_and_not_removed_ids(tmp_path):
    run_chain(str(tmp_path / "chain"), n_incr=3)
    view = recckpt.open(str(tmp_path / "chain" / "c3"))
    assert len(view.links) == 4
    slots = ["embedding", "adam.m"]
    truth = _whole(view, "emb", slots)
    ids = np.arange(-5, 720, dtype=np.int64)   # every id the chain touched, removed ones included
    _check(view, "emb", ids, slots, truth)
    _check(view, "emb", ids[::97], slots, truth)   # a few ids: a read per bucket run
    assert 0 < sum(int(i) in truth for i in ids) < len(ids), "the chain should have removed some ids"


def test_fixed_size_table_and_torch(tmp_path):
    src = FixedRows(n=700, d=6)
    Saver(Holder(src), output_dir=str(tmp_path / "run"), options=SaveOptions(fsync=False)).save("c")
    view = recckpt.open(str(tmp_path / "run" / "c"))
    ids = torch.tensor([699, 0, 350, 700, -1, 350])
    found, rows = view.lookup("fixed", ids, "embedding", as_torch=True)
    assert found.tolist() == [True, True, True, False, False, True]
    assert torch.equal(rows["embedding"][[0, 1, 2, 5]], src.cols["embedding"][[699, 0, 350, 350]])
    assert not rows["embedding"][[3, 4]].any()


def test_bad_arguments(tmp_path):
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(50))
    view = recckpt.open(str(tmp_path / "run" / "c"))
    with pytest.raises(InvalidArgumentError, match="ids must be a 1-D array of integers"):
        view.lookup("user", np.array([1.5]))
    with pytest.raises(InvalidArgumentError, match="slots"):
        view.lookup("user", np.array([1]), ["nope"])
    with pytest.raises(InvalidArgumentError, match="no table 'nope'"):
        view.lookup("nope", np.array([1]))
