"""Many small segments read and checked in one pass (format/segment_groups.py; issue 26 item 3): the
vectorised directory rule agrees with `BucketDir.from_bytes` segment by segment, and a load of many
small tables reads them in a few reader calls, names a table that refuses its rows, and loads exactly
on several ranks."""
import os

import numpy as np
import pytest
import torch

from helpers.tables import small_tables
from recckpt import SaveOptions, Saver
from recckpt.errors import DuplicateIdsError
from recckpt.format.bucket_dirs import BucketDir
from recckpt.format.schema import Column, Segment
from recckpt.format.segment_groups import check_dirs
from recckpt.format.sparse_io import SegmentReader

NB = 64


def _segment(buckets, starts, rows):
    k = len(buckets)
    return Segment(0, rows, Column(0, 8 * k, (0,), 8 * k), (), k, int(buckets[0]), int(buckets[-1]))


def _random_dirs(rng, count):
    segs, raws = [], []
    for _ in range(count):
        rows = int(rng.integers(1, 40))
        k = int(rng.integers(1, min(rows, NB) + 1))
        b = np.sort(rng.choice(NB, k, replace=False)).astype("<u4")
        st = np.concatenate([[0], np.sort(rng.choice(np.arange(1, rows), k - 1, replace=False))]).astype("<u4") \
            if k > 1 else np.zeros(1, "<u4")
        segs.append(_segment(b, st, rows))
        raws.append(np.concatenate([b, st]).view(np.uint8))
    return segs, raws


def _pack(raws):
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in raws])[:-1]]).astype(int).tolist()
    return np.concatenate(raws) if raws else np.zeros(0, np.uint8), offsets


def test_directories_checked_at_once_agree_with_one_by_one():
    rng = np.random.default_rng(3)
    segs, raws = _random_dirs(rng, 200)
    buf, offsets = _pack(raws)
    dirs = check_dirs(buf, offsets, segs, NB)
    assert dirs is not None
    one = [BucketDir.from_bytes(r, s, NB) for r, s in zip(raws, segs)]
    for lo, hi in [(0, NB), (0, 1), (5, 40), (63, 64), (17, 18), (30, 30)]:
        r0, r1 = dirs.row_ranges(lo, hi)
        assert r0.tolist() == [d[lo] for d in one] and r1.tolist() == [d[hi] for d in one], (lo, hi)
    want = np.concatenate([d.bucket_of_rows(np.arange(s.rows)) for d, s in zip(one, segs)])
    assert np.array_equal(dirs.bucket_of_rows(), want)


@pytest.mark.parametrize("how", ["bucket_order", "start_order", "first", "last", "start0", "past_rows", "beyond_b"])
def test_a_bad_directory_in_a_group_is_refused_as_one_by_one(how):
    rng = np.random.default_rng(4)
    segs, raws = _random_dirs(rng, 30)
    i = next(j for j, s in enumerate(segs) if s.dir_entries >= 2)
    w = raws[i].view("<u4").copy()
    k = segs[i].dir_entries
    if how == "bucket_order":
        w[0], w[1] = w[1], w[0]
    elif how == "start_order":
        w[k + 1] = 0
    elif how == "first":
        segs[i] = Segment(0, segs[i].rows, segs[i].buckets, (), k, segs[i].first + 1, segs[i].last)
    elif how == "last":
        segs[i] = Segment(0, segs[i].rows, segs[i].buckets, (), k, segs[i].first, segs[i].last - 1)
    elif how == "start0":
        w[k] = 1
    elif how == "past_rows":
        w[2 * k - 1] = segs[i].rows
    elif how == "beyond_b":
        w[k - 1] = NB
        segs[i] = Segment(0, segs[i].rows, segs[i].buckets, (), k, segs[i].first, NB)
    raws[i] = w.view(np.uint8)
    assert BucketDir.from_bytes(raws[i], segs[i], NB) is None
    buf, offsets = _pack(raws)
    assert check_dirs(buf, offsets, segs, NB) is None


def _equal(a, b):
    for (name, x), y in zip(a.named_children(), b.children()):
        ids = x.ids()
        assert torch.equal(torch.sort(ids).values, torch.sort(y.ids()).values), name
        assert torch.equal(x.read_rows("embedding", x.lookup(ids)), y.read_rows("embedding", y.lookup(ids))), name


def test_many_small_tables_load_in_a_few_reader_calls(tmp_path, monkeypatch):
    """Every table's rows are read with its group: the reader is asked twice per group (directories,
    rows), not once or more per table (the per-table path before: ~300 reads for 300 tables)."""
    src = small_tables()
    out = str(tmp_path / "o")
    Saver(src, output_dir=out, options=SaveOptions(fsync=False)).save("c")
    calls = []
    real = SegmentReader.read
    monkeypatch.setattr(SegmentReader, "read", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    dst = small_tables(rows=0)
    res = Saver(dst, output_dir=out).load()
    assert res.sparse_rows == 300 * 50 and sorted(res.tables) == sorted(f"t{t}" for t in range(300))
    _equal(src, dst)
    assert len(calls) <= 4, len(calls)


def test_a_table_holding_an_id_twice_is_named_in_a_group(tmp_path):
    """Two saving shards that both hold id 7 of table t150 (routed inconsistently): the grouped load
    stops at t150, naming it, with the tables before it loaded and those after it untouched."""
    out = str(tmp_path / "d")
    for w in range(2):
        part = small_tables(rows=0)
        with torch.no_grad():
            for t, table in enumerate(part.children()):
                table(torch.arange(w, 50, 2) + 1000 * t)
            part.t150(torch.tensor([7 + 150_000]))   # on both shards
        Saver(part, output_dir=out, options=SaveOptions(fsync=False)).save("c", shard_id=w, shard_num=2)
    dst = small_tables(rows=3)
    with pytest.raises(DuplicateIdsError) as e:
        Saver(dst, output_dir=out).load()
    assert "'t150'" in str(e.value) and "tables fully loaded before it: t0, t1" in str(e.value), str(e.value)
    assert len(dst.t149) == 50 and len(dst.t150) == 0 and len(dst.t151) == 3


def test_grouped_load_onto_three_ranks_is_exact(tmp_path):
    """A partial range reads each group's directories, then only the rows of its buckets."""
    from recckpt import partition
    src = small_tables(n=120, rows=90)
    out = str(tmp_path / "r")
    Saver(src, output_dir=out, options=SaveOptions(fsync=False, num_buckets=256)).save("c")
    for r in range(3):
        dst = small_tables(n=120, rows=0)
        Saver(dst, output_dir=out).load(shard_id=r, shard_num=3)
        for (name, a), b in zip(src.named_children(), dst.children()):
            ids = a.ids()
            mine = ids[partition(ids, 3, 256) == r]
            assert torch.equal(torch.sort(b.ids()).values, torch.sort(mine).values), (r, name)
            assert torch.equal(a.read_rows("adam.v", a.lookup(mine)), b.read_rows("adam.v", b.lookup(mine)))
    assert os.path.isdir(os.path.join(out, "c"))


@pytest.mark.parametrize("lo,hi", [(0, 4096), (1000, 3000), (0, 1), (4095, 4096)])
def test_read_rows_takes_row_runs_and_column_groups_from_the_index(tmp_path, lo, hi):
    """Format version 5: small fixed-size tables' segments are row runs (no directory, no ids) whose split
    slots are column groups. A group read of them takes each run's rows in the range from its index entry,
    reads no directory, and places the groups into rows: the same rows, ids and bytes as each table's own
    read."""
    from helpers.fake_tables import FixedRows
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.format.segment_groups import read_rows
    from recckpt.storage import open_storage
    m = torch.nn.Module()
    for t in range(5):
        m.add_module(f"f{t}", FixedRows(f"f{t}", n=300 + 50 * t, d=12))
    out = str(tmp_path / "o")
    Saver(m, output_dir=out, options=SaveOptions(fsync=False, segment_bytes=8192)).save("c")
    r = CheckpointReader(open_storage(out), "c")
    index = r.index
    assert all(s.is_run for t in index.tables for s in index.tables[t][1])
    jobs = [(f"f{t}", ["embedding", "adagrad.acc"], [48, 48]) for t in range(5)]
    reader = r.segments
    got = read_rows(reader, jobs, lo, hi)
    assert got is not None
    for name, slots, rbs in jobs:
        ids, cols = [], [[] for _ in slots]
        for chunk, parts in reader.iter_table(name, slots, rbs, lo, hi):
            ids.append(chunk.copy())
            for c, p in zip(cols, parts):
                c.append(p.copy())
        t = got[name]
        want_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        assert t.rows == len(want_ids)
        np.testing.assert_array_equal(t.columns[0].view("<i8"), want_ids)
        for k in range(len(slots)):
            want = np.concatenate(cols[k]).reshape(-1) if cols[k] else np.zeros(0, np.uint8)
            np.testing.assert_array_equal(t.columns[1 + k], want)
        if t.rows:   # and those are the table's rows
            tab = getattr(m, name)
            np.testing.assert_array_equal(t.columns[1].view(np.float32).reshape(-1, 12),
                                          tab.cols["embedding"][want_ids].numpy())
