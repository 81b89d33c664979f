"""Ranks built with different sharding plans (a planner or config that differs between ranks) each save
the rows their own plan gives them: a checkpoint that held some rows twice committed, every reader refused
it, and retention had deleted the good one before it. The first save refuses such a model, naming the
table and both plans, and commits nothing (a helper's attack on real DMP processes)."""
from __future__ import annotations

import os

from .harness import needs_torchrec, run_jobs

pytestmark = needs_torchrec

TABLES = [["a", 300, 8, "fp32"], ["b", 200, 8, "fp32"]]


def test_ranks_with_different_plans_are_refused_before_anything_is_written(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    same = {"a": "tw", "b": "rw"}   # (the bad model is not trained: its ranks could not run one step together)
    res = run_jobs(str(tmp_path), 2, [
        {"name": "good", "kind": "ebc", "plan": same, "opt": "adagrad", "tables": TABLES, "train_steps": 2,
         "save": good, "load": None, "dump": None},
        {"name": "bad", "kind": "ebc", "plan_by_rank": [same, {"a": "tw", "b": "tw"}], "opt": "adagrad",
         "tables": TABLES, "train_steps": 0, "save": bad, "load": None, "dump": None, "expect_error": True},
    ])
    for rank, results in enumerate(res):
        err = results[1]["error"]
        assert err is not None and err.startswith("InvalidArgumentError"), (rank, err)
        assert "'coll.embedding_bags.b'" in err and "sharding plan differs" in err, err
        assert "row_wise" in err and "table_wise" in err and "same plan" in err, err
        assert "'coll.embedding_bags.a'" not in err, err   # the table whose plans agree is not named
    assert not os.path.exists(os.path.join(bad, "ckpt_1"))
    assert os.path.exists(os.path.join(good, "ckpt_1", "manifest.json"))
