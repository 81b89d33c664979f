"""Incremental checkpoints of TorchRec tables (issue 27 item 2), in real DMP processes on gloo.

2 ranks train (fused Adagrad under table-wise / row-wise / table-row-wise tables; fused RowWiseAdagrad
under row-wise / table-wise), save full c0, an increment c1 (sync) and an increment c2 taken through an
async snapshot while training goes on; rank 0 compacts c2. Then 3 ranks under other plans (column-wise
included) load the chain c2 and the compacted c2_full. Each is compared row by row and slot by slot with
the model trained without interruption (dumped at c2's capture, from TorchRec's own state).

Warm starts between kinds (item 3, TorchRec -> HashTable): a saved TorchRec table warm-starts a recckpt
HashTable through the model bank with `rename`, keyed by row index, in the pytest process, which never
imports torchrec (a TorchRec checkpoint is an ordinary recckpt checkpoint). The HashTable -> TorchRec MCH
direction is not done: the integration has no MCH adapter yet."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from .harness import ROOT, free_port, full, load_dump, needs_torchrec, run_script, same

pytestmark = needs_torchrec

CHILD = os.path.join(ROOT, "tests", "helpers", "torchrec_loop_child.py")
TABLES = [["a", 40, 12], ["b", 30, 12], ["c", 25, 24], ["d", 20, 12]]
# "d" is data-parallel: not tracked, so every increment holds it whole, written by rank 0 alone
JOBS = {"ada": ("adagrad", {"a": "tw", "b": "rw", "c": "twrw", "d": "dp"}, {"a": "rw", "b": "cw", "c": "tw", "d": "dp"}),
        "row": ("rowwise", {"a": "rw", "b": "rw", "c": "tw", "d": "dp"}, {"a": "cw", "b": "tw", "c": "rw", "d": "dp"})}
DP_ROWS = 20


def _run(tmp, phase, world, jobs):
    out = os.path.join(tmp, phase)
    os.makedirs(out)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"world": world, "port": free_port(), "out": out, "phase": phase, "jobs": jobs}, f)
    proc = run_script(CHILD, argv=[spec], timeout=300)
    errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error_")]
    assert not errors, "a worker failed:\n" + "\n".join(errors)
    done = os.path.join(out, "done_0.json")   # judged by files: a rank may abort at exit after its work
    assert os.path.exists(done), f"rc {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.load(open(done))


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torchrec_incr"))

    def jobs(which):
        return [{"name": n, "opt": opt, "tables": TABLES, "dir": os.path.join(tmp, f"ck_{n}"),
                 "dump": os.path.join(tmp, f"d_{n}"), "plan": (p2 if which == 2 else p3)}
                for n, (opt, p2, p3) in JOBS.items()]
    trained = _run(tmp, "train", 2, jobs(2))
    loaded = _run(tmp, "load", 3, jobs(3))
    return tmp, trained, loaded


def test_increments_hold_exactly_the_rows_training_touched(chains):
    """Each increment holds the distinct rows the batches since its parent fed (every rank's batch), far
    fewer than the table's, plus the untracked data-parallel table whole, written once (by rank 0) in the
    sync save and in the async snapshot; the async one holds the rows at its capture although training
    went on."""
    _, trained, _ = chains
    total = sum(r for _, r, _ in TABLES)
    for name in JOBS:
        for ck, parent in (("c1", "c0"), ("c2", "c1")):
            st = trained[name][ck]
            assert st["parent"] == parent and st["full_reason"] is None, st
            tracked = sum(n for t, n in st["fed"].items() if t != "d")
            assert st["rows"] == tracked + DP_ROWS, f"{name} {ck}: {st} (the DP table once, not once a rank)"
            assert 0 < st["rows"] < total // 2


def _compare(tmp, name, ck):
    src = load_dump(os.path.join(tmp, f"d_{name}_trained"))
    dst = load_dump(os.path.join(tmp, f"d_{name}_{ck}"))
    assert set(src) == set(dst) == {f"coll.embedding_bags.{t}" for t, *_ in TABLES}
    for table in src:
        shape = src[table]["shape"]
        same(full(src[table]["weight"], shape), full(dst[table]["weight"], shape), f"{name} {ck} {table}: embeddings")
        if not src[table]["states"]:     # the data-parallel table: no fused optimizer state
            continue
        a = src[table]["states"]["momentum1"]
        b = dst[table]["states"]["momentum1"]
        if len(a[0][1].shape) == 2:      # Adagrad: shaped like the weight, column-split like it
            sa, sb = full(a, shape), full(b, shape)
        else:                            # RowWiseAdagrad: one value per row (per column shard under CW)
            rows = shape[0]
            sa = full(a, [rows])
            for off, t in b:             # each column shard of the row holds the row's value
                same(t, sa[off[0] % rows:off[0] % rows + t.shape[0]], f"{name} {ck} {table}: momentum shard {off}")
            continue
        assert bool((sa != 0).any()), f"{table}: no optimizer state trained"
        same(sa, sb, f"{name} {ck} {table}: optimizer state")


@pytest.mark.parametrize("name", sorted(JOBS))
def test_chain_loaded_at_3_ranks_under_another_plan_equals_uninterrupted_model(chains, name):
    tmp, _, loaded = chains
    assert loaded[name]["c2"]["rows"] > 0
    _compare(tmp, name, "c2")


@pytest.mark.parametrize("name", sorted(JOBS))
def test_compacted_chain_equals_uninterrupted_model(chains, name):
    import recckpt
    tmp, *_ = chains
    path = os.path.join(tmp, f"ck_{name}", "c2_full")
    view = recckpt.open(path)
    assert recckpt.verify(path).ok
    assert all(view.tables[t].rows == r for t, r in
               ((f"coll.embedding_bags.{n}", rows) for n, rows, _ in TABLES)), "the compacted checkpoint is full"
    _compare(tmp, name, "c2_full")



def _rows(path, table, slots):
    import recckpt
    view = recckpt.open(path)
    ids, cols = [], {s: [] for s in slots}
    for i, c in view.iter_rows(table, slots):
        ids.append(i)
        for s in slots:
            cols[s].append(c[s])
    ids = np.concatenate(ids)
    order = np.argsort(ids)
    return ids[order], {s: np.concatenate(v)[order] for s, v in cols.items()}


def test_torchrec_table_warm_starts_a_hashtable_by_row_index(chains, tmp_path):
    import recckpt
    tmp, *_ = chains
    src = os.path.join(tmp, "ck_ada", "c0")          # fused Adagrad, table 'a' (40 x 12) table-wise

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = recckpt.HashTable("user", dim=12)

    model = Model()
    opt = recckpt.SparseAdagrad(model, lr=0.05)
    saver = recckpt.Saver(model, sparse_optim=opt, output_dir=str(tmp_path / "run"))
    manager = recckpt.CheckpointManager(saver, 10)
    results = manager.load_model_bank([{"path": src, "tables": ["coll.embedding_bags.a"],
                                        "rename": {"coll.embedding_bags.a": "user"}}])
    assert [r.tables for r in results] == [["user"]]
    ids, cols = _rows(src, "coll.embedding_bags.a", ["embedding", "adagrad.acc"])
    assert np.array_equal(ids, np.arange(40))
    got = model.user.ids().numpy()
    order = np.argsort(got)
    assert np.array_equal(got[order], ids), "every row index becomes an id of the HashTable"
    emb = model.user.slot("embedding").detach().numpy()[order]
    acc = model.user.slot("adagrad.acc").detach().numpy()[order]
    assert np.array_equal(emb, cols["embedding"])
    assert np.array_equal(acc, cols["adagrad.acc"]) and (acc != 0).any()
