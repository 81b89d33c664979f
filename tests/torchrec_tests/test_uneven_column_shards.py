"""Column-wise shards of uneven width (`column_wise(size_per_rank=[4, 12])`) on 2 gloo ranks. TorchRec 1.8
cannot load a sharded EmbeddingBagCollection's own state_dict entry back in that plan (its pre-load hook
views every local shard at the width of the table's first shard). recckpt's dense step used to hand the
model's load_state_dict every table's entry, so every load into that plan, a restart included, failed on
rank 1 with TorchRec's raw RuntimeError after the tables were written, and left rank 1's dense layer
behind. Now a sharded EBC's weights stay out of the dense step (its hook skips absent entries).

Also `column_wise(ranks=[0, 1, 0])`, where rank 0 holds two column shards that are not adjacent: refused on
save and load, naming the rank and its shards (before, it named rank 0's shards joined into (0, 12))."""
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
    run_jobs(tmp, 2, [dict(rw, name="rw", train_steps=1, save=os.path.join(tmp, "ck_rw"))])
    results = run_jobs(tmp, 2, [
        dict(base, name="src", train_steps=3, save=ck, dump=os.path.join(tmp, "saved")),
        dict(base, name="dst", train_steps=8, load=ck, dump_before=os.path.join(tmp, "pre"),
             dump=os.path.join(tmp, "post")),
        dict(base, name="split_save", plan={"a": "cw010", "b": "tw"}, tables=[["a", 24, 12, "fp32"], TABLES[1]],
             train_steps=1, save=os.path.join(tmp, "ck010"), expect_error=True),
        dict(base, name="split_load", plan={"a": "cw010", "b": "tw"}, tables=[["a", 24, 12, "fp32"], TABLES[1]],
             train_steps=1, load=os.path.join(tmp, "ck_rw"), expect_error=True)])
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


@pytest.mark.parametrize("job", [2, 3], ids=["save", "load"])
def test_a_rank_holding_column_shards_that_are_not_adjacent_is_named(runs, job):
    tmp, results = runs
    for rank, res in enumerate(results):
        err = res[job]["error"]
        assert err is not None and err.startswith("InvalidArgumentError"), (rank, err)
        assert "table 'coll.embedding_bags.a': rank 0 holds the column shards [(0, 4), (8, 12)], which are not " \
               "adjacent" in err, (rank, err)
    assert not os.path.exists(os.path.join(tmp, "ck010", "ckpt_1")), "nothing committed"
