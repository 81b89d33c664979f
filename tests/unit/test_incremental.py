"""Incremental checkpoints: change tracking in HashTable, increments written by Saver.save(incremental=
True), chains loaded like full checkpoints (newest row wins, removed ids stay removed, any world size),
broken links refused before the model changes, and retention that keeps what a kept checkpoint needs."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.tables import DictTable, assert_tables_equal, table_contents
from recckpt import HashTable, SaveOptions, Saver, SparseAdam
from recckpt.errors import CorruptCheckpointError, InvalidArgumentError
from recckpt.format import checked_json, names
from recckpt.state.protocol import ChangeTracking, SlotSpec

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self, dim=4, track=True):
        super().__init__()
        self.emb = HashTable("emb", dim, track_changes=track)
        self.lin = torch.nn.Linear(dim, 1)


def train_step(model, opt, ids):
    model.emb.train()
    loss = model.lin(model.emb(ids)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.lin.zero_grad()


def snapshot(table):
    return table_contents(table)


def assert_contents(table, snap):
    now = table_contents(table)
    assert set(now) == set(snap)
    for k in snap:
        assert set(now[k]) == set(snap[k]), f"slot {k}: ids differ"
        for i, row in snap[k].items():
            assert torch.equal(now[k][i], row), (k, i)


# ----------------------------------------------------------------------------------- change tracking
def test_changes_since_a_mark():
    t = HashTable("t", 2)
    assert isinstance(t, ChangeTracking)
    t(torch.arange(10))
    mark = t.mark_changes()
    t.write_rows("embedding", t.lookup(torch.tensor([3])), torch.ones(1, 2))
    t(torch.tensor([4, 100]))            # 4 only looked up: not a change; 100 inserted
    assert t.remove_ids(torch.tensor([5, 6, 12345])) == 2
    t(torch.tensor([6]))                  # removed, then inserted again: a changed row, not removed
    ch = t.export_changes(mark, ["embedding"], 2)
    ids = torch.cat([i for i, _ in ch.chunks])
    assert sorted(ids.tolist()) == [3, 6, 100] and ch.rows == 3
    assert ch.removed.tolist() == [5]
    later = t.mark_changes()
    assert t.export_changes(later, ["embedding"], 8).rows == 0
    t.forget_changes(later)
    assert t.export_changes(mark, ["embedding"], 8).removed.numel() == 0  # records up to `later` dropped


def test_a_committed_save_lets_each_table_forget_what_it_holds(tmp_path):
    """After a save commits, each live tracking table forgets the removal records the checkpoint holds
    (memory stays bounded over a long run); records after the save's mark stay."""
    m = Model()
    m.emb(torch.arange(20))
    early = m.emb.mark_changes()
    m.emb.remove_ids(torch.tensor([5, 6]))
    saver = Saver(m, output_dir=str(tmp_path), options=OPTS)
    assert sorted(m.emb.export_changes(early, ["embedding"], 8).removed.tolist()) == [5, 6]
    saver.save("c1")
    assert m.emb.export_changes(early, ["embedding"], 8).removed.numel() == 0
    m.emb.remove_ids(torch.tensor([7]))
    assert m.emb.export_changes(early, ["embedding"], 8).removed.tolist() == [7]


def test_write_slots_writes_every_slot_and_marks_the_rows_changed():
    t = HashTable("t", 2)
    t.add_slot("acc", torch.float32, (2,))
    t(torch.arange(6))
    mark = t.mark_changes()
    rows = t.lookup(torch.tensor([1, 4]))
    with pytest.raises(InvalidArgumentError, match="nope"):   # every slot is checked before any is written
        t.write_slots(rows, {"embedding": torch.ones(2, 2), "nope": torch.ones(2, 2)})
    assert t.export_changes(mark, ["embedding"], 8).rows == 0
    t.write_slots(rows, {"embedding": torch.ones(2, 2), "acc": torch.full((2, 2), 7.0)})
    assert torch.equal(t.read_rows("acc", rows), torch.full((2, 2), 7.0))
    assert torch.equal(t.read_rows("embedding", rows), torch.ones(2, 2))
    ch = t.export_changes(mark, ["embedding", "acc"], 8)
    assert sorted(torch.cat([i for i, _ in ch.chunks]).tolist()) == [1, 4]


def test_stamps_pickled_as_int64_are_read_back():
    import pickle
    t = HashTable("t", 2)
    t(torch.arange(3))
    mark = t.mark_changes()
    t(torch.tensor([9]))
    state = t.__getstate__()
    state["_stamps"] = state["_stamps"].to(torch.int64)    # as a table pickled before int32 stamps
    old = HashTable.__new__(HashTable)
    old.__setstate__(state)
    back = pickle.loads(pickle.dumps(old))
    assert back.export_changes(mark, ["embedding"], 8).rows == 1


def test_marks_that_no_longer_describe_the_table_give_none():
    t = HashTable("t", 2)
    t(torch.arange(4))
    mark = t.mark_changes()
    t.add_slot("acc", torch.float32, (2,))
    assert t.export_changes(mark, ["embedding"], 8) is None
    mark = t.mark_changes()
    t.clear_rows()
    assert t.export_changes(mark, ["embedding"], 8) is None
    assert t.export_changes(10 ** 6, ["embedding"], 8) is None           # not one of its marks
    off = HashTable("off", 2, track_changes=False)
    off(torch.arange(3))
    assert off.export_changes(off.mark_changes(), ["embedding"], 8) is None


def test_remove_ids_keeps_the_other_rows():
    t = HashTable("t", 3)
    t(torch.arange(20))
    before = snapshot(t)
    t.remove_ids(torch.tensor([0, 7, 19, 7]))
    after = snapshot(t)
    assert set(after["embedding"]) == set(range(20)) - {0, 7, 19}
    for i, row in after["embedding"].items():
        assert torch.equal(row, before["embedding"][i])
    assert t.lookup(torch.tensor([7, 8])).tolist()[0] == -1


# ----------------------------------------------------------------------------------- save and load
def run_chain(tmp_path, n_incr=4, seed=0):
    """Full base, then increments after training steps with inserts, updates and removals; returns the
    model, its saver and each checkpoint's table contents."""
    gen = torch.Generator().manual_seed(seed)
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS)
    train_step(model, opt, torch.randint(0, 500, (300,), generator=gen))
    saver.save("c0", incremental=True)
    assert saver.last_save.parent is None and "not committed" in saver.last_save.full_reason
    snaps = {"c0": snapshot(model.emb)}
    for k in range(1, n_incr + 1):
        train_step(model, opt, torch.randint(0, 700, (40,), generator=gen))
        model.emb.remove_ids(torch.randint(0, 700, (15,), generator=gen))
        saver.save(f"c{k}", incremental=True)
        assert saver.last_save.parent == f"c{k - 1}" and saver.last_save.full_reason is None
        snaps[f"c{k}"] = snapshot(model.emb)
    return model, saver, snaps


def test_increments_hold_only_changes(tmp_path):
    model, saver, snaps = run_chain(tmp_path, n_incr=2)
    base = json.loads((tmp_path / "c0" / "manifest.json").read_text())
    inc = json.loads((tmp_path / "c2" / "manifest.json").read_text())
    assert base["format_version"] == names.FORMAT_VERSION and "parent" not in base
    assert inc["parent"]["ckpt_id"] == "c1"
    t = inc["tables"]["emb"]
    assert t["changes"] is True and 0 < t["rows"] < len(model.emb) and t["removed"] > 0
    assert base["tables"]["emb"]["rows"] == len(snaps["c0"]["embedding"])
    import recckpt
    report = recckpt.verify(str(tmp_path / "c2"))   # an increment's own files, removed ids included
    assert report.ok, report.problems


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_link_of_a_chain_loads_like_a_full_checkpoint(tmp_path, world):
    model, saver, snaps = run_chain(tmp_path)
    for ckpt, snap in snaps.items():
        merged = {k: {} for k in snap}
        for rank in range(world):
            m2 = Model()
            opt2 = SparseAdam([m2.emb], lr=0.05)
            res = Saver(m2, opt2, output_dir=tmp_path, options=OPTS).load(ckpt_id=ckpt, shard_id=rank,
                                                                          shard_num=world)
            part = snapshot(m2.emb)
            assert res.sparse_rows == len(part["embedding"])
            for k in part:
                assert not set(part[k]) & set(merged[k]), "two ranks loaded one id"
                merged[k].update(part[k])
        for k in snap:
            assert set(merged[k]) == set(snap[k]), (ckpt, k)
            for i, row in snap[k].items():
                assert torch.equal(merged[k][i], row), (ckpt, k, i)


@pytest.mark.parametrize("world", [1, 2])
def test_a_chain_load_in_many_bucket_groups_equals_one_in_a_single_group(tmp_path, monkeypatch, world):
    """Every bucket its own fold group (LOAD_GROUP_BYTES=1): each group appends its own rows, holes of
    removed ids are removed at the end; the table equals the state of the chain's newest link."""
    from recckpt.load import chain_load
    model, saver, snaps = run_chain(tmp_path)
    monkeypatch.setattr(chain_load, "LOAD_GROUP_BYTES", 1)
    merged = {}
    for rank in range(world):
        m2 = Model()
        res = Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load(
            ckpt_id="c4", shard_id=rank, shard_num=world)
        part = snapshot(m2.emb)
        assert res.sparse_rows == len(part["embedding"]) == len(m2.emb)
        for k, rows in part.items():
            merged.setdefault(k, {}).update(rows)
    assert_contents_equal(merged, snaps["c4"])


def assert_contents_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        assert set(got[k]) == set(want[k]), k
        assert all(torch.equal(got[k][i], r) for i, r in want[k].items()), k


def test_training_resumes_identically_after_a_chain_load(tmp_path):
    model, saver, _ = run_chain(tmp_path, n_incr=3)
    m2 = Model()
    opt2 = SparseAdam([m2.emb], lr=0.05)
    s2 = Saver(m2, opt2, output_dir=tmp_path, options=OPTS)
    s2.load()
    ids = model.emb.ids()[:50]   # ids both tables hold: a new id's initial row is random
    train_step(model, saver.sparse_optim, ids)
    train_step(m2, opt2, ids)
    assert_contents(m2.emb, snapshot(model.emb))
    # the loaded checkpoint is the parent of the next increment
    s2.save("c_next", incremental=True)
    assert s2.last_save.parent == "c3"
    m3 = Model()
    Saver(m3, SparseAdam([m3.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load(ckpt_id="c_next")
    assert_contents(m3.emb, snapshot(m2.emb))


def test_no_parent_left_means_a_full_checkpoint(tmp_path, caplog):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS)
    train_step(model, opt, torch.arange(30))
    saver.save("a")
    import shutil
    shutil.rmtree(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        saver.save("b", incremental=True)
    assert saver.last_save.parent is None and "no longer committed" in saver.last_save.full_reason
    assert "writing a full checkpoint" in caplog.text
    assert "parent" not in json.loads((tmp_path / "b" / "manifest.json").read_text())


def test_a_table_without_change_tracking_is_saved_whole(tmp_path, caplog):
    spec = {"embedding": SlotSpec(torch.float32, (2,), "sparse")}
    dt = DictTable("plain", spec)
    dt.set_rows(torch.arange(5), {"embedding": torch.randn(5, 2)})

    class Both(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.emb = HashTable("emb", 2)
            self.plain = d

    model = Both(dt)
    model.emb(torch.arange(10))
    saver = Saver(model, output_dir=tmp_path, max_keep=None, options=OPTS)
    saver.save("a")
    dt.set_rows(torch.arange(3, 6), {"embedding": torch.randn(3, 2)})   # 0..2 gone: only a full save says so
    model.emb.write_rows("embedding", torch.tensor([0]), torch.ones(1, 2))
    saver.save("b", incremental=True)
    tables = json.loads((tmp_path / "b" / "manifest.json").read_text())["tables"]
    assert tables["emb"].get("changes") is True and tables["emb"]["rows"] == 1
    assert "changes" not in tables["plain"] and tables["plain"]["rows"] == 3
    m2 = Both(DictTable("plain", spec))
    Saver(m2, output_dir=tmp_path, options=OPTS).load()
    assert_tables_equal(m2.plain, dt)
    assert_tables_equal(m2.emb, model.emb)


def _rewrite_manifest(path, change):
    obj = json.loads(path.read_text())
    obj.pop("crc32c")
    change(obj)
    path.write_bytes(checked_json.dumps(obj))


@pytest.mark.parametrize("damage", ["missing", "altered", "ids"])
def test_a_broken_link_is_named_and_the_model_is_unchanged(tmp_path, damage):
    run_chain(tmp_path, n_incr=3)
    if damage == "missing":
        import shutil
        shutil.rmtree(tmp_path / "c1")
    elif damage == "altered":
        _rewrite_manifest(tmp_path / "c1" / "manifest.json", lambda o: o["metadata"].update(x="y"))
    else:  # flip a byte of the first ids column of the base
        from recckpt.format.checkpoint import CheckpointReader
        from recckpt.storage import open_storage
        idx = CheckpointReader(open_storage(str(tmp_path / "c0")), "").index
        seg = idx.tables["emb"][1][0]
        shard = tmp_path / "c0" / idx.files[seg.file][0]
        data = bytearray(shard.read_bytes())
        data[seg.columns[0].offset] ^= 0xFF
        shard.write_bytes(bytes(data))
    m2 = Model()
    opt2 = SparseAdam([m2.emb], lr=0.05)
    m2.emb(torch.arange(7))
    before = snapshot(m2.emb)
    lin_before = m2.lin.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError) as e:
        Saver(m2, opt2, output_dir=tmp_path, options=OPTS).load(ckpt_id="c3")
    assert ("c0" if damage == "ids" else "c1") in str(e.value)
    assert_contents(m2.emb, before)
    assert torch.equal(m2.lin.weight, lin_before)


def test_retention_keeps_the_chain_of_kept_checkpoints(tmp_path):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=1, options=OPTS)
    for k in range(4):
        train_step(model, opt, torch.arange(k * 10, k * 10 + 20))
        saver.save(f"c{k}", incremental=k > 0)
    assert saver.checkpoints() == ["c0", "c1", "c2", "c3"]   # c3 needs all of them
    saver.save("full")
    assert saver.checkpoints() == ["full"]
    m2 = Model()
    Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load()
    assert_contents(m2.emb, snapshot(model.emb))


# ----------------------------------------------------------------------------------- compaction
@pytest.mark.parametrize("memory_bytes", [1 << 30, 2000])   # one bucket group, or many
def test_compact_folds_a_chain_into_an_equal_full_checkpoint(tmp_path, memory_bytes):
    import recckpt
    model, saver, snaps = run_chain(tmp_path / "run", n_incr=3)
    saver.register_for_checkpointing("note", {"k": 1})
    stats = recckpt.compact(tmp_path / "run" / "c3", tmp_path / "run" / "folded", fsync=False,
                            memory_bytes=memory_bytes)
    assert stats.links == 4 and stats.rows == len(snaps["c3"]["embedding"])
    man = json.loads((tmp_path / "run" / "folded" / "manifest.json").read_text())
    assert "parent" not in man and "changes" not in man["tables"]["emb"]
    assert "folded" in saver.checkpoints()
    for world in (1, 2):
        merged = {k: {} for k in snaps["c3"]}
        for rank in range(world):
            m2 = Model()
            Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path / "run", options=OPTS).load(
                ckpt_id="folded", shard_id=rank, shard_num=world)
            for k, rows in snapshot(m2.emb).items():
                merged[k].update(rows)
            assert torch.equal(m2.lin.weight, model.lin.weight)
        for k, rows in snaps["c3"].items():
            assert set(merged[k]) == set(rows)
            assert all(torch.equal(merged[k][i], r) for i, r in rows.items())
    import recckpt.format.verifier as V
    assert V.verify(str(tmp_path / "run" / "folded")).ok


def test_compact_refuses_an_existing_destination_and_a_broken_chain(tmp_path):
    import shutil

    import recckpt
    from recckpt.errors import CheckpointExistsError
    run_chain(tmp_path, n_incr=2)
    with pytest.raises(CheckpointExistsError):
        recckpt.compact(tmp_path / "c2", tmp_path / "c1", fsync=False)
    shutil.rmtree(tmp_path / "c1")
    with pytest.raises(CorruptCheckpointError, match="c1"):
        recckpt.compact(tmp_path / "c2", tmp_path / "x", fsync=False)
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]


# ----------------------------------------------------------------------------------- eviction
def test_counters_count_lookups_and_updates():
    from recckpt.state.eviction import FREQ, LAST_STEP
    t = HashTable("t", 2, counters=True)
    t.step = 5
    t(torch.tensor([1, 1, 2, 3, 1]))
    t.step = 9
    t.write_rows("embedding", t.lookup(torch.tensor([2])), torch.ones(1, 2))
    freq = dict(zip(t.ids().tolist(), t.slot(FREQ).tolist()))
    last = dict(zip(t.ids().tolist(), t.slot(LAST_STEP).tolist()))
    assert freq == {1: 3, 2: 1, 3: 1} and last == {1: 5, 2: 9, 3: 5}
    t.eval()
    t(torch.tensor([1, 99]))              # eval lookups neither insert nor count
    assert dict(zip(t.ids().tolist(), t.slot(FREQ).tolist())) == freq


def test_eviction_at_save_leaves_the_table_and_is_recorded_in_the_increment(tmp_path):
    from recckpt import EvictionPolicy
    model = Model()
    model.emb.enable_counters()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=tmp_path, max_keep=None, options=OPTS,
                  eviction=EvictionPolicy(max_idle_steps=10, min_freq=2))
    model.emb.step = 0
    train_step(model, opt, torch.arange(0, 40))        # every row: freq 1
    train_step(model, opt, torch.arange(0, 20))        # rows 0..19: freq 2
    saver.save("a", step=0)                            # min_freq=2 evicts 20..39
    assert sorted(model.emb.ids().tolist()) == list(range(20))
    model.emb.step = 15
    train_step(model, opt, torch.arange(0, 10))        # rows 0..9 updated at step 15
    saver.save("b", step=15, incremental=True)         # 10..19 idle since step 0 > 10 steps
    assert sorted(model.emb.ids().tolist()) == list(range(10))
    man = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert man["tables"]["emb"]["removed"] == 10
    m2 = Model()
    m2.emb.enable_counters()
    Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load()
    assert_contents(m2.emb, snapshot(model.emb))       # counters are slots, saved and loaded


@pytest.mark.parametrize("conf", [{"slots": ["embedding", "adam.*"]}, {"slots": ["embedding"], "merge": True},
                                  {"load": ["sparse_opt"]}, {"slots": ["embedding", "adam.*"], "mmap": True}, "plain"])
def test_rows_a_load_inserts_without_their_last_step_start_at_the_tables_step(tmp_path, conf):
    """Not at last_step 0: an idle-based eviction at the next save would take the whole warm start."""
    from recckpt import EvictionPolicy
    from recckpt.state.eviction import FREQ, LAST_STEP
    src = Model()
    if conf != "plain":
        src.emb.enable_counters()   # "plain": a checkpoint without counters
    opt = SparseAdam([src.emb], lr=0.05)
    src.emb.step = 5000
    train_step(src, opt, torch.arange(30))
    Saver(src, opt, output_dir=tmp_path / "a", options=OPTS).save("c")
    dst = Model()
    dst.emb.enable_counters()
    dst.emb.step = 100
    saver = Saver(dst, SparseAdam([dst.emb], lr=0.05), output_dir=tmp_path / "b", options=OPTS,
                  eviction=EvictionPolicy(max_idle_steps=50))
    saver.load(ckpt_path=str(tmp_path / "a" / "c"), direct_path=True,
               load_conf={"strict": False} if conf == "plain" else conf)
    assert len(dst.emb) == 30
    assert dst.emb.slot(LAST_STEP).tolist() == [100] * 30 and dst.emb.slot(FREQ).tolist() == [0] * 30
    dst.emb.step = 120
    saver.save("s", step=120)
    assert len(dst.emb) == 30   # none idle for more than 50 steps


def test_import_rows_and_adopted_storage_without_last_step_start_new_rows_at_the_step():
    from recckpt.state.eviction import LAST_STEP
    t = HashTable("t", 2, counters=True)
    t.step = 7
    t(torch.tensor([1]))
    t.step = 40
    t.import_rows(torch.tensor([1, 2]), {"embedding": torch.ones(2, 2)})
    assert dict(zip(t.ids().tolist(), t.slot(LAST_STEP).tolist())) == {1: 7, 2: 40}   # an existing row keeps its own
    t.import_rows(torch.tensor([3]), {"embedding": torch.ones(1, 2), LAST_STEP: torch.tensor([3])})
    assert t.slot(LAST_STEP).tolist()[-1] == 3   # a given last_step is kept
    u = HashTable("u", 2, counters=True)
    u.step = 60
    u.adopt_storage(2, torch.tensor([5, 6, 0]), {"embedding": torch.zeros(3, 2)})   # a mapped load's way in
    assert u.slot(LAST_STEP).tolist() == [60, 60]


def test_write_filter_shapes_the_checkpoint_not_the_table(tmp_path):
    from recckpt import EvictionPolicy
    model = Model()
    model.emb.enable_counters()
    model.emb(torch.arange(10))
    model.emb(torch.arange(5))
    saver = Saver(model, output_dir=tmp_path, options=OPTS, write_filter=EvictionPolicy(min_freq=2))
    saver.save("a")
    assert len(model.emb) == 10
    m2 = Model()
    m2.emb.enable_counters()
    Saver(m2, output_dir=tmp_path, options=OPTS).load()
    assert sorted(m2.emb.ids().tolist()) == list(range(5))


def test_eviction_policy_validates():
    from recckpt import EvictionPolicy
    with pytest.raises(ValueError):
        EvictionPolicy()
    with pytest.raises(ValueError):
        EvictionPolicy(min_freq=0)
    with pytest.raises(TypeError):
        EvictionPolicy(max_idle_steps=1.5)
    with pytest.raises(InvalidArgumentError, match="max_idle_steps must be in"):
        EvictionPolicy(max_idle_steps=2 ** 70)   # compared with int64 counters: every save failed
    with pytest.raises(TypeError):
        Saver(Model(), output_dir="memory://x", eviction="lru")


def test_chain_load_through_import_rows_with_an_ownership_function(tmp_path):
    """A user ownership function reads every bucket and imports the surviving rows one link after
    another (no fast base load): the same state."""
    _, _, snaps = run_chain(tmp_path, n_incr=3)
    merged = {}
    for rank in range(2):
        m2 = Model()
        Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load(
            shard_id=rank, shard_num=2, load_conf={"ownership": lambda ids, w: (ids % w).abs()})
        part = snapshot(m2.emb)
        assert all(i % 2 == rank for i in part["embedding"])
        for k, rows in part.items():
            merged.setdefault(k, {}).update(rows)
    for k, rows in snaps["c3"].items():
        assert set(merged[k]) == set(rows)
        assert all(torch.equal(merged[k][i], r) for i, r in rows.items())


# ----------------------------------------------------------------------------------- increment policy
def test_increment_policy_decides_from_the_chain():
    from recckpt.train.increments import IncrementPolicy
    p = IncrementPolicy(full_every=3, max_chain_fraction=0.5)
    assert not p.incremental(None)
    assert p.incremental((0, 0, 100)) and p.incremental((2, 40, 100))
    assert not p.incremental((3, 10, 100))        # k increments reached
    assert not p.incremental((1, 51, 100))        # bytes past the fraction
    assert IncrementPolicy(full_every=None, max_chain_fraction=2.0).incremental((50, 150, 100))
    for bad in (dict(full_every=0), dict(max_chain_fraction=0), dict(full_every=None, max_chain_fraction=None),
                dict(max_chain_fraction=float("nan"))):
        with pytest.raises(ValueError):
            IncrementPolicy(**bad)


def test_chain_stats_from_manifests(tmp_path):
    from recckpt.format import catalog
    from recckpt.format.chain import chain_stats
    from recckpt.storage import open_storage
    run_chain(tmp_path, n_incr=2)
    found = catalog.committed(open_storage(str(tmp_path)))
    incs, inc_bytes, base_bytes = chain_stats(found, "c2")
    assert incs == 2 and 0 < inc_bytes < base_bytes
    assert chain_stats(found, "c0")[0] == 0
    assert chain_stats([f for f in found if f[0] != "c1"], "c2") is None


def test_direct_path_to_an_increment_loads_its_chain(tmp_path):
    _, _, snaps = run_chain(tmp_path, n_incr=2)
    m2 = Model()
    res = Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path / "other", options=OPTS).load(
        ckpt_path=str(tmp_path / "c2"), direct_path=True)
    assert res.ckpt_id is None
    assert_contents(m2.emb, snaps["c2"])


# ----------------------------------------------------------------------------------- the manager
def _managed(out, keep=1):
    from recckpt import CheckpointManager, IncrementPolicy
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=out, options=OPTS)
    mgr = CheckpointManager(saver, save_interval=1, keep=keep, save_rng=False,
                            increments=IncrementPolicy(full_every=2, max_chain_fraction=None))
    return model, opt, saver, mgr


def test_manager_writes_increments_between_full_checkpoints_and_keeps_the_chain(tmp_path):
    model, opt, saver, mgr = _managed(tmp_path)
    kinds = []
    for step in range(6):
        train_step(model, opt, torch.arange(step * 5, step * 5 + 30))
        mgr.step()
        kinds.append(saver.last_save.parent)
    # full, +1, +2 (k=2 reached), full, +1, +2
    assert kinds == [None, "ckpt_1", "ckpt_2", None, "ckpt_4", "ckpt_5"]
    assert saver.checkpoints() == ["ckpt_4", "ckpt_5", "ckpt_6"]   # keep=1, plus the chain ckpt_6 needs
    m2, opt2, saver2, mgr2 = _managed(tmp_path)
    assert mgr2.restore() == 6
    assert_contents(m2.emb, snapshot(model.emb))
    train_step(m2, opt2, torch.arange(3))
    mgr2.step()     # after a restart the chain is read from the manifests: k=2 reached, so a full one
    assert saver2.last_save.parent is None and saver2.checkpoints() == ["ckpt_7"]


def test_cli_prune_keeps_the_chain_of_what_it_keeps(tmp_path):
    from recckpt.tools.outdir import prune
    run_chain(tmp_path, n_incr=2)
    assert prune(str(tmp_path), 1) == []            # c2 needs c1 and c0
    m2 = Model()
    Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load()   # still loads


def test_retention_cut_short_never_leaves_an_increment_without_its_parent(tmp_path):
    """Retention deletes an increment before the links it depends on: a crash after the first delete
    leaves only whole chains committed (each verifies, its every link included)."""
    import recckpt
    from recckpt.format import catalog
    from recckpt.storage import open_storage
    run_chain(tmp_path, n_incr=3)                        # c0 (full) <- c1 <- c2 <- c3
    st = open_storage(str(tmp_path))
    real, calls = st.delete_checkpoint, []

    def crash_after_one(*a, **kw):
        if calls:
            raise SystemExit("killed mid-retention")    # not an OSError: nothing catches it, like a kill
        calls.append(a[0])
        return real(*a, **kw)

    st.delete_checkpoint = crash_after_one
    with pytest.raises(SystemExit):
        catalog.retire(st, [], ["c0", "c1", "c2", "c3"], fsync=False)
    assert calls == ["c3"]                               # the newest increment went first
    left = [i for i, _ in catalog.committed(st)]
    assert left == ["c0", "c1", "c2"]
    for cid in left:
        rep = recckpt.verify(str(tmp_path / cid))
        assert rep.ok, rep.problems


def test_compaction_reuses_a_buffer_only_after_the_writer_wrote_it(tmp_path, monkeypatch):
    # Many bucket groups, two buffer sets used by turns: filling a set again must wait for every chunk
    # cut from it (group k - 2), and must not wait for the group just before (written meanwhile).
    import recckpt
    import recckpt.tools.compaction as C
    from recckpt.format.sparse_write import WriteReceipts
    model = torch.nn.Module()
    model.emb = HashTable("emb", 16, track_changes=True)
    opt = SparseAdam([model.emb], lr=0.05)
    model.emb(torch.arange(20_000))
    saver = Saver(model, opt, output_dir=tmp_path, options=OPTS)
    saver.save("base")
    gen = torch.Generator().manual_seed(3)
    for k in range(2):
        rows = torch.randperm(20_000, generator=gen)[:6000]
        model.emb.write_rows("embedding", rows, torch.randn(6000, 16, generator=gen))
        saver.save(f"i{k}", incremental=True)
    want = snapshot(model.emb)
    chunks, waited, fills = [0], [0], []
    taken, wait, fill = WriteReceipts.taken, WriteReceipts.wait, C.fill_live

    def record_taken(self, writer, segment):
        chunks[0] += 1
        return taken(self, writer, segment)

    def record_wait(self, count):
        waited[0] = max(waited[0], count)
        return wait(self, count)

    def record_fill(*args):
        fills.append((chunks[0], waited[0]))   # chunks taken and waited for when a group starts filling
        return fill(*args)

    monkeypatch.setattr(WriteReceipts, "taken", record_taken)
    monkeypatch.setattr(WriteReceipts, "wait", record_wait)
    monkeypatch.setattr(C, "fill_live", record_fill)
    recckpt.compact(tmp_path / "i1", tmp_path / "folded", fsync=False, memory_bytes=1 << 20)
    assert len(fills) >= 6 and fills[-1][0] > fills[1][0] > 0     # groups big enough to yield chunks
    for k in range(2, len(fills)):
        assert fills[k][1] >= fills[k - 1][0]     # every chunk of groups <= k - 2 (this set's last use)
        assert fills[k][1] <= fills[k - 1][0]     # none of group k - 1's
    m2 = torch.nn.Module()
    m2.emb = HashTable("emb", 16)
    Saver(m2, SparseAdam([m2.emb], lr=0.05), output_dir=tmp_path, options=OPTS).load(ckpt_id="folded")
    assert_contents(m2.emb, want)


def test_a_load_that_casts_a_table_is_not_the_parent_of_the_next_increment(tmp_path):
    """An fp32 checkpoint loaded into an fp16 table (cast is on by default): an increment on it would
    hold fp16 rows under an fp32 parent, and no load could fold the chain. The next incremental save
    is full and says why; a load without a cast still becomes the parent."""
    def model(dtype):
        m = torch.nn.Module()
        m.emb = HashTable("emb", dim=4, dtype=dtype)
        return m
    src = model(torch.float32)
    with torch.no_grad():
        src.emb(torch.arange(50))
    Saver(src, output_dir=tmp_path, options=OPTS).save("c1")
    for dtype, want_parent in ((torch.float16, None), (torch.float32, "c1")):
        dst = model(dtype)
        s = Saver(dst, output_dir=tmp_path, options=OPTS, max_keep=None)
        s.load(ckpt_id="c1")
        with torch.no_grad():
            dst.emb(torch.arange(40, 60))
        name = f"after_{str(dtype).split('.')[-1]}"
        stats = s.write(name, incremental=True)
        assert stats.parent == want_parent, stats
        if want_parent is None:
            assert "has not committed or fully loaded" in stats.full_reason, stats
        again = model(dtype)
        Saver(again, output_dir=tmp_path).load(ckpt_id=name)   # loads: the chain is consistent
        assert sorted(again.emb.ids().tolist()) == list(range(60))


def test_direct_path_loads_an_increment_named_relative_to_the_working_directory(tmp_path, monkeypatch):
    """direct_path=True with a bare name ("c2", the working directory being the output directory) found
    no directory to open the increment's parents from and refused it, where "./c2" and recckpt.open("c2")
    worked."""
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=str(tmp_path), options=OPTS)
    train_step(model, opt, torch.arange(30))
    saver.save("c1")
    train_step(model, opt, torch.arange(5))
    saver.save("c2", incremental=True)
    assert saver.last_save.parent == "c1"
    monkeypatch.chdir(tmp_path)
    for path in ("c2", "./c2"):
        dst = Model()
        r = Saver(dst, SparseAdam([dst.emb], lr=0.05), output_dir=str(tmp_path / "elsewhere")).load(
            ckpt_path=path, direct_path=True)
        assert r.path.endswith("/c2") and len(dst.emb) == 30, path
        assert_contents(dst.emb, snapshot(model.emb))


@pytest.mark.parametrize("when", ["writing", "copying_dense"])
def test_compact_of_a_chain_deleted_meanwhile_says_so(tmp_path, monkeypatch, when):
    """Retention in the run's process deletes the chain while `compact` reads it: the compaction said the
    (intact, properly deleted) checkpoint was corrupt. It now raises CheckpointDeletedError, as a load
    does, and commits nothing."""
    import shutil

    import recckpt
    import recckpt.tools.compaction as C
    from recckpt.errors import CheckpointDeletedError
    run_chain(tmp_path, n_incr=2)
    hook = "write_worker_part" if when == "writing" else "copy_whole_files"
    original = getattr(C, hook)

    def deleted_first(*a, **k):
        for cid in ("c2", "c1", "c0"):   # newest first, as retention deletes a chain
            shutil.rmtree(tmp_path / cid)
        return original(*a, **k)

    monkeypatch.setattr(C, hook, deleted_first)
    with pytest.raises(CheckpointDeletedError, match=r"compact: .*c2 was deleted while it was being compacted"):
        recckpt.compact(tmp_path / "c2", tmp_path / "x", fsync=False)
    assert not (tmp_path / "x").exists()
