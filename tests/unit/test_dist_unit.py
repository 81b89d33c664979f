"""Single-process checks of the distributed pieces: ownership, defaults, options, the duplicate and
IO-state rules with all shards saved from one process."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.ranks import SPEC, DictTable, Holder, Reader, rows_for
from recckpt import LoadConfig, SaveOptions, Saver, partition, split_by_owner
from recckpt.coordination import resolve_shard
from recckpt.errors import DuplicateIdsError, IncompatibleCheckpointError, InvalidArgumentError, LoadConfigError
from recckpt.format.hashing import bucket_of, bucket_range

FAST = SaveOptions(fsync=False)


@pytest.mark.parametrize("world", [1, 2, 3, 7, 4096])
def test_partition_is_the_bucket_range_owner(world):
    ids = torch.randint(-(1 << 63), (1 << 63) - 1, (5000,), dtype=torch.int64)
    owners = partition(ids, world)
    b = bucket_of(ids.numpy(), 4096)
    for r in range(world) if world < 10 else (0, 1, world - 1):
        lo, hi = bucket_range(r, world, 4096)
        assert np.array_equal(owners.numpy() == r, (b >= lo) & (b < hi))
    assert np.array_equal(partition(ids.numpy().reshape(50, 100), world), owners.numpy().reshape(50, 100))


def test_split_by_owner_groups_ids_by_rank():
    ids = torch.arange(-500, 500, dtype=torch.int64).reshape(10, 100)
    order, counts, owners = split_by_owner(ids, 3)
    routed = ids.reshape(-1)[order]
    assert counts.sum() == ids.numel()
    for r, chunk in enumerate(routed.split(counts.tolist())):
        assert (partition(chunk, 3) == r).all()
    assert torch.equal(routed[order.argsort()], ids.reshape(-1))


def test_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="world"):
        partition(torch.arange(3), 0)
    with pytest.raises(TypeError, match="int64"):
        partition(torch.arange(3, dtype=torch.int32), 2)


def test_resolve_shard_defaults(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_shard(None, None) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_shard(None, None) == (2, 4)
    assert resolve_shard(1, 3) == (1, 3)
    with pytest.raises(ValueError, match="not initialised"):
        resolve_shard(None, None, saving=True)
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        resolve_shard(None, None)
    with pytest.raises(ValueError, match=r"shard_id=3 is not in \[0, shard_num=3\)"):
        resolve_shard(3, 3)


def test_new_options_validate():
    with pytest.raises(ValueError, match="coordination_timeout_s"):
        SaveOptions(coordination_timeout_s=0)
    # values no save could use: accepted, they failed every save later with a bare OverflowError or a
    # pybind signature dump (a helper's attack)
    for kw in ({"coordination_timeout_s": float("inf")}, {"storage_timeout_s": 1e308},
               {"visibility_timeout_s": float("inf")}, {"max_inflight_bytes": 2 ** 63}, {"staging_bytes": 2 ** 70}):
        with pytest.raises(InvalidArgumentError, match=next(iter(kw))):
            SaveOptions(**kw)
    SaveOptions(coordination_timeout_s=1e9, max_inflight_bytes=2 ** 62)   # the largest allowed
    with pytest.raises(LoadConfigError, match="duplicates"):
        LoadConfig(duplicates="both")
    with pytest.raises(LoadConfigError, match="io_state_on_resize"):
        LoadConfig(io_state_on_resize="keep")
    with pytest.raises(LoadConfigError, match="ownership"):
        LoadConfig(ownership=3)


def _save_two_workers(out, ids_per_worker, steps=(None, None), io=False):
    for w, ids in enumerate(ids_per_worker):
        ids = torch.tensor(ids, dtype=torch.int64)
        t = DictTable("emb", SPEC)
        t.set_rows(ids, rows_for(ids, salt=1000.0 * w))
        s = Saver(Holder(t), output_dir=out, options=FAST)
        if io:
            s.register_io_state("reader", Reader(pos=w))
        s.save("c", shard_id=w, shard_num=2, step=steps[w])


def _load(out, **conf):
    t = DictTable("emb", SPEC)
    res = Saver(Holder(t), output_dir=out).load(load_conf={"load": ["sparse", "sparse_opt"], **conf})
    return t, res


def test_duplicate_id_saved_by_two_workers_in_one_process(tmp_path):
    _save_two_workers(tmp_path, [[5, 1, 2], [5, 3]])
    with pytest.raises(DuplicateIdsError, match=r"table 'emb' stores 1 id\(s\).*e\.g\. id 5 in worker 0 and in worker 1") as ei:
        _load(tmp_path)
    assert (ei.value.table, ei.value.rank) == ("emb", 0)
    with pytest.raises(DuplicateIdsError, match="were not recorded"):
        _load(tmp_path, duplicates="newest")


@pytest.mark.parametrize("steps,winner", [((20, 10), 0), ((10, 20), 1)])
def test_duplicates_newest_keeps_the_newer_workers_copy(tmp_path, steps, winner):
    _save_two_workers(tmp_path, [[5, 6, 1], [6, 5, 3]], steps=steps)
    t, res = _load(tmp_path, duplicates="newest")
    assert sorted(t.ids.tolist()) == [1, 3, 5, 6] and res.sparse_rows == 4
    got = {i: t.cols["embedding"][k] for k, i in enumerate(t.ids.tolist())}
    want = rows_for(torch.tensor([5, 6]), salt=1000.0 * winner)["embedding"]
    assert torch.equal(got[5], want[0]) and torch.equal(got[6], want[1])


def test_io_state_on_resize_in_process(tmp_path):
    _save_two_workers(tmp_path, [[1, 2], [3]], io=True)
    s = Saver(Holder(DictTable("emb", SPEC)), output_dir=tmp_path)
    rd = Reader(pos=-1)
    s.register_io_state("reader", rd)
    with pytest.raises(IncompatibleCheckpointError, match=r"saved by 2 worker\(s\) and is loaded on 3"):
        s.load(shard_id=0, shard_num=3)
    assert rd.pos == -1 and len(s.model.emb.ids) == 0
    res = s.load(shard_id=0, shard_num=3, load_conf={"io_state_on_resize": "drop"})
    assert res.io_state_dropped == ["reader"] and rd.pos == -1
    s.load(shard_id=1, shard_num=2)
    assert rd.pos == 1
