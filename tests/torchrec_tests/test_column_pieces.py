"""Column-wise plans as TorchRec's planner makes them: a rank holding several column shards of a table,
adjacent or not. The planner places a wide table's column shards one by one (a 512-wide table at 3
ranks: ranks [0, 1, 2, 0]), so this is what `Saver(dmp_model)` meets by default.

Before, a rank's shards had to be adjacent (else the save and the load were refused), and adjacent ones
were joined into one column block with one RowWiseAdagrad value per row: a save and load under the same
plan gave each shard the mean of their values. Now each column shard is its own column block.

Real DistributedModelParallel on gloo: 2 ranks train, save (sync, and from an async save's snapshot) and
load under the same plans; 3 ranks load those checkpoints under row-wise and another column split."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .harness import ROOT, column_shards, full, load_dump, needs_torchrec, run_jobs, same

pytestmark = needs_torchrec

# a: three 8-column shards, rank 0 holding the first and the last (not adjacent); b: three 4-column
# shards, rank 0 holding the first two (adjacent)
TABLES = [["a", 13, 24, "fp32"], ["b", 9, 12, "fp32"]]
PIECES = {"a": "cw010", "b": "cw001"}
A, B = "coll.embedding_bags.a", "coll.embedding_bags.b"
# Tables TorchRec's default planner splits by columns on CPU: w512's four 128-column shards go to ranks
# [0, 1, 0, 1] at 2 ranks and [0, 1, 2, 0] at 3 (w256's two to two ranks)
WIDE = [["w256", 200, 256, "fp32"], ["w512", 200, 512, "fp32"], ["n64", 50, 64, "fp32"]]


def _job(name, tmp, plan, opt, *, save=False, load=None, steps=0, tables=TABLES, **more):
    return {"name": name, "kind": "ebc", "plan": plan, "opt": opt, "tables": tables, "train_steps": steps,
            "save": os.path.join(tmp, f"ck_{name}") if save else None,
            "load": os.path.join(tmp, f"ck_{load}") if load else None, "dump": os.path.join(tmp, f"d_{name}"),
            **more}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("column_pieces"))
    two = run_jobs(tmp, 2, [
        _job("rowwise", tmp, PIECES, "rowwise", save=True, steps=3),
        _job("adagrad", tmp, PIECES, "adagrad", save=True, steps=3, async_save=True),
        # trained past the checkpoints, then loaded: the same plan gets every shard's own state back; saved
        # again right away, the checkpoint must equal the first
        _job("rowwise_back", tmp, PIECES, "rowwise", load="rowwise", steps=5, dump_before=os.path.join(tmp, "pre")),
        _job("adagrad_back", tmp, PIECES, "adagrad", load="adagrad", save=True, steps=5),
        _job("wide2", tmp, "default", "adagrad", save=True, steps=3, tables=WIDE),
        # a restart under row-wise from the pieces' checkpoint, then two increments on it
        _job("chain_base", tmp, PIECES, "adagrad", save=True, steps=3),
        _job("chain_rw", tmp, {"a": "rw", "b": "rw"}, "adagrad", load="chain_base", steps=1, increments=2),
    ])
    three = run_jobs(tmp, 3, [
        _job("rw3_from_rowwise", tmp, {"a": "rw", "b": "rw"}, "rowwise", load="rowwise", steps=1),
        _job("cw3_from_adagrad", tmp, {"a": "cw", "b": "cw"}, "adagrad", load="adagrad", steps=1),
        _job("pieces3_from_adagrad", tmp, PIECES, "adagrad", load="adagrad", steps=1),
        _job("wide3", tmp, "default", "adagrad", load="wide2", save=True, steps=1, tables=WIDE),
        _job("chain_pieces3", tmp, PIECES, "adagrad", load="chain_base", steps=1),
        _job("chain_rw3", tmp, {"a": "rw", "b": "rw"}, "adagrad", load="chain_base", steps=1),
    ])
    return tmp, two, three


def _tables(tmp, name):
    return load_dump(os.path.join(tmp, f"d_{name}"))


def _weights_equal(src, dst):
    for table in src:
        shape = src[table]["shape"]
        same(full(src[table]["weight"], shape), full(dst[table]["weight"], shape), f"table {table}: embeddings")


def _rows_and_adagrad_equal(want, got, what):
    _weights_equal(want, got)
    for table in (A, B):
        shape = want[table]["shape"]
        same(full(want[table]["states"]["momentum1"], shape), full(got[table]["states"]["momentum1"], shape),
             f"{what}: table {table}: Adagrad state")


def test_every_job_ran(runs):
    _, two, three = runs
    for rank, res in enumerate(two + three):
        for job in res:
            assert job.get("error") is None, (rank, job)
    for rank, res in enumerate(two):
        assert res[2]["loaded_tables"] == [A, B], (rank, res[2])


def test_the_plans_put_several_column_shards_on_a_rank(runs):
    tmp, *_ = runs
    src = _tables(tmp, "rowwise")
    assert [(c0, c1) for c0, c1, _ in column_shards(src[A])] == [(0, 8), (8, 16), (16, 24)]
    assert [(c0, c1) for c0, c1, _ in column_shards(src[B])] == [(0, 4), (4, 8), (8, 12)]
    for table in (A, B):   # each shard's values differ, so a mean of two could not pass below
        vals = [m for _, _, m in column_shards(src[table])]
        assert not any(torch.equal(vals[i], vals[j]) for i in range(3) for j in range(i + 1, 3)), table


def test_the_same_plan_gets_each_shards_own_rowwise_state_back(runs):
    tmp, *_ = runs
    src, pre, dst = _tables(tmp, "rowwise"), load_dump(os.path.join(tmp, "pre")), _tables(tmp, "rowwise_back")
    for table in (A, B):
        shape = src[table]["shape"]
        assert not torch.equal(full(pre[table]["weight"], shape), full(src[table]["weight"], shape)), \
            f"{table}: trained past the checkpoint before the load"
    _weights_equal(src, dst)
    for table in (A, B):
        for (c0, c1, want), (d0, d1, got) in zip(column_shards(src[table]), column_shards(dst[table])):
            assert (c0, c1) == (d0, d1)
            same(got, want, f"table {table} columns [{c0}, {c1}): the shard's own RowWiseAdagrad value")


def test_an_async_snapshot_of_the_pieces_loads_exactly_and_saves_the_same_checkpoint_again(runs):
    tmp, *_ = runs
    src, dst = _tables(tmp, "adagrad"), _tables(tmp, "adagrad_back")
    _weights_equal(src, dst)
    for table in (A, B):
        shape = src[table]["shape"]
        a, b = full(src[table]["states"]["momentum1"], shape), full(dst[table]["states"]["momentum1"], shape)
        assert bool((a != 0).any()), table
        same(a, b, f"table {table}: Adagrad state")
    # the checkpoint saved right after the load holds the same content as the one loaded (digests)
    ck = [os.path.join(tmp, f"ck_{n}", "ckpt_1") for n in ("adagrad", "adagrad_back")]
    p = subprocess.run([sys.executable, "-m", "recckpt", "diff", *ck], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "recckpt", "verify", ck[0]], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_three_ranks_load_the_pieces_under_other_plans(runs):
    """Each 3-rank job trained a step before its load (so a missed row or column would show) and dumped
    right after it: rows and elementwise Adagrad state equal under another column split and the pieces'
    own plan at 3 ranks; under row-wise, RowWiseAdagrad's one value a row is the width-weighted mean of
    the saved shards' values (docs/TORCHREC.md)."""
    tmp, *_ = runs
    ada = _tables(tmp, "adagrad")
    for name in ("cw3_from_adagrad", "pieces3_from_adagrad"):
        _rows_and_adagrad_equal(ada, _tables(tmp, name), name)
    rw, got = _tables(tmp, "rowwise"), _tables(tmp, "rw3_from_rowwise")
    _weights_equal(rw, got)
    for table in (A, B):
        shards = column_shards(rw[table])
        want = sum(m.to(torch.float64) * (c1 - c0) for c0, c1, m in shards) / rw[table]["shape"][1]
        have = full(got[table]["states"]["momentum1"], [rw[table]["shape"][0]])
        assert torch.allclose(have.to(torch.float64), want, rtol=1e-6, atol=0), table


def _shards_per_rank(tmp, name, table):
    """How many weight shards of `table` each rank of job `name` held (its own dump file)."""
    d = os.path.join(tmp, f"d_{name}")
    return [len(torch.load(os.path.join(d, f), weights_only=True)[table]["weight"]) for f in sorted(os.listdir(d))]


def test_the_default_planners_column_splits_save_and_load_between_world_sizes(runs):
    """The default planner's own plans put several column shards of w512 on a rank at 2 and at 3 ranks.
    Saved at 2, loaded and saved again at 3: rows and Adagrad state equal, and the two checkpoints'
    content digests equal (`diff`), whatever their world sizes and blocks."""
    tmp, *_ = runs
    two, three = _tables(tmp, "wide2"), _tables(tmp, "wide3")
    w512 = "coll.embedding_bags.w512"
    for name, world in (("wide2", 2), ("wide3", 3)):
        held = _shards_per_rank(tmp, name, w512)
        assert len(held) == world and max(held) >= 2, \
            f"{name}: the planner put no two column shards of w512 on one rank ({held}); pick a wider table"
    _weights_equal(two, three)
    for table in two:   # fused Adagrad's momentum1, or (a table the planner made data-parallel) the dense 'sum'
        shape = two[table]["shape"]
        assert two[table]["states"], f"table {table}: no optimizer state to compare"
        for k, pieces in two[table]["states"].items():
            same(full(pieces, shape), full(three[table]["states"][k], shape), f"table {table}: Adagrad {k}")
    ck = [os.path.join(tmp, f"ck_{n}", "ckpt_1") for n in ("wide2", "wide3")]
    p = subprocess.run([sys.executable, "-m", "recckpt", "diff", *ck], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_increments_after_a_restart_from_column_blocks_hold_those_tables_whole_first(runs):
    """Restarted under row-wise from a checkpoint holding the tables as column blocks, the first increment
    holds them whole (a chain's fold cannot join column blocks with row changes), the next one their
    changes; the chain loads under the pieces' plan and row-wise at 3 ranks. Before, the first increment
    held row changes on the column blocks, and every load of the chain failed half applied."""
    tmp, *_ = runs
    ck = os.path.join(tmp, "ck_chain_base")
    tables = {}
    for c in ("inc_0", "inc_1"):
        with open(os.path.join(ck, c, "manifest.json")) as f:
            m = json.load(f)
        tables[c] = {t: bool(v.get("changes")) for t, v in m["tables"].items()}
    assert tables == {"inc_0": {A: False, B: False}, "inc_1": {A: True, B: True}}, tables
    want = _tables(tmp, "chain_rw")
    for name in ("chain_pieces3", "chain_rw3"):
        _rows_and_adagrad_equal(want, _tables(tmp, name), name)


def test_a_column_wise_table_warm_starts_a_hashtable_by_row_index(runs, tmp_path):
    """Through the model bank, as a TorchRec table of another plan does (test_loop_increments.py): every
    row index becomes an id, its columns joined across the column blocks, Adagrad state with it."""
    import numpy as np

    import recckpt
    tmp, *_ = runs
    src = os.path.join(tmp, "ck_adagrad", "ckpt_1")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = recckpt.HashTable("user", dim=24)

    model = Model()
    opt = recckpt.SparseAdagrad(model, lr=0.05)
    manager = recckpt.CheckpointManager(recckpt.Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "run")), 10)
    results = manager.load_model_bank([{"path": src, "tables": [A], "rename": {A: "user"}, "exclude": ["dense", "extra"]}])
    assert [r.tables for r in results] == [["user"]]
    ada = _tables(tmp, "adagrad")[A]
    got = model.user.ids().numpy()
    order = np.argsort(got)
    assert np.array_equal(got[order], np.arange(13)), "every row index becomes an id of the HashTable"
    same(model.user.slot("embedding").detach()[order], full(ada["weight"], ada["shape"]), "embedding")
    same(model.user.slot("adagrad.acc").detach()[order], full(ada["states"]["momentum1"], ada["shape"]), "Adagrad")
