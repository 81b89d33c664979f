"""Column-wise shards of uneven width (`column_wise(size_per_rank=[4, 12])`) on 2 gloo ranks. TorchRec 1.8
cannot load a sharded EmbeddingBagCollection's own state_dict entry back in that plan (its pre-load hook
views every local shard at the width of the table's first shard). recckpt's dense step used to hand the
model's load_state_dict every table's entry, so every load into that plan, a restart included, failed on
rank 1 with TorchRec's raw RuntimeError after the tables were written, and left rank 1's dense layer
behind. Now a sharded EBC's weights stay out of the dense step (its hook skips absent entries).

Also a row-wise save loaded into `column_wise(ranks=[0, 1, 0])`, where rank 0 holds two column shards that
are not adjacent (each loaded as its own column range; test_column_pieces.py has the rest)."""
from __future__ import annotations

import os

import pytest
import torch

from .harness import full, load_dump, needs_torchrec, run_jobs

pytestmark = needs_torchrec

TABLES = [["a", 24, 16, "fp32"], ["b", 20, 8, "fp32"]]
PLAN = {"a": "cw412", "b": "tw"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("uneven_cw"))
    ck = os.path.join(tmp, "ck")
    base = {"kind": "ebc", "plan": PLAN, "opt": "adagrad", "tables": TABLES}
    rw = {"kind": "ebc", "plan": {"a": "rw", "b": "tw"}, "opt": "adagrad", "tables": [["a", 24, 12, "fp32"], TABLES[1]]}
    run_jobs(tmp, 2, [dict(rw, name="rw", train_steps=1, save=os.path.join(tmp, "ck_rw"), dump=os.path.join(tmp, "rw"))])
    results = run_jobs(tmp, 2, [
        dict(base, name="src", train_steps=3, save=ck, dump=os.path.join(tmp, "saved")),
        dict(base, name="dst", train_steps=8, load=ck, dump_before=os.path.join(tmp, "pre"),
             dump=os.path.join(tmp, "post")),
        dict(base, name="split_load", plan={"a": "cw010", "b": "tw"}, tables=[["a", 24, 12, "fp32"], TABLES[1]],
             train_steps=2, load=os.path.join(tmp, "ck_rw"), dump=os.path.join(tmp, "split"))])
    return tmp, results


def test_a_restart_into_uneven_column_shards_loads_tables_optimizer_and_dense_state(runs):
    tmp, results = runs
    saved, pre, post = (load_dump(os.path.join(tmp, w)) for w in ("saved", "pre", "post"))
    widths = sorted(int(t.shape[1]) for _, t in post["coll.embedding_bags.a"]["weight"])
    assert widths == [4, 12], f"the plan holds column shards of widths 4 and 12, got {widths}"
    for t, got in post.items():
        shape = got["shape"]
        assert not torch.equal(full(pre[t]["weight"], shape), full(saved[t]["weight"], shape)), \
            f"{t}: trained past the checkpoint before the load"
        assert torch.equal(full(got["weight"], shape), full(saved[t]["weight"], shape)), f"{t}: rows"
        for k, pieces in got["states"].items():
            assert torch.equal(full(pieces, shape), full(saved[t]["states"][k], shape)), f"{t}: {k}"
    for rank, res in enumerate(results):
        src, dst = res[:2]
        assert dst["loaded_tables"] == ["coll.embedding_bags.a", "coll.embedding_bags.b"], (rank, dst)
        assert dst["dense"] == src["dense"], f"rank {rank}: the dense layer is the checkpoint's"
        assert dst["dense_steps"] == src["dense_steps"], f"rank {rank}: the dense optimizer's step"


def test_a_row_wise_save_loads_into_column_shards_that_are_not_adjacent(runs):
    tmp, results = runs
    saved, got = load_dump(os.path.join(tmp, "rw")), load_dump(os.path.join(tmp, "split"))
    cols = sorted((off[1], int(t.shape[1])) for off, t in got["coll.embedding_bags.a"]["weight"])
    assert cols == [(0, 4), (4, 4), (8, 4)], f"the plan splits table a in three 4-column shards, got {cols}"
    for t, want in saved.items():
        shape = want["shape"]
        assert torch.equal(full(got[t]["weight"], shape), full(want["weight"], shape)), f"{t}: rows"
        for k, pieces in want["states"].items():
            assert torch.equal(full(got[t]["states"][k], shape), full(pieces, shape)), f"{t}: {k}"
    for rank, res in enumerate(results):
        assert res[2]["loaded_tables"] == ["coll.embedding_bags.a", "coll.embedding_bags.b"], (rank, res[2])
