"""Format version 4's "row_range" layout for fixed-size tables (recckpt.state.protocol.FixedSize), with a
small fake fixed-size table: saved as 2 shards under one row split, loaded under another split on 3
processes' layouts, compared exactly, and each load reads about its share of the bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.fake_tables import Holder, RecordsImports
from recckpt import SaveOptions, Saver
from recckpt.errors import CheckpointSaveError
from recckpt.state.protocol import RowRangeLayout, SlotSpec, SparseTableMeta

N, D = 30_000, 16


def full_rows():
    ids = np.arange(N, dtype=np.int64)
    emb = (ids[:, None] * 0.001 + np.arange(D)).astype(np.float32)
    mom = (ids[:, None] % 97 + np.arange(D) * 0.5).astype(np.float32)
    cnt = (ids % 1000).astype(np.int32)
    return ids, {"embedding": emb, "momentum": mom, "count": cnt}


class FakeFixed(RecordsImports, torch.nn.Module):
    """Rows 0..N-1, this process holding `owned` row ranges; global row ids on the protocol."""

    def __init__(self, owned):
        super().__init__()
        self.layout = RowRangeLayout(N, owned)
        self.slots = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
                      "momentum": SlotSpec(torch.float32, (D,), "sparse_opt"),
                      "count": SlotSpec(torch.int32, (), "sparse")}
        self.rows = {}   # id -> {slot: tensor}

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta("fixed", self.slots, self.layout.owned_count)

    def fill(self):
        ids, cols = full_rows()
        mask = np.zeros(N, bool)
        for a, b in self.layout.owned_rows:
            mask[a:b] = True
        self.data = (ids[mask], {k: v[mask] for k, v in cols.items()})

    def export_chunks(self, slots, max_rows):
        ids, cols = self.data
        for s in range(0, len(ids), max_rows):
            yield torch.from_numpy(ids[s:s + max_rows]), {k: torch.from_numpy(cols[k][s:s + max_rows]) for k in slots}


def test_row_range_save_2_load_3_exact_and_bounded(tmp_path):
    opts = SaveOptions(num_buckets=4096, fsync=False, segment_bytes=1 << 20)
    for w, owned in enumerate([((0, N // 2),), ((N // 2, N),)]):
        t = FakeFixed(owned)
        t.fill()
        # both shards saved from this process: the checkpoint commits at the last one
        Saver(Holder(t), output_dir=str(tmp_path), options=opts).save("c", shard_id=w, shard_num=2)
    man = json.load(open(tmp_path / "c" / "manifest.json"))
    assert man["format_version"] == 5
    assert man["tables"]["fixed"]["bucket_fn"] == "row_range" and man["tables"]["fixed"]["num_rows"] == N
    ids_all, cols_all = full_rows()
    row_bytes = 8 + 4 * D + 4 * D + 4
    splits = [((0, 7_000),), ((7_000, 12_000), (20_000, 24_000)), ((12_000, 20_000), (24_000, N))]
    seen = set()
    for r, owned in enumerate(splits):
        t = FakeFixed(owned)
        res = Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=r, shard_num=3)
        want = [i for a, b in owned for i in range(a, b)]
        assert sorted(t.rows) == want
        for i in want[::97] + [want[0], want[-1]]:
            for k in ("embedding", "momentum"):
                np.testing.assert_array_equal(t.rows[i][k].numpy(), cols_all[k][i])
            assert int(t.rows[i]["count"]) == cols_all["count"][i]
        seen |= set(want)
        share = len(want) * row_bytes
        # its rows, plus at most a bucket of rows at each end of each range and the directories of the
        # segments it touches (docs/FORMAT.md: what a loading rank reads)
        assert res.bytes_read <= 1.2 * share + (64 << 10), (r, res.bytes_read, share)
    assert seen == set(range(N))


def test_a_hash_bucketed_checkpoint_still_loads_into_a_fixed_size_table(tmp_path):
    """A fixed-size table's rows saved by a table without the protocol (hash buckets) load too, by
    reading every bucket and keeping the owned rows."""
    from helpers.tables import DictTable
    ids, cols = full_rows()
    src = DictTable("fixed", FakeFixed(()).slots)
    src.set_rows(torch.from_numpy(ids), {k: torch.from_numpy(v) for k, v in cols.items()})
    Saver(Holder(src), output_dir=str(tmp_path), options=SaveOptions(fsync=False)).save("h")
    man = json.load(open(tmp_path / "h" / "manifest.json"))
    assert man["tables"]["fixed"]["bucket_fn"] == "hash"
    t = FakeFixed(((1000, 3000),))
    Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="h")
    assert sorted(t.rows) == list(range(1000, 3000))
    np.testing.assert_array_equal(t.rows[2999]["embedding"].numpy(), cols["embedding"][2999])


class LendingFixed(FakeFixed):
    """FakeFixed whose rows live in one tensor per slot and owned range, lent to loads (`LendsRows`)."""

    def __init__(self, owned, lend=True):
        super().__init__(owned)
        self.lend = lend
        self.store = [(a, {k: torch.full((b - a, *s.shape), -1, dtype=s.dtype) for k, s in self.slots.items()})
                      for a, b in self.layout.owned_rows]
        self.loaded = []   # (row0, rows) the loader reported
        self.imported = 0

    def row_views(self, slots):
        return [(a, {k: cols[k] for k in slots}) for a, cols in self.store] if self.lend else None

    def rows_loaded(self, row0, rows):
        self.loaded.append((row0, rows))

    def import_rows(self, ids, columns):
        self.imported += int(ids.shape[0])
        for a, cols in self.store:
            n = next(cols.values().__iter__()).shape[0]
            sel = (ids >= a) & (ids < a + n)
            for k, v in columns.items():
                cols[k][ids[sel] - a] = v[sel]

    def check_against(self, cols_all):
        for a, cols in self.store:
            n = cols["embedding"].shape[0]
            for k, v in cols.items():
                np.testing.assert_array_equal(v.numpy(), cols_all[k][a:a + n], err_msg=f"slot {k} rows {a}+{n}")


def _save_two_shards(tmp_path):
    opts = SaveOptions(num_buckets=4096, fsync=False, segment_bytes=1 << 20)
    for w, owned in enumerate([((0, N // 2),), ((N // 2, N),)]):
        t = FakeFixed(owned)
        t.fill()
        Saver(Holder(t), output_dir=str(tmp_path), options=opts).save("c", shard_id=w, shard_num=2)


def test_rows_are_read_straight_into_lent_storage_2_to_3(tmp_path):
    """A table that lends its storage (LendsRows) gets its rows read into it: exact, no import_rows, every
    owned row reported once through rows_loaded, and each rank reads about its share."""
    _save_two_shards(tmp_path)
    _, cols_all = full_rows()
    row_bytes = 8 + 4 * D + 4 * D + 4
    splits = [((0, 7_000),), ((7_000, 12_000), (20_000, 24_000)), ((12_000, 20_000), (24_000, N))]
    for r, owned in enumerate(splits):
        t = LendingFixed(owned)
        res = Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=r, shard_num=3)
        t.check_against(cols_all)
        assert t.imported == 0, "the direct path wrote every row"
        got = np.zeros(N, np.int64)
        for a, n in t.loaded:
            got[a:a + n] += 1
        want = np.zeros(N, np.int64)
        for a, b in owned:
            want[a:b] = 1
        np.testing.assert_array_equal(got, want)
        assert res.sparse_rows == sum(b - a for a, b in owned)
        share = sum(b - a for a, b in owned) * row_bytes
        assert res.bytes_read <= 1.2 * share + (64 << 10), (r, res.bytes_read, share)


def test_lent_storage_falls_back_to_import_rows_when_ids_are_not_runs(tmp_path):
    """Hash buckets scatter a row range: the loader sees ids that are not runs and imports them instead,
    exactly; a table that declines to lend (row_views None) is imported the same way."""
    from helpers.tables import DictTable
    ids, cols = full_rows()
    src = DictTable("fixed", FakeFixed(()).slots)
    src.set_rows(torch.from_numpy(ids), {k: torch.from_numpy(v) for k, v in cols.items()})
    Saver(Holder(src), output_dir=str(tmp_path / "h"), options=SaveOptions(fsync=False)).save("h")
    t = LendingFixed(((1000, 3000), (5000, 5100)))
    Saver(Holder(t), output_dir=str(tmp_path / "h")).load(ckpt_id="h")
    t.check_against(cols)
    assert t.imported == 2100 and t.loaded == []
    _save_two_shards(tmp_path / "r")
    t = LendingFixed(((100, 20_000),), lend=False)
    Saver(Holder(t), output_dir=str(tmp_path / "r")).load(ckpt_id="c")
    t.check_against(cols)
    assert t.imported == 19_900 and t.loaded == []


class NamedLending(LendingFixed):
    def __init__(self, name, owned, lend=True):
        super().__init__(owned, lend)
        self.name = name

    def sparse_meta(self):
        return SparseTableMeta(self.name, self.slots, self.layout.owned_count)


class Tables(torch.nn.Module):
    def __init__(self, tables):
        super().__init__()
        self.tabs = torch.nn.ModuleList(tables)


def _save_tables(tmp_path, names):
    opts = SaveOptions(num_buckets=4096, fsync=False, segment_bytes=1 << 20)
    for w, owned in enumerate([((0, N // 2),), ((N // 2, N),)]):
        tabs = [NamedLending(n, owned) for n in names]
        for t in tabs:
            t.fill()
        Saver(Tables(tabs), output_dir=str(tmp_path), options=opts).save("c", shard_id=w, shard_num=2)


@pytest.mark.parametrize("plain", ["a_plain", "t1plain"])   # lends no storage: first in the run, or inside it
def test_fixed_tables_lending_storage_are_read_together(tmp_path, monkeypatch, plain):
    """The fixed-size tables of a model that lend their storage are read in one engine call per kind of
    request (so a cold load goes through each shard file once): exact, every owned row reported once, and
    a table that lends nothing still loads through import_rows."""
    from recckpt.format import sparse_io
    names = ["t0", "t1", plain, "t2"]
    _save_tables(tmp_path, names)
    _, cols_all = full_rows()
    calls, together = [], []
    real, real_together = sparse_io._C.read_ranges, sparse_io.SegmentReader.read_together

    def counted(reqs, *a, **kw):
        if any("shard-" in r[0] for r in reqs):
            calls.append(len(reqs))
        return real(reqs, *a, **kw)

    def spied(self, jobs):
        together.append(sorted({t for t, _, _ in jobs}))
        return real_together(self, jobs)
    monkeypatch.setattr(sparse_io._C, "read_ranges", counted)
    monkeypatch.setattr(sparse_io.SegmentReader, "read_together", spied)
    owned = ((7_000, 12_000), (20_000, 24_000))
    tabs = [NamedLending(n, owned, lend=(n != plain)) for n in names]
    res = Saver(Tables(tabs), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=1, shard_num=3)
    rows = sum(b - a for a, b in owned)
    assert res.sparse_rows == 4 * rows and res.tables == sorted(names)
    want = np.zeros(N, np.int64)
    for a, b in owned:
        want[a:b] = 1
    for t in tabs:
        t.check_against(cols_all)
        if t.lend:
            assert t.imported == 0
            got = np.zeros(N, np.int64)
            for a, n in t.loaded:
                got[a:a + n] += 1
            np.testing.assert_array_equal(got, want)
        else:
            assert t.imported == rows and t.loaded == []
    # the lending tables' rows in one engine call; "plain" reads its own (its ids and rows, one call)
    assert together == [["t0", "t1", "t2"]]
    # (plain reads: 3 tables x 2 owned ranges x the ungrouped slots; the grouped ones go to read_strided)
    assert len(calls) == 3 and calls[0] >= 3 * 2 * 2 and calls[1:] == [2, 2], calls


@pytest.mark.parametrize("plain,at,left", [
    ("t1plain", "t0", "which is partially loaded, as may be 't1', 't2', read with it"),
    ("a_plain", "a_plain", "which is not yet written; 't0', 't1', 't2', read ahead of it together, may be partly "
                           "written")])
def test_a_failed_read_of_tables_read_together_says_what_may_be_partly_loaded(tmp_path, plain, at, left):
    """A corrupt chunk of the last table read with others fails the load naming that table and file, and
    the error says which tables were read together and may be partly written."""
    from recckpt.errors import CorruptCheckpointError
    names = ["t0", "t1", plain, "t2"]
    _save_tables(tmp_path, names)
    idx = json.load(open(tmp_path / "c" / "sparse" / "worker-00000.index.json"))
    seg = idx["tables"]["t2"]["segments"]
    f = idx["files"][seg["file"][0]]["path"]
    with open(tmp_path / "c" / f, "r+b") as fh:   # a byte inside t2's first segment's rows
        fh.seek(seg["offset"][0] + 5000)
        b = fh.read(1)
        fh.seek(seg["offset"][0] + 5000)
        fh.write(bytes([b[0] ^ 0xFF]))
    tabs = [NamedLending(n, ((0, N // 2),), lend=(n != plain)) for n in names]
    with pytest.raises(CorruptCheckpointError) as ei:
        Saver(Tables(tabs), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=0, shard_num=2)
    msg = str(ei.value)
    assert "table 't2'" in msg and f in msg, msg
    assert f"Loading stopped in table {at!r}, {left}" in msg, msg


def test_a_table_failing_while_its_run_is_planned_fails_with_its_own_name(tmp_path):
    """A table whose stored ids are corrupt (in a checkpoint written with hash buckets) fails the load
    naming it (message and `table`), before any table is touched."""
    from helpers.tables import DictTable
    from recckpt.errors import CorruptCheckpointError
    names = ["t0", "t1", "t2"]
    ids, cols = full_rows()
    srcs = []
    for n in names:
        src = DictTable(n, FakeFixed(()).slots)
        src.set_rows(torch.from_numpy(ids), {k: torch.from_numpy(v) for k, v in cols.items()})
        srcs.append(src)
    Saver(Tables(srcs), output_dir=str(tmp_path), options=SaveOptions(fsync=False)).save("h")
    idx = json.load(open(tmp_path / "h" / "sparse" / "worker-00000.index.json"))
    seg = idx["tables"]["t1"]["segments"]
    f = idx["files"][seg["file"][0]]["path"]
    at = seg["offset"][0] + 8 * seg["dir"][0] + 16   # inside the first segment's ids
    with open(tmp_path / "h" / f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    tabs = [NamedLending(n, ((1000, 3000),)) for n in names]
    with pytest.raises(CorruptCheckpointError) as ei:
        Saver(Tables(tabs), output_dir=str(tmp_path)).load(ckpt_id="h")
    msg = str(ei.value)
    assert ei.value.table == "t1", (ei.value.table, msg)
    # hash-bucketed ids into a fixed-size table are checked (as row indices) before anything is applied, so
    # the corrupt chunk is found then: no table was touched (before, t0 had been loaded when t1 failed)
    assert "table 't1'" in msg and "CRC mismatch" in msg, msg
    assert all(t.loaded == [] and t.imported == 0 for t in tabs), [(t.loaded, t.imported) for t in tabs]
    assert all((t.store[0][1]["embedding"] == -1).all() for t in tabs), "a table was written"


@pytest.mark.parametrize("case", ["out_of_range", "negative", "repeated_row", "merge_out_of_range"])
def test_a_hash_table_with_ids_that_are_not_rows_is_refused_before_anything_is_applied(tmp_path, case):
    """A HashTable-style checkpoint (hash buckets) warm-starting a fixed-size table: its ids are row
    indices there. One id past the end (or negative, or the right count with a row repeated and one
    missing) was found while applying: the load stopped with the table half written. Now refused first,
    naming the id, and the table is left as it was."""
    from helpers.tables import DictTable
    from recckpt.errors import IncompatibleCheckpointError
    ids, cols = full_rows()
    ids = ids.copy()
    if case in ("out_of_range", "merge_out_of_range"):
        ids[-1] = N + 1000
    elif case == "negative":
        ids[-1] = -5
    else:
        ids[-1] = 7   # N ids, 7 twice, N-1 missing (a different table's duplicates: see test_dist)
    src = DictTable("fixed", FakeFixed(()).slots)
    if case == "repeated_row":   # a DictTable keeps one row per id: write the repeat on a second worker
        keep = np.arange(N - 1)
        src.set_rows(torch.from_numpy(ids[keep]), {k: torch.from_numpy(v[keep]) for k, v in cols.items()})
        other = DictTable("fixed", FakeFixed(()).slots)
        other.set_rows(torch.tensor([7]), {k: torch.from_numpy(v[-1:]) for k, v in cols.items()})
        for w, t in enumerate((src, other)):
            Saver(Holder(t), output_dir=str(tmp_path), options=SaveOptions(fsync=False)).save("h", shard_id=w,
                                                                                               shard_num=2)
    else:
        src.set_rows(torch.from_numpy(ids), {k: torch.from_numpy(v) for k, v in cols.items()})
        Saver(Holder(src), output_dir=str(tmp_path), options=SaveOptions(fsync=False)).save("h")
    t = FakeFixed(((0, N),))
    conf = {"merge": True} if case.startswith("merge") else None
    want = {"out_of_range": f"id {N + 1000} ", "merge_out_of_range": f"id {N + 1000} ", "negative": "id -5 ",
            "repeated_row": "do not cover rows"}[case]
    with pytest.raises(IncompatibleCheckpointError, match=want):
        Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="h", load_conf=conf)
    assert t.rows == {}   # nothing applied


class SmallFixed(RecordsImports, torch.nn.Module):
    """Rows 0..n-1 of one 4-wide embedding slot, all held by this process (what a HashTable chain fills)."""

    def __init__(self, n):
        super().__init__()
        self.layout = RowRangeLayout(n, ((0, n),))
        self.slots = {"embedding": SlotSpec(torch.float32, (4,), "sparse")}
        self.rows = {}

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta("emb", self.slots, self.layout.num_rows)

    def export_chunks(self, slots, max_rows):
        return iter(())


class Pair(torch.nn.Module):
    def __init__(self, other, fixed):
        super().__init__()
        self.other, self.fixed = other, fixed


@pytest.mark.parametrize("case", ["row_removed", "row_past_the_end", "merge_past_the_end", "exact"])
def test_a_hash_table_chain_into_a_fixed_size_table_is_checked_as_folded(tmp_path, case):
    """A HashTable's chain of increments warm-starting a fixed-size table: its folded ids are row indices
    there, checked before anything is applied, as a full checkpoint's are. Before, only the chain's base
    was counted: an increment that removed row 0 left that row holding its old values (the same rows
    compacted into one checkpoint were refused), and one that added a row past the end stopped the load
    with table 'other' already replaced."""
    from recckpt import HashTable
    from recckpt.errors import IncompatibleCheckpointError
    n = 50
    src = Pair(HashTable("other", dim=4), HashTable("emb", dim=4))
    src.other(torch.tensor([7]))
    src.fixed(torch.arange(n - 1 if case == "exact" else n))
    s = Saver(src, output_dir=str(tmp_path), max_keep=None, options=SaveOptions(fsync=False))
    s.save("base")
    src.other(torch.tensor([1, 2]))
    if case == "row_removed":
        src.fixed.remove_ids(torch.tensor([0]))
    else:
        src.fixed(torch.tensor([n - 1 if case == "exact" else n]))   # exact: the chain completes the rows
    s.save("inc", incremental=True)
    other, fixed = HashTable("other", dim=4), SmallFixed(n)
    other(torch.tensor([99]))
    dst = Saver(Pair(other, fixed), output_dir=str(tmp_path))
    conf = {"merge": True} if case.startswith("merge") else None
    if case == "exact":
        dst.load(ckpt_id="inc", load_conf=conf)
        ids = src.fixed.ids()
        assert sorted(fixed.rows) == list(range(n))
        want = src.fixed.read_rows("embedding", src.fixed.lookup(ids))
        assert all(torch.equal(fixed.rows[int(i)]["embedding"], w) for i, w in zip(ids, want))
        return
    want = {"row_removed": r"do not cover rows 0\.\.49 .*1 rows have none; the checkpoint holds 49 rows",
            "row_past_the_end": f"id {n} ", "merge_past_the_end": f"id {n} "}[case]
    with pytest.raises(IncompatibleCheckpointError, match=want):
        dst.load(ckpt_id="inc", load_conf=conf)
    assert fixed.rows == {} and other.ids().tolist() == [99]   # nothing applied


def test_workers_writing_the_same_rows_commit_nothing(tmp_path):
    """Each worker's index is valid alone; two workers that hold overlapping row ranges (processes built
    with different sharding plans) would commit a checkpoint every reader refuses. The commit refuses it,
    naming the table, the workers and the rows, and the checkpoint before it stays the newest."""
    opts = SaveOptions(num_buckets=64, fsync=False, segment_bytes=1 << 16)
    for ckpt, splits in (("good", [((0, N // 2),), ((N // 2, N),)]), ("bad", [((0, N // 2),), ((N // 4, N),)])):
        for w, owned in enumerate(splits):
            t = FakeFixed(owned)
            t.fill()
            saver = Saver(Holder(t), output_dir=str(tmp_path), options=opts)
            if ckpt == "bad" and w == 1:
                with pytest.raises(CheckpointSaveError) as e:
                    saver.save(ckpt, shard_id=w, shard_num=2)
            else:
                saver.save(ckpt, shard_id=w, shard_num=2)
    msg = str(e.value)
    assert "table 'fixed'" in msg and "workers 0 and 1 both wrote rows" in msg and "same sharding plan" in msg, msg
    assert e.value.table == "fixed"
    assert Saver(Holder(FakeFixed(((0, N),))), output_dir=str(tmp_path)).latest_checkpoint() == "good"
    assert not (tmp_path / "bad").exists()
