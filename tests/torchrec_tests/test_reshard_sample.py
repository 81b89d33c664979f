"""TorchRec models saved under one plan and world size, loaded under another (the CI sample of issue 25):
real DistributedModelParallel on gloo in spawned processes, several cases per process group (each process
pays TorchRec's import once). Every case compares what TorchRec holds after the load, row by row and slot
by slot, with what it held when saved.

Phases: 2 ranks train and save (EBC table-wise with fused Adagrad incl. an fp16 table, row-wise with
RowWiseAdagrad, data-parallel + row-wise + table-wise with a KeyedOptimizer or torch.optim dense optimizer,
DTensor, EC row-wise, table-row-wise, the default planner for EBC and EC, MCH row-wise, column-wise with
Adagrad and RowWiseAdagrad, and CW@2 -> TW@2); 1 process loads into unsharded modules (EBC, MCH, from
TW@2 and CW@2) and saves unsharded ones, and checks refused mismatches; 3 ranks load: TW@2 -> RW@3,
RowWiseAdagrad RW@2 -> CW@3, CW@2 -> RW@3 / CW@3 (Adagrad and RowWiseAdagrad), DP@2 -> RW@3,
TW@2 -> DP@3, unsharded -> RW@3, default -> default, MCH RW@2 -> RW@3 (fitting, over capacity: error and
evict), MCH unsharded -> RW@3.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from .harness import ROOT, column_shards, full, load_dump, load_mch_dump, needs_torchrec, run_jobs, same

pytestmark = needs_torchrec

TABLES = [["a", 13, 24, "fp32"], ["b", 7, 12, "fp32"], ["h", 9, 12, "fp16"]]
TW = {"a": "tw", "b": "tw", "h": "tw"}
RW = {"a": "rw", "b": "rw", "h": "rw"}
CW = {"a": "cw", "b": "cw", "h": "cw"}
DP_MIX = {"a": "dp", "b": "rw", "h": "tw"}   # table a data-parallel: its Adagrad state is in the dense optimizer
EC_TABLES = [["a", 13, 12, "fp32"], ["b", 7, 12, "fp32"]]   # an EC needs one dim for all its tables


MCH_BIG = [["m", 40, 8, "fp32"]]     # a managed-collision table that fits every plan below
MCH_SMALL = [["s", 8, 8, "fp32"]]    # 6 admitted ids at 2 ranks (3 + 3), 5 slots at 3 ranks (2 + 2 + 1)
MCH_INPUT = 60                       # raw ids 0..59, routed by range: 30 per rank at 2, 20 per rank at 3
# Reads bounded by the raw-id range: ~20k admitted ids of TorchRec's default input size 2**63 - 1 (routed by
# range, saved with "id_range" buckets), 64 dims + Adagrad: 10 MB, so a whole-table read is past the bound.
MCH_FILL = [["f", 30_000, 64, "fp32"]]
MCH_FILL_INPUT = 2 ** 63 - 1
MCH_F = "coll._embedding_module.embedding_bags.f"


# Reads bounded by the shard (issue 25 item 4): tables big enough that the 1 MB slack does not hide a
# whole-table read (4 x 50k rows x 24 fp32: 4.8 MB of weights + 4.8 MB of Adagrad state each).
BIG = [[f"g{i}", 50_000, 24, "fp32"] for i in range(4)]
# (plan, optimizer) of each save; (save, load, optimizer) of each bounded load. Column-wise loads at 3 ranks
# hold 8 of the 24 columns: CW@2 -> CW@3 cuts both saved 12-column blocks (the middle rank), RW@2 and TW@2
# saved whole rows; with RowWiseAdagrad a rank's share is 32 + 4 bytes a row, so 8 bytes of ids would not fit.
BIG_SAVES = [("tw", "adagrad"), ("rw", "adagrad"), ("twrw", "adagrad"), ("mixed", "adagrad"), ("cw", "adagrad"),
             ("tw", "rowwise")]
BIG_PAIRS = [("tw", "rw", "adagrad"), ("rw", "tw", "adagrad"), ("twrw", "rw", "adagrad"), ("mixed", "rw", "adagrad"),
             ("rw", "mixed", "adagrad"), ("cw", "rw", "adagrad"),
             ("rw", "cw", "adagrad"), ("tw", "cw", "adagrad"), ("cw", "cw", "adagrad"),
             ("rw", "cw", "rowwise"), ("tw", "cw", "rowwise"), ("cw", "cw", "rowwise")]


# The RowWiseAdagrad RW@2 and CW@2 saves (and their loads at 3 ranks) are those of the jobs rowwise_rw2 and
# rowwise_cw2, which hold the big tables too (a job costs more than its tables: each builds a DMP model).
WITH_BIG = {"rowwise_rw2": "rw", "rowwise_cw2": "cw", "cw3_from_rowwise_rw2": "cw", "cw3_from_rowwise_cw2": "cw",
            "rw3_from_rowwise_cw2": "rw", "cw2_from_rowwise_cw2": "cw"}


def _big(p, opt):
    return f"big_{p}2" if opt == "adagrad" else f"big_{p}2_{opt}" if p == "tw" else f"rowwise_{p}2"


def _load_of(save, load, opt):
    """The job that loads the `save` plan's big tables under the `load` plan at 3 ranks."""
    return f"cw3_from_rowwise_{save}2" if opt == "rowwise" and save != "tw" else f"big_{load}3_from_{_big(save, opt)}"


def _with_big(job):
    """A job of the small tables that also holds the big ones (plan as WITH_BIG says)."""
    kind = WITH_BIG[job["name"]]
    return dict(job, tables=job["tables"] + BIG, plan={**job["plan"], **{t[0]: kind for t in BIG}})


def _big_plan(p):
    if p == "mixed":
        return {"g0": "dp", "g1": "rw", "g2": "tw", "g3": "twrw"}
    return {t[0]: p for t in BIG}


def _mch(name, plan, tmp, tables=MCH_BIG, **kw):
    plan = {t[0]: "rw" for t in tables} if plan == "rw" else plan
    return dict(_job(name, plan, "adagrad", tmp, tables=tables, kind="mch", **kw), mch_input=MCH_INPUT)


def _mch_fill(name, tmp, **kw):
    return dict(_mch(name, "rw", tmp, tables=MCH_FILL, **kw), mch_input=MCH_FILL_INPUT, mch_batch=5_000)


def _job(name, plan, opt, tmp, *, save=False, load=None, steps=0, tables=TABLES, conf=None, kind="ebc",
         dtensor=False):
    return {"name": name, "kind": kind, "dtensor": dtensor, "plan": plan, "opt": opt, "tables": tables, "train_steps": steps,
            "save": os.path.join(tmp, f"ck_{name}") if save else None,
            "load": os.path.join(tmp, f"ck_{load}") if load else None, "load_conf": conf,
            "dump": os.path.join(tmp, f"d_{name}")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torchrec"))
    saved = run_jobs(tmp, 2, [
        _job("tw2", TW, "adagrad", tmp, save=True, steps=3),
        _with_big(_job("rowwise_rw2", RW, "rowwise", tmp, save=True, steps=3)),
        _job("dp2", DP_MIX, "adagrad", tmp, save=True, steps=3),
        dict(_job("dp2_torch", DP_MIX, "adagrad", tmp, save=True, steps=3), dense_opt="torch"),
        _job("dtensor_tw2", TW, "adagrad", tmp, save=True, steps=3, dtensor=True),
        _job("ec_rw2", RW, "adagrad", tmp, save=True, steps=3, kind="ec", tables=EC_TABLES),
        _job("twrw2", {"a": "twrw", "b": "twrw", "h": "twrw"}, "rowwise", tmp, save=True, steps=3),
        _job("default2", "default", "adagrad", tmp, save=True, steps=3),     # DMP's own planner (no plan)
        _job("ec_default2", "default", "adagrad", tmp, save=True, steps=3, kind="ec", tables=EC_TABLES),
        _mch("mch_rw2", "rw", tmp, save=True, steps=3),
        _mch("mchs_rw2", "rw", tmp, tables=MCH_SMALL, save=True, steps=4),
        _mch_fill("mchf_rw2", tmp, save=True, steps=2),
        *[_job(_big(p, opt), _big_plan(p), opt, tmp, tables=BIG, save=True, steps=1) for p, opt in BIG_SAVES],
        # column-wise saves: each rank writes its column block (format version 4)
        _job("cw2", CW, "adagrad", tmp, save=True, steps=3),
        _with_big(_job("rowwise_cw2", CW, "rowwise", tmp, save=True, steps=3)),
        _job("tw2_from_cw2", TW, "adagrad", tmp, load="cw2", save=True),   # saved again: whole rows
        _with_big(_job("cw2_from_rowwise_cw2", CW, "rowwise", tmp, load="rowwise_cw2")),   # the same column split
    ])
    bad = [("rows", [["a", 14, 24, "fp32"], *TABLES[1:]]), ("dim", [["a", 13, 28, "fp32"], *TABLES[1:]]),
           ("missing", TABLES[:2]), ("optimizer", TABLES)]
    unsharded = run_jobs(tmp, 1, [
        _job("unsharded_from_tw2", "unsharded", "adagrad", tmp, load="tw2"),
        _job("unsharded1", "unsharded", "adagrad", tmp, save=True, steps=3),
        *[dict(_job(f"bad_{why}", "unsharded", "rowwise" if why == "optimizer" else "adagrad", tmp, load="tw2",
                    tables=tables), expect_error=True, dump_before=os.path.join(tmp, f"d_bad_{why}_before"))
          for why, tables in bad],
        _job("unsharded_from_cw2", "unsharded", "adagrad", tmp, load="cw2"),
        _mch("mch_un_from_rw2", "unsharded", tmp, load="mch_rw2"),
        _mch("mch_un1", "unsharded", tmp, save=True, steps=3),
    ])
    keys = {r["name"]: r["table_keys"] for ranks in (saved, unsharded) for r in ranks[0]}
    errors = {r["name"]: r["error"] for r in unsharded[0] if "error" in r}
    results = run_jobs(tmp, 3, [
        _job("rw3_from_tw2", RW, "adagrad", tmp, load="tw2"),
        _with_big(_job("cw3_from_rowwise_rw2", CW, "rowwise", tmp, load="rowwise_rw2")),
        _job("rw3_from_cw2", RW, "adagrad", tmp, load="cw2"),
        _job("cw3_from_cw2", CW, "adagrad", tmp, load="cw2"),
        _with_big(_job("cw3_from_rowwise_cw2", CW, "rowwise", tmp, load="rowwise_cw2")),
        _with_big(_job("rw3_from_rowwise_cw2", RW, "rowwise", tmp, load="rowwise_cw2")),
        _job("rw3_from_dp2", RW, "adagrad", tmp, load="dp2"),
        _job("dp3_from_tw2", DP_MIX, "adagrad", tmp, load="tw2"),
        dict(_job("rw3_from_dp2_torch", RW, "adagrad", tmp, load="dp2_torch"), dense_opt="torch"),
        dict(_job("dp3_torch_from_tw2", DP_MIX, "adagrad", tmp, load="tw2"), dense_opt="torch"),
        _job("rw3_from_unsharded1", RW, "adagrad", tmp, load="unsharded1"),
        _job("rw3_from_dtensor_tw2", RW, "adagrad", tmp, load="dtensor_tw2"),
        _job("ec_tw3_from_ec_rw2", TW, "adagrad", tmp, load="ec_rw2", kind="ec", tables=EC_TABLES),
        _job("tw3_from_twrw2", TW, "rowwise", tmp, load="twrw2"),
        _job("default3_from_default2", "default", "adagrad", tmp, load="default2"),
        _job("ec_default3_from_ec_default2", "default", "adagrad", tmp, load="ec_default2", kind="ec", tables=EC_TABLES),
        *[_job(_load_of(p, d, opt), _big_plan(d), opt, tmp, tables=BIG, load=_big(p, opt))
          for p, d, opt in BIG_PAIRS if _load_of(p, d, opt).startswith("big_")],
        _mch("mch_rw3_from_rw2", "rw", tmp, load="mch_rw2"),
        _mch("mch_rw3_from_un1", "rw", tmp, load="mch_un1"),
        dict(_mch("mchs_err", "rw", tmp, tables=MCH_SMALL, load="mchs_rw2"), expect_error=True),
        _mch("mchs_evict", "rw", tmp, tables=MCH_SMALL, load="mchs_rw2", conf={"overflow": "evict"}),
        _mch_fill("mchf_rw3_from_rw2", tmp, load="mchf_rw2"),
    ])
    errors.update({r["name"]: r.get("error") for r in results[0] if r["name"] == "mchs_err"})
    keys.update({r["name"]: r["table_keys"] for r in results[0]})
    return tmp, results, errors, keys


def test_a_load_finds_table_keys_from_the_plan_alone(runs):
    """The dense load passes TorchRec's load hooks the table entries they read, knowing which entries are
    tables from the plan and the state_dict's keys (`table_keys`), without building the tables again; under
    every plan and kind above (MCH buffers included) those are the keys `find_tables` takes."""
    keys = runs[3]
    assert len(keys) > 40 and keys["mch_rw2"][1] > len(MCH_BIG)   # the MCH buffers are table keys too
    assert {name for name, (agree, n) in keys.items() if not agree or n == 0} == set()


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


@pytest.mark.parametrize("dst_name", ["rw3_from_cw2", "cw3_from_cw2", "tw2_from_cw2", "unsharded_from_cw2"])
def test_cw2_save_loads_exactly_into_other_plans(runs, dst_name):
    """A column-wise save (each rank writes its column block) loads row by row and element by element
    into row-wise @3, another column split @3, table-wise @2 and one unsharded process, Adagrad state
    included (fused 'momentum1' or the unsharded in-backward optimizer's 'sum')."""
    tmp, *_ = runs
    src, dst = _tables(tmp, "cw2"), _tables(tmp, dst_name)
    # TorchRec splits the 24-column table in two at 2 ranks (the 12-column ones stay one shard)
    assert len({off[1] for off, _ in src["coll.embedding_bags.a"]["weight"]}) == 2, "the save was not column-wise"
    _weights_equal(src, dst)
    _states_equal(src, dst, ("momentum1", "sum"))


@pytest.mark.parametrize("dst_name", ["cw2_from_rowwise_cw2", "cw3_from_rowwise_cw2", "rw3_from_rowwise_cw2"])
def test_rowwise_cw2_per_column_shard_state(runs, dst_name):
    """RowWiseAdagrad under a column-wise save keeps each column shard's per-row value (one per block). A
    load gives each shard the width-weighted mean of the saved shards' values over its own columns: the
    row-wise value for a whole-row (row-wise) shard, an overlap-weighted mean for another column split
    (docs/TORCHREC.md); an unchanged split gets each shard's own value back, exactly."""
    tmp, *_ = runs
    src, dst = _tables(tmp, "rowwise_cw2"), _tables(tmp, dst_name)
    _weights_equal(src, dst)
    for table in src:
        saved = column_shards(src[table])
        if table == "coll.embedding_bags.a":   # split in two at 2 ranks (the 12-column tables are not)
            assert len(saved) == 2 and not torch.equal(saved[0][2], saved[1][2]), "shards' values should differ"
        if dst_name.startswith("rw"):
            targets = [(0, src[table]["shape"][1], full(dst[table]["states"]["momentum1"], [src[table]["shape"][0]]))]
        else:
            targets = column_shards(dst[table])
        for c0, c1, got in targets:
            acc = sum(m.to(torch.float64) * (min(b, c1) - max(a, c0)) for a, b, m in saved if a < c1 and b > c0)
            want = (acc / sum(min(b, c1) - max(a, c0) for a, b, _ in saved if a < c1 and b > c0)).to(got.dtype)
            assert torch.allclose(got, want, rtol=1e-6, atol=0), f"table {table} columns [{c0}, {c1})"
            if dst_name == "cw2_from_rowwise_cw2":
                own = next(m for a, b, m in saved if (a, b) == (c0, c1))
                same(got, own, f"table {table} columns [{c0}, {c1}): the shard's own value")


def _states_equal(src, dst, names):
    """Each table's optimizer state equal, whichever optimizer holds it: the fused one ('momentum1') or,
    for a data-parallel table, the registered dense KeyedOptimizer (Adagrad's 'sum')."""
    for table in src:
        shape = src[table]["shape"]
        a = full(next(src[table]["states"][n] for n in names if n in src[table]["states"]), shape)
        b = full(next(dst[table]["states"][n] for n in names if n in dst[table]["states"]), shape)
        assert bool((a != 0).any()), f"table {table}: training left no optimizer state to compare"
        same(a.to(b.dtype), b, f"table {table}: Adagrad state")


def test_dp2_to_rw3_rows_and_optimizer_state(runs):
    """A data-parallel table becomes row-wise: its rows, and its Adagrad state moves from the dense
    KeyedOptimizer into the fused optimizer; the dense optimizer loads without refusing (no exclude)."""
    tmp, results, *_ = runs
    src, dst = _tables(tmp, "dp2"), _tables(tmp, "rw3_from_dp2")
    _weights_equal(src, dst)
    assert "sum" in src["coll.embedding_bags.a"]["states"], "the DP table's state is in the dense optimizer"
    _states_equal(src, dst, ("momentum1", "sum"))
    assert results[0][2]["loaded_tables"] == ["coll.embedding_bags.a", "coll.embedding_bags.b", "coll.embedding_bags.h"]


@pytest.mark.parametrize("src_name,dst_name", [("dp2_torch", "rw3_from_dp2_torch")])
def test_dp_to_rw_with_a_torch_optim_dense_optimizer(runs, src_name, dst_name):
    """The same with a plain torch.optim Adagrad as the dense optimizer (numbered state, mapped by name)."""
    tmp, *_ = runs
    src, dst = _tables(tmp, src_name), _tables(tmp, dst_name)
    _weights_equal(src, dst)
    assert "sum" in src["coll.embedding_bags.a"]["states"]
    _states_equal(src, dst, ("momentum1", "sum"))


@pytest.mark.parametrize("dst_name", ["dp3_from_tw2", "dp3_torch_from_tw2"])
def test_tw2_to_dp3_optimizer_state_moves_into_dense_optimizer(runs, dst_name):
    """The reverse: a table-wise table (fused Adagrad) becomes data-parallel: its state lands in the
    registered dense optimizer (a KeyedOptimizer, or a torch.optim one), which loads without refusing
    its new parameter."""
    tmp, *_ = runs
    src, dst = _tables(tmp, "tw2"), _tables(tmp, dst_name)
    _weights_equal(src, dst)
    assert "sum" in dst["coll.embedding_bags.a"]["states"]
    _states_equal(src, dst, ("momentum1", "sum"))


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
    tmp, _, errors, _ = runs
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


def test_model_free_tools_read_a_column_wise_checkpoint_as_whole_rows(runs):
    """verify / recckpt.open / export / diff on a column-wise save (column blocks), in a process without
    torchrec: whole rows equal what TorchRec held, and its digests (and values) equal those of the same state
    saved table-wise (whole rows) after a CW@2 -> TW@2 load."""
    tmp, *_ = runs
    ck, again = os.path.join(tmp, "ck_cw2", "ckpt_1"), os.path.join(tmp, "ck_tw2_from_cw2", "ckpt_1")
    out = os.path.join(tmp, "export_cw2")
    code = textwrap.dedent(f"""
        import json, sys, numpy as np, recckpt
        rep = recckpt.verify({ck!r})
        view = recckpt.open({ck!r})
        rows = {{}}
        for name in view.tables:
            ids, emb, acc = [], [], []
            for i, cols in view.iter_rows(name, ["embedding", "adagrad.acc"]):
                ids.append(i); emb.append(cols["embedding"]); acc.append(cols["adagrad.acc"])
            o = np.argsort(np.concatenate(ids))
            rows[name] = [np.concatenate(emb)[o].astype(np.float64).tolist(),
                          np.concatenate(acc)[o].astype(np.float64).tolist()]
        res = recckpt.export({ck!r}, {out!r})
        d, dv = recckpt.diff({ck!r}, {again!r}), recckpt.diff({ck!r}, {again!r}, values=True)
        print(json.dumps({{"ok": bool(rep.ok), "rows": rows, "torchrec": "torchrec" in sys.modules,
                          "blocks": "column_blocks" in json.load(open({ck!r} + "/manifest.json"))["tables"]["coll.embedding_bags.a"],
                          "contents": d.contents, "not_compared": d.not_compared, "digest_rows": d.rows,
                          "values": {{t: [v.only_a, v.only_b, v.changed_rows] for t, v in dv.values.items()}}}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"] and not got["torchrec"] and got["blocks"]
    src = _tables(tmp, "cw2")
    for table in src:
        shape = src[table]["shape"]
        same(torch.tensor(got["rows"][table][0], dtype=torch.float64),
             full(src[table]["weight"], shape).to(torch.float64), f"table {table}: embeddings read without torchrec")
        same(torch.tensor(got["rows"][table][1], dtype=torch.float64),
             full(src[table]["states"]["momentum1"], shape).to(torch.float64), f"table {table}: Adagrad state")
    assert os.listdir(out)
    assert got["contents"] == {} and got["not_compared"] == {} and len(got["digest_rows"]) == 3, got
    assert all(v == [0, 0, 0] for v in got["values"].values()), got["values"]


@pytest.mark.parametrize("src_name,dst_name,state", [
    ("dtensor_tw2", "rw3_from_dtensor_tw2", "momentum1"),     # DTensor state dicts (output_dtensor=True)
    ("ec_rw2", "ec_tw3_from_ec_rw2", "momentum1"),            # EmbeddingCollection RW@2 -> TW@3
    ("twrw2", "tw3_from_twrw2", "momentum1"),                 # table-row-wise, RowWiseAdagrad
    # the default planner (no plan) @2 -> @3: it makes these small EBC tables data-parallel (their state in
    # the in-backward optimizer, 'sum') and the EC's row-wise
    ("default2", "default3_from_default2", "sum"),
    ("ec_default2", "ec_default3_from_ec_default2", "momentum1"),
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


def _mch_same(src, dst, table, state_names=("momentum1", "momentum1")):
    """Every raw id of `dst` has the rows it had in `src`: embedding, optimizer state, eviction metadata."""
    for raw, (w, states, meta, _) in dst[table].items():
        w0, states0, meta0, _ = src[table][raw]
        same(w0, w, f"table {table} raw id {raw}: embedding")
        a, b = states0[state_names[0]], states[state_names[1]]
        same(a.to(b.dtype).reshape(b.shape), b, f"table {table} raw id {raw}: Adagrad state")
        assert meta0 == meta, f"table {table} raw id {raw}: metadata {meta0} vs {meta}"


def _routed_by_range(dump, table, world, input_size=MCH_INPUT):
    """TorchRec's row-wise MCH routes raw id x to rank x // ceil(input size / world)."""
    block = -(-input_size // world)
    for raw, (*_, rank) in dump[table].items():
        assert rank == raw // block, f"table {table}: raw id {raw} loaded on rank {rank}, routed to {raw // block}"


MCH_T = "coll._embedding_module.embedding_bags.m"
MCH_S = "coll._embedding_module.embedding_bags.s"


def test_mch_rw2_to_rw3_every_admitted_id_keeps_its_rows(runs):
    """MCH 2 -> 3: the raw-id -> slot mapping is rebuilt for the new shards; every admitted id is on the
    rank TorchRec routes it to, with its embedding, Adagrad state and LFU count (its slot may change)."""
    tmp, *_ = runs
    src, _ = load_mch_dump(os.path.join(tmp, "d_mch_rw2"))
    dst, caps = load_mch_dump(os.path.join(tmp, "d_mch_rw3_from_rw2"))
    assert len(src[MCH_T]) >= 8 and set(src[MCH_T]) == set(dst[MCH_T])
    assert any(bool((s[1]["momentum1"] != 0).any()) for s in src[MCH_T].values())
    _mch_same(src, dst, MCH_T)
    _routed_by_range(dst, MCH_T, 3)
    _routed_by_range(src, MCH_T, 2)


def test_mch_unsharded_both_ways(runs):
    tmp, *_ = runs
    src, _ = load_mch_dump(os.path.join(tmp, "d_mch_rw2"))
    dst, _ = load_mch_dump(os.path.join(tmp, "d_mch_un_from_rw2"))
    assert set(src[MCH_T]) == set(dst[MCH_T])
    _mch_same(src, dst, MCH_T, ("momentum1", "sum"))
    src, _ = load_mch_dump(os.path.join(tmp, "d_mch_un1"))
    dst, _ = load_mch_dump(os.path.join(tmp, "d_mch_rw3_from_un1"))
    assert len(src[MCH_T]) >= 4 and set(src[MCH_T]) == set(dst[MCH_T])
    _mch_same(src, dst, MCH_T, ("sum", "momentum1"))
    _routed_by_range(dst, MCH_T, 3)


def test_mch_over_capacity_error_or_evict(runs):
    """A shard routed more admitted ids than it has slots: by default a recckpt error naming the table and
    the counts, with nothing loaded; with load_conf {'overflow': 'evict'} each shard keeps its ids of
    highest LFU count (ties: the smaller raw id), each with its own rows."""
    tmp, _, errors, _ = runs
    src, _ = load_mch_dump(os.path.join(tmp, "d_mchs_rw2"))
    assert len(src[MCH_S]) == 6
    err = errors["mchs_err"]
    assert err and err.startswith("IncompatibleCheckpointError"), err
    for needle in (MCH_S, "6 admitted ids", "for 2 slots", "'overflow': 'evict'", "Nothing was loaded"):
        assert needle in err, f"{needle!r} not in {err}"
    untouched, _ = load_mch_dump(os.path.join(tmp, "d_mchs_err"))
    assert untouched.get(MCH_S, {}) == {}, "a refused load admitted ids"
    dst, caps = load_mch_dump(os.path.join(tmp, "d_mchs_evict"))
    block = -(-MCH_INPUT // 3)
    want = set()
    for rank, cap in caps[MCH_S].items():
        mine = [raw for raw in src[MCH_S] if raw // block == rank]
        mine.sort(key=lambda raw: (-src[MCH_S][raw][2]["counts"], raw))
        want |= set(mine[:cap])
    assert set(dst[MCH_S]) == want and len(want) < 6
    _mch_same(src, dst, MCH_S)


MB = 1 << 20


@pytest.mark.parametrize("save,load,opt", BIG_PAIRS, ids=[f"{p}@2-to-{d}@3-{o}" for p, d, o in BIG_PAIRS])
def test_reads_bounded_by_the_shard(runs, save, load, opt):
    """Each loading rank reads (LoadResult.bytes_read, sparse shard files) at most 1.2x the bytes of the
    table state it holds + 1 MB: its rows x its columns of the embedding and elementwise optimizer state,
    plus its per-row optimizer state (RowWiseAdagrad's, one value per row per column shard). Format version 5
    buckets TorchRec tables by row range (a rank reads the buckets of its rows), stores a full save's rows
    without ids, and stores the embedding and Adagrad state in groups of 4 columns (a column-wise rank reads
    the groups of its columns); a column-wise save's blocks hold each row once (a data-parallel table: all
    of it, on every rank). docs/FORMAT.md, what a loading rank reads."""
    tmp, results, *_ = runs
    name = _load_of(save, load, opt)
    for rank, res in enumerate(results):
        r = next(x for x in res if x["name"] == name)
        share = r["share_bytes"]
        print(f"bytes read {save}@2 -> {load}@3 ({opt}) rank {rank}: {r['bytes_read'] / share:.3f}x a share of "
              f"{share / MB:.2f} MB")
        assert r["bytes_read"] <= 1.2 * share + MB, (
            f"rank {rank} read {r['bytes_read'] / MB:.2f} MB for a share of {share / MB:.2f} MB "
            f"({save}@2 -> {load}@3, {opt})")
        if load == "cw":   # a share of the columns, so the bound says something about them
            assert 2 * share < r["row_share_bytes"]
    row_bytes = 24 * 4 * 2 if opt == "adagrad" else 24 * 4 + 4
    total = sum(next(x for x in res if x["name"] == name)["bytes_read"] for res in results)
    assert total >= 4 * 50_000 * row_bytes * 0.9, "the ranks together read less than the tables hold"


def test_mch_reads_bounded_by_its_raw_id_range(runs):
    """MCH RW@2 -> RW@3 of ~20k admitted raw ids over input size 2**63 - 1: the table is saved with
    "id_range" buckets (docs/FORMAT.md), and each loading rank reads at most 1.2x the rows it loads + 1 MB
    (the buckets of its raw-id range and the reserved one; the other ranks' ids only, 8 bytes each, for the
    capacity check of every shard), where a whole-table read is ~3x that; every admitted id keeps its rows
    exactly, on the rank TorchRec routes it to."""
    tmp, results, *_ = runs
    man = json.load(open(os.path.join(tmp, "ck_mchf_rw2", "ckpt_1", "manifest.json")))
    t = man["tables"][MCH_F]
    assert (t["bucket_fn"], t["input_size"]) == ("id_range", MCH_FILL_INPUT)
    src, _ = load_mch_dump(os.path.join(tmp, "d_mchf_rw2"))
    dst, _ = load_mch_dump(os.path.join(tmp, "d_mchf_rw3_from_rw2"))
    assert len(src[MCH_F]) >= 15_000 and set(src[MCH_F]) == set(dst[MCH_F])
    _routed_by_range(dst, MCH_F, 3, MCH_FILL_INPUT)
    _mch_same(src, dst, MCH_F)
    row_bytes = 8 + 64 * 4 * 2 + 8   # raw id, embedding, Adagrad state, LFU count
    for rank, res in enumerate(results):
        r = next(x for x in res if x["name"] == "mchf_rw3_from_rw2")
        mine = sum(1 for *_, k in dst[MCH_F].values() if k == rank)
        assert r["rows"] == mine
        assert r["bytes_read"] <= 1.2 * mine * row_bytes + MB, (
            f"rank {rank} read {r['bytes_read'] / MB:.2f} MB for {mine} ids ({mine * row_bytes / MB:.2f} MB)")
        assert 3 * mine * row_bytes > len(src[MCH_F]) * row_bytes * 0.8   # a share, so the bound means something
