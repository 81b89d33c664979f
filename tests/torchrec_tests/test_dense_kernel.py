"""Tables sharded on TorchRec's "dense" compute kernel (`row_wise(compute_kernel="dense")`, what
`construct_module_sharding_plan` picks for a table without an in-backward optimizer): an ordinary
parameter, stepped by the user's dense optimizer. A helper found two silent failures there:
- increments held only the rows looked up since the parent, but the dense optimizer moves other rows too
  (momentum, weight decay): a loaded chain differed from the model. Such a table is now saved whole in
  every increment, as a data-parallel one is;
- the dense optimizer's state for it is sharded per rank, but was saved as rank 0's alone, so every rank
  restored rank 0's shard of it. An Adagrad-like `sum` is now each rank's shard of the table's slots, so it
  reshards with the rows, into other plans, kernels and world sizes; other state (Adam's moments) is
  refused naming the table.
Real DMP sharding on 2 and 3 gloo ranks."""
from __future__ import annotations

import json
import os

import pytest

from .harness import ROOT, free_port, full, load_dump, needs_torchrec, run_jobs, run_script, same

pytestmark = needs_torchrec

LOOP_CHILD = os.path.join(ROOT, "tests", "helpers", "torchrec_loop_child.py")
TABLES = [["a", 40, 8, "fp32"], ["k", 30, 12, "fp32"], ["z", 17, 12, "fp32"]]
DENSE = {"a": "tw", "k": "rwdense", "z": "twdense"}   # z: on rank 1 at 2 ranks, rank 0 holds none of it


def _job(tmp, name, plan, *, save=False, load=None, steps=0, **kw):
    return {"name": name, "kind": "ebc", "plan": plan, "opt": "adagrad", "tables": TABLES, "train_steps": steps,
            "save": os.path.join(tmp, f"ck_{name}") if save else None,
            "load": os.path.join(tmp, f"ck_{load}") if load else None,
            "dump": os.path.join(tmp, f"d_{name}"), **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dense_kernel"))
    saved = run_jobs(tmp, 2, [
        _job(tmp, "keyed2", DENSE, save=True, steps=3),
        _job(tmp, "torch2", DENSE, save=True, steps=3, dense_opt="torch"),
        _job(tmp, "fused2", {"a": "tw", "k": "tw", "z": "rw"}, save=True, steps=3),
        # Adam's moments on a dense-kernel table: per-rank state recckpt does not map
        _job(tmp, "adam2", DENSE, save=True, steps=2, dense_cls="adam", expect_error=True),
        # SGD without momentum keeps no state: nothing per rank to lose, the save goes on
        dict(_job(tmp, "sgd2", DENSE, save=True, steps=2), opt="sgd"),
        # a KeyedOptimizer of the tables alone (data-parallel and dense-kernel): its saved state keeps no
        # entry of its own
        _job(tmp, "tables_only2", {"a": "dp", "k": "rwdense", "z": "twdense"}, save=True, steps=3,
             dense_opt_tables_only=True),
        # the same saving its param groups: they name no parameter once the tables hold every entry
        _job(tmp, "groups2", {"a": "dp", "k": "rwdense", "z": "twdense"}, save=True, steps=3,
             dense_opt_tables_only=True, dense_opt="keyed_groups"),
    ])
    loaded = run_jobs(tmp, 3, [
        _job(tmp, "rw3_from_keyed2", {"a": "rw", "k": "rwdense", "z": "rwdense"}, load="keyed2"),
        _job(tmp, "cw3_from_keyed2", {"a": "rw", "k": "cwdense", "z": "twdense"}, load="keyed2"),
        _job(tmp, "fused3_from_keyed2", {"a": "rw", "k": "tw", "z": "rw"}, load="keyed2"),
        _job(tmp, "dp3_from_keyed2", {"a": "rw", "k": "dp", "z": "dp"}, load="keyed2"),
        _job(tmp, "rw3_torch_from_torch2", {"a": "rw", "k": "rwdense", "z": "rwdense"}, load="torch2",
             dense_opt="torch"),
        _job(tmp, "dense3_from_fused2", {"a": "rw", "k": "rwdense", "z": "cwdense"}, load="fused2"),
        _job(tmp, "tables_only3", {"a": "dp", "k": "cwdense", "z": "rwdense"}, load="tables_only2",
             dense_opt_tables_only=True),
        _job(tmp, "groups3", {"a": "dp", "k": "cwdense", "z": "rwdense"}, load="groups2",
             dense_opt_tables_only=True, dense_opt="keyed_groups"),
    ])
    # one process whose unsharded tables a torch.optim Adagrad steps: the table slots have nowhere to go
    # (docs/TORCHREC.md, Limits), so that state is left out, and the optimizer must still step
    unsharded = run_jobs(tmp, 1, [
        dict(_job(tmp, "un_from_torch2", "unsharded", load="torch2", load_conf={"strict": False},
                  train_after=1), dense_opt="torch", unsharded_dense_opt=True),
        dict(_job(tmp, "un_strict_from_torch2", "unsharded", load="torch2", expect_error=True),
             dense_opt="torch", unsharded_dense_opt=True),
    ])
    return tmp, saved, loaded, unsharded


def _tables(tmp, name):
    return load_dump(os.path.join(tmp, f"d_{name}"))


def _acc(table, shape):
    """The table's Adagrad state, whichever optimizer holds it: fused ('momentum1') or dense ('sum')."""
    st = table["states"]
    return full(st["momentum1"] if "momentum1" in st else st["sum"], shape)


def _equal(src, dst, tables=("a", "k", "z")):
    for t in tables:
        table = f"coll.embedding_bags.{t}"
        shape = src[table]["shape"]
        same(full(src[table]["weight"], shape), full(dst[table]["weight"], shape), f"{table}: embeddings")
        a, b = _acc(src[table], shape), _acc(dst[table], shape)
        assert bool((a != 0).any()), f"{table}: training left no optimizer state to compare"
        same(a, b, f"{table}: Adagrad state")


@pytest.mark.parametrize("dst", ["rw3_from_keyed2", "cw3_from_keyed2", "fused3_from_keyed2", "dp3_from_keyed2"])
def test_dense_kernel_adagrad_state_reshards_with_its_rows(runs, dst):
    """Each rank's shard of the dense optimizer's `sum` (KeyedOptimizer) is saved as the table's slot: a
    load at 3 ranks gives every rank its own rows of it, on the dense kernel row- or column-wise, on the
    fused kernel, or data-parallel, and the saved Adagrad `step` goes back into the dense optimizer."""
    tmp, saved, loaded, _ = runs
    src = _tables(tmp, "keyed2")
    assert "sum" in src["coll.embedding_bags.k"]["states"] and "sum" in src["coll.embedding_bags.z"]["states"]
    assert len(src["coll.embedding_bags.k"]["states"]["sum"]) == 2, "row-wise: each rank holds a shard of it"
    _equal(src, _tables(tmp, dst))
    step = saved[0][0]["dense_steps"]["coll.embedding_bags.k.weight"]
    assert step == 3.0, saved[0][0]["dense_steps"]
    name = {"rw3_from_keyed2": 0, "cw3_from_keyed2": 1, "fused3_from_keyed2": 2, "dp3_from_keyed2": 3}[dst]
    for rank in loaded:
        steps = rank[name]["dense_steps"]
        if dst in ("rw3_from_keyed2", "cw3_from_keyed2"):
            assert steps["coll.embedding_bags.k.weight"] == step, (rank[name]["name"], steps)


def test_a_torch_optim_dense_optimizer_on_the_dense_kernel(runs):
    """The same with a plain torch.optim Adagrad (numbered state): its saved state, written by rank 0, no
    longer carries rank 0's shard of `sum` for every rank; each rank's comes from the table's slot."""
    tmp, saved, loaded, _ = runs
    _equal(_tables(tmp, "torch2"), _tables(tmp, "rw3_torch_from_torch2"))
    assert all(r[4]["dense_steps"]["coll.embedding_bags.k.weight"] == 3.0 for r in loaded)


def test_fused_tables_load_into_the_dense_kernel(runs):
    """The reverse: fused Adagrad state lands in the dense optimizer of tables now on the dense kernel."""
    tmp, *_ = runs
    _equal(_tables(tmp, "fused2"), _tables(tmp, "dense3_from_fused2"))


def test_other_dense_kernel_optimizer_state_is_refused_naming_it(runs):
    tmp, saved, *_ = runs
    for r in saved:
        err = r[3]["error"]
        assert err is not None and "coll.embedding_bags." in err and "'dense' compute kernel" in err, err
        assert "exp_avg" in err and "apply_optimizer_in_backward" in err, err
    assert not os.path.exists(os.path.join(tmp, "ck_adam2", "ckpt_1"))
    assert os.path.exists(os.path.join(tmp, "ck_sgd2", "ckpt_1"))


def test_increments_hold_a_dense_kernel_table_whole(tmp_path):
    """c1's rows are the looked-up rows of the fused table plus every row of the dense-kernel one."""
    out = str(tmp_path / "train")
    os.makedirs(out)
    job = {"name": "d", "opt": "adagrad", "tables": [["a", 40, 12], ["k", 30, 12]], "dir": str(tmp_path / "ck"),
           "dump": str(tmp_path / "dump"), "plan": {"a": "rw", "k": "rwdense"}}
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"world": 2, "port": free_port(), "out": out, "phase": "train", "jobs": [job]}, f)
    proc = run_script(LOOP_CHILD, argv=[spec], timeout=300)
    errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error_")]
    assert not errors, "\n".join(errors)
    done = json.load(open(os.path.join(out, "done_0.json")))["d"]
    assert done["c1"]["parent"] == "c0", done
    assert done["c1"]["rows"] == done["c1"]["fed"]["a"] + 30, (done, proc.stderr[-2000:])


def test_an_optimizer_of_the_tables_alone_loads(runs):
    """A KeyedOptimizer holding only data-parallel and dense-kernel tables (another optimizer for the MLP, a
    common setup) saves no entry of its own, all being in the tables' slots; its load was refused with
    "Different parameter count: 1 vs 0". Its tables' state now reshards like any other's."""
    tmp, saved, loaded, _ = runs
    assert all(r[5]["name"] == "tables_only2" and r[5].get("error") is None for r in saved)
    _equal(_tables(tmp, "tables_only2"), _tables(tmp, "tables_only3"))
    assert all(r[6]["dense_steps"]["coll.embedding_bags.k.weight"] == 3.0 for r in loaded)
    # with save_param_groups(True) its saved groups list no parameter: taken for numbered state, it was
    # refused the same way
    _equal(_tables(tmp, "groups2"), _tables(tmp, "groups3"))
    assert all(r[7]["dense_steps"]["coll.embedding_bags.k.weight"] == 3.0 for r in loaded)


def test_numbered_dense_kernel_state_into_an_unsharded_module_still_steps(runs):
    """torch.optim's numbered state of a dense-kernel table has no `sum` (its slots hold it). Loaded into one
    process whose unsharded tables that optimizer steps (no table slot holds the state there), with
    strict False (or exclude sparse_opt), the entry kept no accumulator and the next step raised a raw KeyError 'sum'; it now
    keeps the live one. A strict load is refused, naming the slot the model lacks."""
    tmp, _, _, unsharded = runs
    first, strict = unsharded[0]
    assert first["name"] == "un_from_torch2" and "dense_steps" in first, first
    assert strict["error"] is not None and "adagrad.acc" in strict["error"], strict
