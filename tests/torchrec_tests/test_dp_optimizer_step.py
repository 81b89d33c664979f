"""A data-parallel table's dense-optimizer entry comes back whole after a restore: its accumulator from the
table's slots, and its `step` from the optimizer's saved state. Before, a name-keyed optimizer
(KeyedOptimizer) saved nothing of a data-parallel table's parameter (the slots hold its Adagrad `sum`), so a
restore left that parameter's `step` at the live value: 0 after a crash. Adagrad's `lr_decay` reads it
(lr / (1 + (step - 1) * lr_decay)), so the resumed run stepped that table with another learning rate than
the uninterrupted run, silently. Real DMP sharding on 2 gloo ranks (a table-wise table beside a
data-parallel one), with a KeyedOptimizer and with a plain torch.optim optimizer (numbered state, saved
whole) as the dense optimizer; and the step follows its table through a rename, and stays out of a load
that leaves the table out or shards it. A load that restarts the table's optimizer slots (`exclude:
["sparse_opt"]`) restarts its step too (before, the live step stayed beside a zeroed accumulator)."""
from __future__ import annotations

import os

import pytest
import torch

from .harness import full, load_dump, needs_torchrec, run_jobs

pytestmark = needs_torchrec

TABLES = [["a", 40, 8, "fp32"], ["d", 20, 8, "fp32"]]
PLAN = {"a": "tw", "d": "dp"}
DP_WEIGHT = "coll.embedding_bags.d.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dp_step"))
    jobs = []
    for kind in ("keyed", "torch"):
        ck = os.path.join(tmp, f"ck_{kind}")
        base = {"kind": "ebc", "plan": PLAN, "opt": "adagrad", "tables": TABLES, "dense_opt": kind,
                "dense_kwargs": {"lr_decay": 0.5}, "train_after": 2}
        # uninterrupted: 3 steps, a save, 2 more; resumed: a fresh model restored from that save, 2 more
        jobs += [dict(base, name=f"{kind}_ref", train_steps=3, save=ck, dump=os.path.join(tmp, f"{kind}_ref")),
                 dict(base, name=f"{kind}_resumed", train_steps=0, load=ck, dump=os.path.join(tmp, f"{kind}_res"))]
    # the keyed checkpoint, into a model whose data-parallel table is renamed "e", or sharded row-wise
    ck = os.path.join(tmp, "ck_keyed")
    renamed = [["a", 40, 8, "fp32"], ["e", 20, 8, "fp32"]]
    base = {"kind": "ebc", "opt": "adagrad", "dense_kwargs": {"lr_decay": 0.5}, "train_steps": 0, "load": ck}
    jobs += [dict(base, name="renamed", plan={"a": "tw", "e": "dp"}, tables=renamed,
                  load_conf={"rename": {"coll.embedding_bags.d": "coll.embedding_bags.e"}}),
             # a torch.optim optimizer's numbered state names the table's parameter by the saved table: the
             # table's rename renames it (it was refused as "not a parameter of the model's optimizer")
             dict(base, name="renamed_torch", plan={"a": "tw", "e": "dp"}, tables=renamed, dense_opt="torch",
                  load=os.path.join(tmp, "ck_torch"),
                  load_conf={"rename": {"coll.embedding_bags.d": "coll.embedding_bags.e"}}),
             dict(base, name="sharded", plan={"a": "tw", "d": "rw"}, tables=TABLES),
             dict(base, name="left_out", plan={"a": "tw"}, tables=TABLES[:1], load_conf={"strict": False})]
    # a torch.optim optimizer's state holds the data-parallel table's entry too: a load that leaves the
    # table out (not selected; no sparse state at all) must leave that entry as live as the table's rows
    for name, conf in (("torch_not_selected", {"tables": ["coll.embedding_bags.a"]}),
                       ("torch_dense_only", {"exclude": ["sparse", "sparse_opt"]})):
        jobs.append({"kind": "ebc", "plan": PLAN, "opt": "adagrad", "tables": TABLES, "dense_opt": "torch",
                     "dense_kwargs": {"lr_decay": 0.5}, "name": name, "train_steps": 1, "load_conf": conf,
                     "load": os.path.join(tmp, "ck_torch"), "dump_before": os.path.join(tmp, f"{name}_before"),
                     "dump": os.path.join(tmp, f"{name}_after")})
    # a load that restarts the table's optimizer slots (exclude sparse_opt) restarts its step with them
    for kind in ("keyed", "torch"):
        name = f"{kind}_restarted"
        jobs.append({"kind": "ebc", "plan": PLAN, "opt": "adagrad", "tables": TABLES, "dense_opt": kind,
                     "dense_kwargs": {"lr_decay": 0.5}, "name": name, "train_steps": 1,
                     "load_conf": {"exclude": ["sparse_opt"]}, "load": os.path.join(tmp, f"ck_{kind}"),
                     "dump_before": os.path.join(tmp, f"{name}_before"), "dump": os.path.join(tmp, f"{name}_after")})
    results = run_jobs(tmp, 2, jobs)
    return tmp, {r["name"]: r for r in results[0]}


@pytest.mark.parametrize("kind", ["keyed", "torch"])
def test_a_restored_data_parallel_table_steps_on_as_the_uninterrupted_run(runs, kind):
    tmp, res = runs
    ref, resumed = res[f"{kind}_ref"], res[f"{kind}_resumed"]
    assert ref["dense_steps"][DP_WEIGHT] == 5.0, ref["dense_steps"]
    # every parameter's step, the data-parallel table's included, continues from the saved 3
    assert resumed["dense_steps"] == ref["dense_steps"], (resumed["dense_steps"], ref["dense_steps"])
    a, b = load_dump(os.path.join(tmp, f"{kind}_ref")), load_dump(os.path.join(tmp, f"{kind}_res"))
    assert set(a) == set(b) == {"coll.embedding_bags.a", "coll.embedding_bags.d"}
    for t in a:
        assert torch.equal(full(b[t]["weight"], b[t]["shape"]), full(a[t]["weight"], a[t]["shape"])), \
            f"{t}: the resumed run's weights differ from the uninterrupted run's"
        assert set(a[t]["states"]) == set(b[t]["states"]) and a[t]["states"], t
        for k in a[t]["states"]:
            assert torch.equal(full(b[t]["states"][k], b[t]["shape"]), full(a[t]["states"][k], a[t]["shape"])), \
                f"{t}: optimizer state {k!r} differs"


def test_the_step_follows_its_table(runs):
    _, res = runs
    saved = 3.0   # the keyed run's step at its save
    assert res["renamed"]["loaded_tables"] == ["coll.embedding_bags.a", "coll.embedding_bags.e"], res["renamed"]
    for name in ("renamed", "renamed_torch"):
        assert res[name]["dense_steps"] == {"coll.embedding_bags.e.weight": saved, "dense.weight": saved,
                                            "dense.bias": saved}, (name, res[name]["dense_steps"])
    # sharded now: the table's state is the fused optimizer's; the dense optimizer holds the dense arch only
    assert res["sharded"]["dense_steps"] == {"dense.weight": saved, "dense.bias": saved}, res["sharded"]
    assert res["left_out"]["loaded_tables"] == ["coll.embedding_bags.a"]
    assert res["left_out"]["dense_steps"] == {"dense.weight": saved, "dense.bias": saved}, res["left_out"]


@pytest.mark.parametrize("name", ["torch_not_selected", "torch_dense_only"])
def test_a_data_parallel_table_left_out_keeps_its_live_optimizer_entry(runs, name):
    tmp, res = runs
    r = res[name]
    assert r["dense_steps"][DP_WEIGHT] == 1.0, r["dense_steps"]        # live: one step; the checkpoint's: 3
    assert r["dense_steps"]["dense.weight"] == 3.0, r["dense_steps"]   # the dense arch's entry is loaded
    before, after = load_dump(os.path.join(tmp, f"{name}_before")), load_dump(os.path.join(tmp, f"{name}_after"))
    d = "coll.embedding_bags.d"
    assert torch.equal(full(after[d]["weight"], after[d]["shape"]), full(before[d]["weight"], before[d]["shape"]))
    assert after[d]["states"] and set(after[d]["states"]) == set(before[d]["states"])
    for k in after[d]["states"]:
        assert torch.equal(full(after[d]["states"][k], after[d]["shape"]),
                           full(before[d]["states"][k], before[d]["shape"])), f"{d}: optimizer state {k!r} changed"


@pytest.mark.parametrize("kind", ["keyed", "torch"])
def test_excluding_sparse_opt_restarts_a_data_parallel_tables_step_with_its_accumulator(runs, kind):
    tmp, res = runs
    r = res[f"{kind}_restarted"]
    assert r["dense_steps"][DP_WEIGHT] == 0.0, r["dense_steps"]       # live: 1 step; a fresh optimizer's: 0
    assert r["dense_steps"]["dense.weight"] == 3.0, r["dense_steps"]  # the dense optimizer itself is loaded
    before = load_dump(os.path.join(tmp, f"{kind}_restarted_before"))
    after = load_dump(os.path.join(tmp, f"{kind}_restarted_after"))
    d = "coll.embedding_bags.d"
    (k, pieces), = after[d]["states"].items()
    assert bool((full(before[d]["states"][k], before[d]["shape"]) != 0).any()), "trained before the load"
    assert bool((full(pieces, after[d]["shape"]) == 0).all()), "the accumulator starts over"
