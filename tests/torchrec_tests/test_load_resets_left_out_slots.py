"""A replacing load that leaves optimizer slots out starts them over (docs/LOADING.md: "excluding sparse_opt
gives zeroed optimizer slots"), for TorchRec tables too. A TorchRec table keeps its rows through a load
(`clear_rows` cannot empty it), so the loader resets the slots it leaves out (`reset_slots`); before, a
rollback with `exclude: ["sparse_opt"]` kept the live optimizer state of later steps next to the
checkpoint's embeddings, silently. Real DMP sharding on 2 gloo ranks (table-wise, row-wise, column-wise,
and data-parallel with its Adagrad state in the dense optimizer), fused Adagrad and RowWiseAdagrad, and an
unsharded table whose in-backward Adagrad starts at initial_accumulator_value 0.1. (The MCH warm start's
case is in test_loop_warm_mch.py.)"""
from __future__ import annotations

import os

import pytest
import torch

from .harness import full, load_dump, needs_torchrec, run_jobs

pytestmark = needs_torchrec

TABLES = [["a", 40, 8, "fp32"], ["b", 30, 8, "fp32"], ["c", 24, 8, "fp32"], ["d", 20, 8, "fp32"]]
PLAN = {"a": "tw", "b": "rw", "c": "cw", "d": "dp"}


def _pair(tmp, name, opt, plan, tables, opt_kwargs=None, conf=None):
    """Two jobs: one trains 3 steps and saves; the other (same seeds) trains 8 steps, then loads that
    checkpoint with `conf` (default: every slot but the optimizer's)."""
    ck = os.path.join(tmp, f"ck_{name}")
    base = {"kind": "ebc", "plan": plan, "opt": opt, "tables": tables, "opt_kwargs": opt_kwargs or {}}
    return [dict(base, name=f"{name}_src", train_steps=3, save=ck, dump=os.path.join(tmp, f"{name}_c0")),
            dict(base, name=f"{name}_dst", train_steps=8, load=ck,
                 load_conf=conf if conf is not None else {"exclude": ["sparse_opt"]},
                 dump_before=os.path.join(tmp, f"{name}_pre"), dump=os.path.join(tmp, f"{name}_post"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reset_slots"))
    sharded = _pair(tmp, "adagrad", "adagrad", PLAN, TABLES) + _pair(tmp, "rowwise", "rowwise", PLAN, TABLES)
    run_jobs(tmp, 2, sharded)
    unsharded = _pair(tmp, "init", "adagrad", "unsharded", TABLES[:1], {"initial_accumulator_value": 0.1})
    # the same rollback loading every slot: the optimizer state comes back as saved
    unsharded += _pair(tmp, "all", "adagrad", "unsharded", TABLES[:1], {"initial_accumulator_value": 0.1}, conf={})
    run_jobs(tmp, 1, unsharded)
    return tmp


def _state(t: dict) -> torch.Tensor:
    (name, pieces), = t["states"].items()
    if pieces[0][1].dim() == 1:   # RowWiseAdagrad: one value a row (per column shard)
        return torch.cat([p[1] for p in pieces])
    return full(pieces, t["shape"])


@pytest.mark.parametrize("opt", ["adagrad", "rowwise"])
def test_excluding_sparse_opt_zeroes_the_fused_state_of_every_plan(runs, opt):
    c0, pre, post = (load_dump(os.path.join(runs, f"{opt}_{w}")) for w in ("c0", "pre", "post"))
    assert set(post) == {f"coll.embedding_bags.{n}" for n, *_ in TABLES}
    for t, got in post.items():
        assert torch.equal(full(got["weight"], got["shape"]), full(c0[t]["weight"], got["shape"])), \
            f"{t}: the embeddings are the checkpoint's"
        assert bool((_state(pre[t]) != 0).any()), f"{t}: the live state was trained before the load"
        assert bool((_state(got) == 0).all()), f"{t}: the optimizer state left out starts over at 0"


def test_unsharded_in_backward_adagrad_restarts_at_its_initial_accumulator_value(runs):
    c0, pre, post = (load_dump(os.path.join(runs, f"init_{w}")) for w in ("c0", "pre", "post"))
    (t, got), = post.items()
    assert torch.equal(full(got["weight"], got["shape"]), full(c0[t]["weight"], got["shape"]))
    assert bool((_state(pre[t]) > 0.1).any()), "the live accumulator had grown before the load"
    assert bool((_state(got) == 0.1).all()), "reset to initial_accumulator_value, not to 0 or the live value"


def test_a_load_of_every_slot_restores_the_saved_state(runs):
    c0, post = (load_dump(os.path.join(runs, f"all_{w}")) for w in ("c0", "post"))
    (t, got), = post.items()
    assert torch.equal(_state(got), _state(c0[t]))
    assert torch.equal(full(got["weight"], got["shape"]), full(c0[t]["weight"], got["shape"]))
