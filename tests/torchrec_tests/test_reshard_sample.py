"""TorchRec models saved under one plan and world size, loaded under another (the CI sample of issue 25):
real DistributedModelParallel on gloo in spawned processes, several cases per process group (each process
pays TorchRec's import once). Every case compares what TorchRec holds after the load, row by row and slot
by slot, with what it held when saved.

Phases: 2 ranks train and save (EBC table-wise with fused Adagrad incl. an fp16 table, row-wise with
RowWiseAdagrad, data-parallel + row-wise); 1 process loads the table-wise checkpoint into an unsharded
module and saves an unsharded one; 3 ranks load: TW@2 -> RW@3, RowWiseAdagrad RW@2 -> CW@3, DP@2 -> RW@3,
unsharded -> RW@3.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from .harness import ROOT, full, load_dump, needs_torchrec, run_jobs, same

pytestmark = needs_torchrec

TABLES = [["a", 13, 24, "fp32"], ["b", 7, 12, "fp32"], ["h", 9, 12, "fp16"]]
TW = {"a": "tw", "b": "tw", "h": "tw"}
RW = {"a": "rw", "b": "rw", "h": "rw"}
CW = {"a": "cw", "b": "cw", "h": "cw"}
EC_TABLES = [["a", 13, 12, "fp32"], ["b", 7, 12, "fp32"]]   # an EC needs one dim for all its tables


def _job(name, plan, opt, tmp, *, save=False, load=None, steps=0, tables=TABLES, conf=None, kind="ebc",
         dtensor=False):
    return {"name": name, "kind": kind, "dtensor": dtensor, "plan": plan, "opt": opt, "tables": tables, "train_steps": steps,
            "save": os.path.join(tmp, f"ck_{name}") if save else None,
            "load": os.path.join(tmp, f"ck_{load}") if load else None, "load_conf": conf,
            "dump": os.path.join(tmp, f"d_{name}")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torchrec"))
    run_jobs(tmp, 2, [
        _job("tw2", TW, "adagrad", tmp, save=True, steps=3),
        _job("rowwise_rw2", RW, "rowwise", tmp, save=True, steps=3),
        _job("dp2", {"a": "dp", "b": "rw", "h": "tw"}, "adagrad", tmp, save=True, steps=3),
        _job("dtensor_tw2", TW, "adagrad", tmp, save=True, steps=3, dtensor=True),
        _job("ec_rw2", RW, "adagrad", tmp, save=True, steps=3, kind="ec", tables=EC_TABLES),
        _job("twrw2", {"a": "twrw", "b": "twrw", "h": "twrw"}, "rowwise", tmp, save=True, steps=3),
    ])
    bad = [("rows", [["a", 14, 24, "fp32"], *TABLES[1:]]), ("dim", [["a", 13, 28, "fp32"], *TABLES[1:]]),
           ("missing", TABLES[:2]), ("optimizer", TABLES)]
    unsharded = run_jobs(tmp, 1, [
        _job("unsharded_from_tw2", "unsharded", "adagrad", tmp, load="tw2"),
        _job("unsharded1", "unsharded", "adagrad", tmp, save=True, steps=3),
        *[dict(_job(f"bad_{why}", "unsharded", "rowwise" if why == "optimizer" else "adagrad", tmp, load="tw2",
                    tables=tables), expect_error=True, dump_before=os.path.join(tmp, f"d_bad_{why}_before"))
          for why, tables in bad],
    ])
    errors = {r["name"]: r["error"] for r in unsharded[0][2:]}
    results = run_jobs(tmp, 3, [
        _job("rw3_from_tw2", RW, "adagrad", tmp, load="tw2"),
        _job("cw3_from_rowwise_rw2", CW, "rowwise", tmp, load="rowwise_rw2"),
        _job("rw3_from_dp2", RW, "adagrad", tmp, load="dp2", conf={"exclude": ["sparse_opt", "extra"]}),
        _job("rw3_from_unsharded1", RW, "adagrad", tmp, load="unsharded1"),
        _job("rw3_from_dtensor_tw2", RW, "adagrad", tmp, load="dtensor_tw2"),
        _job("ec_tw3_from_ec_rw2", TW, "adagrad", tmp, load="ec_rw2", kind="ec", tables=EC_TABLES),
        _job("tw3_from_twrw2", TW, "rowwise", tmp, load="twrw2"),
    ])
    return tmp, results, errors


def _tables(tmp, name):
    return load_dump(os.path.join(tmp, f"d_{name}"))


def _weights_equal(src, dst):
    assert set(src) == set(dst)
    for table in src:
        a, b = full(src[table]["weight"], src[table]["shape"]), full(dst[table]["weight"], dst[table]["shape"])
        assert a.dtype == b.dtype, table
        same(a, b, f"table {table}: embeddings")


def test_tw2_to_rw3_rows_and_adagrad_state(runs):
    tmp, *_ = runs
    src, dst = _tables(tmp, "tw2"), _tables(tmp, "rw3_from_tw2")
    _weights_equal(src, dst)
    for table in src:
        shape = src[table]["shape"]
        a = full(src[table]["states"]["momentum1"], shape)
        b = full(dst[table]["states"]["momentum1"], shape)
        assert bool((a != 0).any()), f"table {table}: training left no optimizer state to compare"
        same(a, b, f"table {table}: Adagrad state")
    assert src["coll.embedding_bags.h"]["weight"][0][1].dtype == torch.float16


def test_rowwise_rw2_to_cw3(runs):
    """RowWiseAdagrad's one value per row becomes each column shard's value (docs/TORCHREC.md)."""
    tmp, *_ = runs
    src, dst = _tables(tmp, "rowwise_rw2"), _tables(tmp, "cw3_from_rowwise_rw2")
    _weights_equal(src, dst)
    for table in src:
        rows = src[table]["shape"][0]
        per_row = full(src[table]["states"]["momentum1"], [rows])
        assert bool((per_row != 0).any())
        shards = dst[table]["states"]["momentum1"]
        assert len(shards) >= 2, "a column-wise plan on 3 ranks keeps one per-row state per column shard"
        for off, t in shards:
            k = off[0] // rows     # the column shard this piece belongs to
            same(t, per_row.to(t.dtype), f"table {table}: column shard {k} momentum")


def test_dp2_to_rw3_rows(runs):
    tmp, results, _ = runs
    src, dst = _tables(tmp, "dp2"), _tables(tmp, "rw3_from_dp2")
    _weights_equal(src, dst)
    assert results[0][2]["loaded_tables"] == ["coll.embedding_bags.a", "coll.embedding_bags.b", "coll.embedding_bags.h"]


def test_sharded_to_unsharded_and_back(runs):
    tmp, *_ = runs
    src, dst = _tables(tmp, "tw2"), _tables(tmp, "unsharded_from_tw2")
    _weights_equal(src, dst)
    for table in src:
        shape = src[table]["shape"]
        b = full(dst[table]["states"]["sum"], shape)
        same(full(src[table]["states"]["momentum1"], shape).to(b.dtype), b, f"table {table}: Adagrad state")
    src, dst = _tables(tmp, "unsharded1"), _tables(tmp, "rw3_from_unsharded1")
    _weights_equal(src, dst)
    for table in src:
        shape = src[table]["shape"]
        a = full(src[table]["states"]["sum"], shape)
        assert bool((a != 0).any())
        same(a.float(), full(dst[table]["states"]["momentum1"], shape).float(), f"table {table}: Adagrad state")


@pytest.mark.parametrize("why,needles", [
    ("rows", ["coll.embedding_bags.a", "13 rows", "14"]),
    ("dim", ["coll.embedding_bags.a", "(24,)", "(28,)"]),
    ("missing", ["coll.embedding_bags.h", "not in the model"]),
    ("optimizer", ["adagrad.acc", "rowwise_adagrad.acc", "coll.embedding_bags.a"]),
])
def test_mismatch_is_refused_and_nothing_applied(runs, why, needles):
    """Another row count, another dim, a missing table, another optimizer: a recckpt error naming the
    table (and slot), raised before any row is written."""
    tmp, _, errors = runs
    err = errors[f"bad_{why}"]
    assert err is not None and err.startswith("IncompatibleCheckpointError"), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    assert "Nothing was loaded" in err
    before, after = _tables(tmp, f"bad_{why}_before"), _tables(tmp, f"bad_{why}")
    _weights_equal(before, after)
    for table in before:
        for k, pieces in before[table]["states"].items():
            shape = [before[table]["shape"][0]] + list(pieces[0][1].shape[1:])
            same(full(pieces, shape), full(after[table]["states"][k], shape), f"table {table} state {k}")


def test_model_free_tools_read_a_torchrec_checkpoint_without_torchrec(runs):
    """verify / inspect / export / recckpt.open on a TorchRec checkpoint, in a process that never imports
    torchrec; the rows read back equal what TorchRec held, and the manifest records versions and plan."""
    tmp, *_ = runs
    ck = os.path.join(tmp, "ck_tw2", "ckpt_1")
    out = os.path.join(tmp, "export_tw2")
    code = textwrap.dedent(f"""
        import json, sys, numpy as np, recckpt
        rep = recckpt.verify({ck!r})
        view = recckpt.open({ck!r})
        rows = {{}}
        for name in view.tables:
            ids, emb = [], []
            for i, cols in view.iter_rows(name, ["embedding", "adagrad.acc"]):
                ids.append(i); emb.append(cols["embedding"])
            ids = np.concatenate(ids); emb = np.concatenate(emb)
            rows[name] = emb[np.argsort(ids)].astype(np.float64).tolist()
        recckpt.export({ck!r}, {out!r})
        print(json.dumps({{"ok": bool(rep.ok), "rows": rows, "meta": dict(view.metadata),
                          "torchrec": "torchrec" in sys.modules}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"] and not got["torchrec"]
    src = _tables(tmp, "tw2")
    for table in src:
        want = full(src[table]["weight"], src[table]["shape"]).to(torch.float64)
        same(torch.tensor(got["rows"][table], dtype=torch.float64), want, f"table {table} read without torchrec")
    meta = got["meta"]
    assert meta["recckpt.torchrec.version"] == "1.8.0" and meta["recckpt.fbgemm.version"].startswith("1.8.0")
    plan = json.loads(meta["recckpt.torchrec.plan"])
    assert plan["coll.embedding_bags.a"]["sharding"] == "table_wise"
    assert plan["coll.embedding_bags.a"]["shards"] == [[0, 0, 13, 24, 0]]
    assert os.listdir(out)
    cli = subprocess.run([sys.executable, "-m", "recckpt", "inspect", ck], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0 and "coll.embedding_bags.a" in cli.stdout and "adagrad.acc" in cli.stdout


@pytest.mark.parametrize("src_name,dst_name,state", [
    ("dtensor_tw2", "rw3_from_dtensor_tw2", "momentum1"),     # DTensor state dicts (output_dtensor=True)
    ("ec_rw2", "ec_tw3_from_ec_rw2", "momentum1"),            # EmbeddingCollection RW@2 -> TW@3
    ("twrw2", "tw3_from_twrw2", "momentum1"),                 # table-row-wise, RowWiseAdagrad
])
def test_more_plans_round_trip(runs, src_name, dst_name, state):
    tmp, *_ = runs
    src, dst = _tables(tmp, src_name), _tables(tmp, dst_name)
    _weights_equal(src, dst)
    for table in src:
        pieces = src[table]["states"][state]
        shape = [src[table]["shape"][0]] + ([src[table]["shape"][1]] if pieces[0][1].dim() == 2 else [])
        a = full(pieces, shape)
        assert bool((a != 0).any()), f"table {table}: no optimizer state to compare"
        same(a, full(dst[table]["states"][state], shape), f"table {table}: optimizer state")
