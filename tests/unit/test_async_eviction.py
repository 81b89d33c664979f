"""Eviction applies to async saves as to sync ones (issue 29 item 4): the manager loop with
`async_save=True` ends with the same live table and the same checkpoints (rows and removed ids of
every increment) as with `async_save=False`."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.tables import table_contents
from recckpt import CheckpointManager, EvictionPolicy, HashTable, IncrementPolicy, SaveOptions, Saver, SparseAdam

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = HashTable("emb", 4, track_changes=True, counters=True)
        self.lin = torch.nn.Linear(4, 1)


def run(out, async_save, increments):
    m = Model()
    opt = SparseAdam([m.emb], lr=0.05)
    s = Saver(m, opt, output_dir=out, max_keep=None, options=OPTS, eviction=EvictionPolicy(max_idle_steps=5))
    mgr = CheckpointManager(s, save_interval=10, async_save=async_save, keep=None, save_rng=False,
                            increments=IncrementPolicy(full_every=5) if increments else None)
    for step in range(1, 31):
        m.emb.step = step
        m.emb.train()
        ids = torch.arange(step * 100, step * 100 + 100)      # 100 new ids each step
        m.lin(m.emb(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
        m.lin.zero_grad()
        mgr.step()
    mgr.close()
    return m, s


def manifests(out):
    found = {}
    for d in sorted(out.iterdir()):
        if (d / "manifest.json").exists():
            man = json.loads((d / "manifest.json").read_text())
            found[d.name] = {k: (t["rows"], t.get("removed", 0)) for k, t in man["tables"].items()}
    return found


@pytest.mark.parametrize("increments", [False, True])
def test_async_saves_evict_as_sync_saves_do(tmp_path, increments):
    ms, ss = run(tmp_path / "sync", False, increments)
    ma, sa = run(tmp_path / "async", True, increments)
    # the save at step 30 keeps rows updated at steps 25..30 (last_step >= 30 - 5); 3000 without eviction
    assert len(ms.emb) == 600
    assert len(ma.emb) == len(ms.emb), f"async: {len(ma.emb)} live rows, sync: {len(ms.emb)}"
    want, got = table_contents(ms.emb), table_contents(ma.emb)
    assert set(got) == set(want)
    for k in want:
        assert set(got[k]) == set(want[k]), f"slot {k}: live ids differ"
    assert manifests(tmp_path / "async") == manifests(tmp_path / "sync")
    if increments:   # the increments record the evicted ids as removed
        assert manifests(tmp_path / "sync")["ckpt_20"]["emb"][1] > 0
    for cid in ss.checkpoints():
        a, b = Model(), Model()
        Saver(a, SparseAdam([a.emb], lr=0.05), output_dir=tmp_path / "sync", options=OPTS).load(ckpt_id=cid)
        Saver(b, SparseAdam([b.emb], lr=0.05), output_dir=tmp_path / "async", options=OPTS).load(ckpt_id=cid)
        ca, cb = table_contents(a.emb), table_contents(b.emb)
        for k in ca:
            assert set(ca[k]) == set(cb[k]), f"{cid} slot {k}"
            assert all(torch.equal(ca[k][i], cb[k][i]) for i in ca[k]), f"{cid} slot {k}"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_table_without_counters_is_left_whole_and_the_save_commits(tmp_path, caplog, async_save):
    """Table `a` counts, table `b` does not. Before, the save evicted every idle row of `a` from the live
    table, then refused on `b`: nothing committed, `a`'s rows gone, and every later save failing the same
    way. Now `b` is left whole with one warning, and the save commits `a` evicted."""
    m = torch.nn.Module()
    m.a = HashTable("a", 4, counters=True)
    m.b = HashTable("b", 4)
    m.a.step = 0
    m.a(torch.arange(100))
    m.b(torch.arange(100))
    m.a.step = 50
    s = Saver(m, output_dir=str(tmp_path), max_keep=None, options=OPTS, eviction=EvictionPolicy(max_idle_steps=10))
    mgr = CheckpointManager(s, save_interval=1, async_save=async_save, keep=None, save_rng=False)
    mgr.global_step = 48   # saves at steps 49 and 50: a's rows, last seen at step 0, are idle
    with caplog.at_level("WARNING", logger="recckpt"):
        mgr.step()
        mgr.step()
        mgr.wait()
    assert [c for c, _ in mgr.checkpoints()] == ["ckpt_49", "ckpt_50"], mgr.checkpoints()
    assert (len(m.a), len(m.b)) == (0, 100)
    said = [r.getMessage() for r in caplog.records if "counters" in r.getMessage()]
    assert len(said) == 1 and "'b'" in said[0], said   # once, naming the table
    got = recckpt_tables(str(tmp_path / "ckpt_50"))
    assert got == {"a": 0, "b": 100}, got
    mgr.close()


def recckpt_tables(path):
    import recckpt
    return {t: d.rows for t, d in recckpt.open(path).tables.items()}
