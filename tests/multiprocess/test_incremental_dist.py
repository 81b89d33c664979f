"""Incremental checkpoints on real processes: N ranks each write their own increment and commit once;
the chain loads on other world sizes (real processes and in-process resharded loads) to the exact state
of every step."""
from __future__ import annotations

import json
import os

import pytest

from helpers import rank_scenarios as sc
from helpers.ranks import ok, run_ranks

N_IDS = 6000


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("chain")
    out = str(base / "run")
    rep = ok(run_ranks(3, sc.chain_save, out, N_IDS, out_dir=str(base / "r3")))
    return base, out, rep


def test_each_rank_writes_its_increment_and_the_chain_is_kept(chain):
    base, out, rep = chain
    assert rep[0]["parents"] == ["base", "inc1", "inc2"]
    # max_keep=1, but the newest increment needs its whole chain
    assert rep[0]["committed"] == ["base", "inc1", "inc2", "inc3"]
    with open(os.path.join(out, "inc2", "manifest.json")) as f:
        m = json.load(f)
    assert m["shard_num"] == 3 and m["parent"]["ckpt_id"] == "inc1" and m["tables"]["emb"]["changes"]
    bins = {n.split("-")[1] for n in os.listdir(os.path.join(out, "inc2", "sparse")) if n.endswith(".bin")}
    assert bins == {"00000", "00001", "00002"}, "every rank wrote its own shard files"


# 4 workers on a 2-core CI machine cost twice the 2-worker sample; the slow flag runs both.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_chain_loads_resharded_on_real_processes(chain, world):
    base, out, _ = chain
    rep = ok(run_ranks(world, sc.chain_load, out, "inc3", out_dir=str(base / f"load{world}")))
    want = sc.chain_expected(N_IDS, sc.CHAIN_STEPS)
    got = {}
    for r in rep:
        assert r["own"], "a rank loaded ids it does not own"
        assert r["rows"] == len(r["ids"])
        for i, s in zip(r["ids"], r["salt"]):
            assert i not in got, f"id {i} loaded on two ranks"
            got[i] = s
    assert got == want


@pytest.mark.parametrize("ckpt,upto", [("base", 0), ("inc1", 1), ("inc2", 2)])
def test_every_link_equals_the_state_at_its_step(chain, ckpt, upto):
    """In-process resharded loads (3 ranks, as saved) of every older link."""
    from helpers.ranks import DIM, Holder, rows_for
    from recckpt import HashTable, Saver
    base, out, _ = chain
    got = {}
    for r in range(3):
        t = HashTable("emb", DIM)
        Saver(Holder(t), output_dir=out).load(ckpt_id=ckpt, shard_id=r, shard_num=3)
        ids = t.ids()
        emb = t.slot("embedding")[t.lookup(ids)]
        got.update(zip(ids.tolist(), (emb[:, 0] - rows_for(ids)["embedding"][:, 0]).tolist()))
    assert got == sc.chain_expected(N_IDS, upto)


def test_async_manager_increments_on_real_processes(tmp_path):
    """CheckpointManager(async_save=True, increments=...) on 2 ranks: each checkpoint holds the state at its
    step although the next step changed the table during its background write; loads on 3 ranks."""
    from helpers.ranks import DIM, Holder, rows_for
    from recckpt import HashTable, Saver
    out = str(tmp_path / "run")
    rep = ok(run_ranks(2, sc.chain_save_async, out, N_IDS, out_dir=str(tmp_path / "r")))
    assert rep[0] == {"ckpt_1": None, "ckpt_2": "ckpt_1", "ckpt_3": "ckpt_2", "ckpt_4": "ckpt_3"}
    for k in range(sc.CHAIN_STEPS + 1):
        got = {}
        for r in range(3):
            t = HashTable("emb", DIM)
            Saver(Holder(t), output_dir=out).load(ckpt_id=f"ckpt_{k + 1}", shard_id=r, shard_num=3)
            ids = t.ids()
            emb = t.slot("embedding")[t.lookup(ids)]
            got.update(zip(ids.tolist(), (emb[:, 0] - rows_for(ids)["embedding"][:, 0]).tolist()))
        assert got == sc.chain_expected(N_IDS, k), f"ckpt_{k + 1}"
