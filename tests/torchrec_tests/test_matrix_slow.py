"""The full cross-plan matrix of issue 25 (RECCKPT_SLOW=1): each save plan at 2 ranks loads into each load
plan at 3 ranks and into one unsharded process, and an unsharded save loads into each plan at 3 ranks;
EBC (fused Adagrad; data-parallel tables and tables on the "dense" compute kernel with their state in the
registered dense KeyedOptimizer) and EC,
ShardedTensor and DTensor state dicts. Compared row by row and state by state with what TorchRec held
when saved. The CI sample (test_reshard_sample.py) runs a subset of these pairs."""
from __future__ import annotations

import os

import pytest

from .harness import full, load_dump, needs_torchrec, run_jobs, same

pytestmark = [needs_torchrec, pytest.mark.slow]

# "g" is big enough that the 1 MB slack of the read bound does not hide a read of whole rows (a
# column-wise rank holds 8 of its 24 columns; a whole-row read would be ~3x its share).
EBC_TABLES = [["a", 13, 24, "fp32"], ["b", 7, 12, "fp32"], ["h", 9, 12, "fp16"], ["g", 60_000, 24, "fp32"]]
EC_TABLES = [["a", 13, 12, "fp32"], ["b", 7, 12, "fp32"], ["g", 60_000, 12, "fp32"]]
MB = 1 << 20
# *dense: the "dense" compute kernel, whose Adagrad state is each rank's shard in the dense KeyedOptimizer
EBC_SAVE = ["tw", "rw", "cw", "cw001", "twrw", "dp", "mixed", "mixed_cw", "tw_dtensor", "rw_dtensor", "cw_dtensor",
            "rwdense", "twdense", "cwdense", "rwdense_dtensor"]
EBC_LOAD = ["tw", "rw", "cw", "cw001", "twrw", "dp", "mixed", "mixed_cw", "rw_dtensor", "rwdense", "twdense", "cwdense"]
EC_SAVE = ["tw", "rw", "cw"]
# (no "dense" kernel for EC: TorchRec 1.8's sharded EmbeddingCollection on it fails in its own training step on CPU)
EC_LOAD = ["tw", "rw", "cw"]


def _plan(kind, name, tables):
    base = name.replace("_dtensor", "")
    if base == "mixed":
        return {"a": "dp", "b": "rw", "h": "tw", "g": "twrw"}
    if base == "mixed_cw":
        return {"a": "dp", "b": "rw", "h": "cw", "g": "cw"}
    return {t[0]: base for t in tables}


def _job(tmp, kind, name, *, save=False, load=None, plan_name=None):
    tables = EBC_TABLES if kind == "ebc" else EC_TABLES
    plan_name = plan_name or name
    plan = "unsharded" if plan_name == "unsharded" else _plan(kind, plan_name, tables)
    return {"name": name, "kind": kind, "dtensor": plan_name.endswith("_dtensor"), "plan": plan, "opt": "adagrad",
            "tables": tables, "train_steps": 3 if save else 0,
            "save": os.path.join(tmp, f"ck_{kind}_{name}") if save else None,
            "load": os.path.join(tmp, f"ck_{kind}_{load}") if load else None, "load_conf": None,
            "dump": os.path.join(tmp, f"d_{kind}_{name}")}


CASES = ([("ebc", s, d) for s in EBC_SAVE for d in EBC_LOAD + ["unsharded"]]
         + [("ebc", "unsharded", d) for d in EBC_LOAD]
         + [("ec", s, d) for s in EC_SAVE for d in EC_LOAD])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torchrec_matrix"))
    run_jobs(tmp, 2, [_job(tmp, k, s, save=True) for k, saves in (("ebc", EBC_SAVE), ("ec", EC_SAVE)) for s in saves],
             timeout=600)
    one = run_jobs(tmp, 1, [_job(tmp, "ebc", "unsharded", save=True)]
                   + [_job(tmp, "ebc", f"unsharded_from_{s}", load=s, plan_name="unsharded") for s in EBC_SAVE],
                   timeout=600)
    three = run_jobs(tmp, 3, [_job(tmp, k, f"{d}_from_{s}", load=s, plan_name=d) for k, s, d in CASES
                              if d != "unsharded"], timeout=1500)
    # each rank's result of each load, by (kind, save, load plan)
    out = {("ebc", s, "unsharded"): [res[1 + i]] for i, s in enumerate(EBC_SAVE) for res in one}
    loads3 = [c for c in CASES if c[2] != "unsharded"]
    out.update({c: [res[i] for res in three] for i, c in enumerate(loads3)})
    return tmp, out


def _state(t):
    for name in ("momentum1", "sum"):
        if name in t["states"]:
            return t["states"][name]
    raise AssertionError(f"no Adagrad state among {sorted(t['states'])}")


@pytest.mark.parametrize("kind,save,load", CASES, ids=[f"{k}-{s}@2-to-{d}" for k, s, d in CASES])
def test_every_save_plan_loads_into_every_load_plan(matrix, kind, save, load):
    matrix, results = matrix
    src = load_dump(os.path.join(matrix, f"d_{kind}_{save}"))
    dst = load_dump(os.path.join(matrix, f"d_{kind}_{load}_from_{save}"))
    assert set(src) == set(dst)
    for table in src:
        shape = src[table]["shape"]
        a, b = full(src[table]["weight"], shape), full(dst[table]["weight"], shape)
        same(a, b.to(a.dtype) if b.dtype != a.dtype else b, f"table {table}: embeddings")
        sa, sb = full(_state(src[table]), shape), full(_state(dst[table]), shape)
        assert bool((sa != 0).any()), f"table {table}: training left no optimizer state"
        same(sa.to(sb.dtype), sb, f"table {table}: Adagrad state")


@pytest.mark.parametrize("kind,save,load", CASES, ids=[f"{k}-{s}@2-to-{d}" for k, s, d in CASES])
def test_every_pair_reads_at_most_its_share(matrix, kind, save, load):
    """Issue 25 item 4: each loading rank reads at most 1.2x the bytes of the table state it holds (its rows x
    its columns of the embedding and Adagrad state) + 1 MB, in every pair (docs/FORMAT.md)."""
    _, results = matrix
    for rank, r in enumerate(results[(kind, save, load)]):
        assert r["name"] == f"{load}_from_{save}"
        assert r["bytes_read"] <= 1.2 * r["share_bytes"] + MB, (
            f"rank {rank} read {r['bytes_read'] / MB:.2f} MB for a share of {r['share_bytes'] / MB:.2f} MB "
            f"({kind} {save}@2 -> {load})")
