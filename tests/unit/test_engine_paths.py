"""Correctness of every optimized save/load path: chunk and segment boundaries, thread counts 1..N,
tables smaller than one checksum chunk, empty tables, the direct (read-into-table) load path against
the general one, IdMap.insert_new, HashTable.append_views/commit_append, and a benchmark smoke run."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from helpers.tables import DictTable, assert_tables_equal, table_contents
from recckpt import _C, HashTable, ReadOptions, SaveOptions, Saver
from recckpt.errors import CorruptCheckpointError
from recckpt.format.checkpoint import CheckpointReader
from recckpt.state.protocol import BulkAppend, SlotSpec
from recckpt.storage import open_storage


class Holder(torch.nn.Module):
    def __init__(self, *tables):
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)


def filled(name, n, dim=3, seed=0, dtype=torch.float32, extra_slot=True):
    g = torch.Generator().manual_seed(seed)
    t = HashTable(name, dim=dim, dtype=dtype)
    if extra_slot:
        t.add_slot("acc", torch.float32, (dim,), init=0.5)
        t.add_slot("count", torch.int32, (), init=0, category="sparse")
    if n:
        ids = torch.unique(torch.randint(-(2 ** 63), 2 ** 63 - 1, (n * 2,), generator=g, dtype=torch.int64))
        ids = ids[torch.randperm(ids.numel(), generator=g)][:n]
        cols = {"embedding": torch.randn(n, dim, generator=g).to(dtype)}
        if extra_slot:
            cols["acc"] = torch.rand(n, dim, generator=g)
            cols["count"] = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
        t.import_rows(ids, cols)
    return t


def empty_like(t: HashTable, dtype=None):
    out = HashTable(t.name, dim=t.dim, dtype=dtype or t.dtype)
    for s in t.slot_names[1:]:
        spec = t.slot_spec(s)
        out.add_slot(s, spec.dtype, spec.shape, init=7, category=spec.category)
    return out


def roundtrip(tmp_path, tables, opts, concurrency, load_tables=None, load_conf=None, shard=(0, 1),
              read_options=None):
    src = Holder(*tables)
    Saver(src, output_dir=str(tmp_path), concurrency=concurrency, options=opts).save("c")
    dst = Holder(*(load_tables or [empty_like(t) for t in tables]))
    Saver(dst, output_dir=str(tmp_path), concurrency=concurrency, read_options=read_options).load(
        load_conf=load_conf, shard_id=shard[0], shard_num=shard[1])
    return src, dst


# ------------------------------------------------------------------ boundaries x thread counts
# Row bytes: embedding 12, acc 12, count 4, ids 8. chunk_bytes 64 does not divide 12 (rows straddle
# checksum chunks); 96 divides both 12 and 8*12; segment_bytes picks 1 row, ~5 rows, exactly 8 rows.
@pytest.mark.parametrize("concurrency", [1, 2, 3, 5])
@pytest.mark.parametrize("chunk_bytes,segment_bytes", [(64, 36), (64, 190), (96, 288), (1 << 20, 64 << 20)])
@pytest.mark.parametrize("n", [0, 1, 5, 8, 9, 257])
def test_roundtrip_boundaries_and_threads(tmp_path, concurrency, chunk_bytes, segment_bytes, n):
    opts = SaveOptions(num_buckets=8, chunk_bytes=chunk_bytes, segment_bytes=segment_bytes, fsync=False)
    t = filled("t", n, seed=n)
    src, dst = roundtrip(tmp_path, [t], opts, concurrency)
    assert len(dst.tables[0]) == n
    assert_tables_equal(src.tables[0], dst.tables[0])


def test_table_smaller_than_one_chunk_and_empty_table_together(tmp_path):
    opts = SaveOptions(num_buckets=4, chunk_bytes=1 << 20, fsync=False)
    small, empty = filled("small", 3), filled("empty", 0)
    src, dst = roundtrip(tmp_path, [small, empty], opts, 4)
    assert len(dst.tables[0]) == 3 and len(dst.tables[1]) == 0
    assert_tables_equal(src.tables[0], dst.tables[0])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_bucket_ranges_through_direct_path(tmp_path, world, concurrency):
    """Resharded loads read partial, chunk-unaligned ranges straight into each table; the union of
    the workers' tables is the original."""
    opts = SaveOptions(num_buckets=16, chunk_bytes=64, segment_bytes=400, fsync=False)
    t = filled("t", 300, seed=3)
    Saver(Holder(t), output_dir=str(tmp_path), concurrency=concurrency, options=opts).save("c")
    seen = {}
    for r in range(world):
        d = Holder(empty_like(t))
        Saver(d, output_dir=str(tmp_path), concurrency=concurrency).load(shard_id=r, shard_num=world)
        part = table_contents(d.tables[0])
        assert not set(part["embedding"]) & set(seen), "a row was loaded by two workers"
        seen.update(part["embedding"])
        b = _C.bucket_of(d.tables[0].ids().numpy(), 16)
        lo, hi = r * 16 // world, (r + 1) * 16 // world
        assert ((b >= lo) & (b < hi)).all()
    full = table_contents(t)["embedding"]
    assert set(seen) == set(full)
    for k, v in full.items():
        assert torch.equal(seen[k], v)


# ------------------------------------------------------------------ direct path vs general path
class Counting:
    def __init__(self, monkeypatch):
        self.calls = 0
        orig = HashTable.append_views

        def wrapped(table, n, slots):
            self.calls += n > 0  # n == 0: the loader asking where the table's views live
            return orig(table, n, slots)

        monkeypatch.setattr(HashTable, "append_views", wrapped)


@pytest.mark.parametrize("batch_bytes", [1, 700, 64 << 20])
def test_replace_load_uses_direct_path_and_matches(tmp_path, monkeypatch, batch_bytes):
    """A table lending host memory is read in one append whatever batch_bytes says (no staging buffer
    for it to bound); the planner still cuts batches of batch_bytes for tables staged to a device: one
    per segment, a few segments per batch, everything in one batch."""
    c = Counting(monkeypatch)
    opts = SaveOptions(num_buckets=8, chunk_bytes=64, segment_bytes=300, fsync=False)
    src, dst = roundtrip(tmp_path, [filled("t", 100)], opts, 2, read_options=ReadOptions(batch_bytes=batch_bytes))
    assert c.calls == 1
    assert len(dst.tables[0]) == 100
    assert_tables_equal(src.tables[0], dst.tables[0])
    reader = CheckpointReader(open_storage(str(tmp_path)), "c", read_options=ReadOptions(batch_bytes=batch_bytes))
    slots = ["embedding", "acc", "count"]
    planned = [b.rows for b in reader.segments.batches("t", slots, [12, 12, 4])]
    segments = -(-100 // (300 // 36))  # rows per segment = segment_bytes // (8 + 12 + 12 + 4)
    assert sum(planned) == 100
    if batch_bytes == 1:
        assert len(planned) == segments
    elif batch_bytes == 700:
        assert 1 < len(planned) < segments
    else:
        assert len(planned) == 1
    assert [b.rows for b in reader.segments.batches("t", slots, [12, 12, 4], batch_bytes=math.inf)] == [100]


def test_direct_path_initialises_slots_not_loaded(tmp_path, monkeypatch):
    c = Counting(monkeypatch)
    opts = SaveOptions(num_buckets=8, fsync=False)
    t = filled("t", 50)
    dst_t = empty_like(t)
    dst_t.import_rows(torch.tensor([1, 2], dtype=torch.int64), {"acc": torch.full((2, 3), 9.0)})
    src, dst = roundtrip(tmp_path, [t], opts, 2, load_tables=[dst_t],
                         load_conf={"exclude": ["sparse_opt"]})
    assert c.calls >= 1
    got = dst.tables[0]
    assert len(got) == 50 and bool((got.lookup(torch.tensor([1, 2])) < 0).all())
    assert torch.equal(got.slot("acc"), torch.full((50, 3), 7.0))  # the slot's init, not the old rows
    assert_tables_equal(t, got, slots=["embedding", "count"])


def test_cast_and_merge_take_general_path(tmp_path, monkeypatch):
    c = Counting(monkeypatch)
    opts = SaveOptions(num_buckets=8, fsync=False)
    t = filled("t", 40)
    # cast: float32 checkpoint into a bfloat16 table
    src, dst = roundtrip(tmp_path / "a", [t], opts, 2, load_tables=[empty_like(t, torch.bfloat16)])
    assert c.calls == 0
    assert torch.equal(table_contents(dst.tables[0])["embedding"][int(t.ids()[0])],
                       t.slot("embedding")[0].to(torch.bfloat16))
    # merge: existing rows stay
    keep = empty_like(t)
    keep.import_rows(torch.tensor([5], dtype=torch.int64), {"embedding": torch.ones(1, 3)})
    src, dst = roundtrip(tmp_path / "b", [t], opts, 2, load_tables=[keep], load_conf={"merge": True})
    assert c.calls == 0
    assert len(dst.tables[0]) == 41


def test_table_without_bulk_append_still_loads(tmp_path):
    spec = {"embedding": SlotSpec(torch.float32, (4,), "sparse")}
    a = DictTable("d", spec)
    a.set_rows(torch.arange(100, dtype=torch.int64) * 7919, {"embedding": torch.randn(100, 4)})
    assert not isinstance(a, BulkAppend)
    Saver(Holder(a), output_dir=str(tmp_path), concurrency=2,
          options=SaveOptions(num_buckets=4, chunk_bytes=64, segment_bytes=256, fsync=False)).save("c")
    b = DictTable("d", spec)
    Saver(Holder(b), output_dir=str(tmp_path)).load()
    assert_tables_equal(a, b)


def test_corrupt_byte_on_direct_path_names_table(tmp_path):
    opts = SaveOptions(num_buckets=4, chunk_bytes=64, segment_bytes=1 << 20, fsync=False)
    t = filled("t", 200)
    Saver(Holder(t), output_dir=str(tmp_path), options=opts).save("c")
    shard = next(p for p in (tmp_path / "c" / "sparse").iterdir() if p.suffix == ".bin")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last slot column
    shard.write_bytes(bytes(data))
    d = Holder(empty_like(t))
    with pytest.raises(CorruptCheckpointError, match=r"table 't'.*left empty") as ei:
        Saver(d, output_dir=str(tmp_path)).load()
    assert ei.value.table == "t" and ei.value.path.endswith(shard.name)


def test_corrupt_last_segment_leaves_host_table_empty(tmp_path):
    """A table lending host memory commits its rows after the whole table was read and checked: a bad
    byte in its last segment leaves it empty (not holding the segments before it), and the error says so."""
    opts = SaveOptions(num_buckets=4, chunk_bytes=64, segment_bytes=300, fsync=False)
    t = filled("t", 100)
    Saver(Holder(t), output_dir=str(tmp_path), options=opts).save("c")
    shard = next(p for p in (tmp_path / "c" / "sparse").iterdir() if p.suffix == ".bin")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last slot column of the file's last segment
    shard.write_bytes(bytes(data))
    dst = empty_like(t)
    dst.import_rows(torch.tensor([7], dtype=torch.int64), {"embedding": torch.ones(1, 3)})
    with pytest.raises(CorruptCheckpointError, match=r"table 't', which is left empty") as ei:
        Saver(Holder(dst), output_dir=str(tmp_path), read_options=ReadOptions(batch_bytes=1)).load()
    assert ei.value.table == "t" and len(dst) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["direct-path", "general-path-cast"])
def test_repeated_id_in_checkpoint_is_reported_on_every_path(tmp_path, dtype):
    """Two segments holding the same id (a writer bug) are reported, not silently merged, with the same
    error whether rows go straight into the table (direct) or through import_rows (a cast forces that).
    One worker wrote both, so it is damage (restore() takes an older checkpoint), not the duplicates
    between workers that LoadConfig.duplicates resolves."""
    t = filled("t", 10, extra_slot=False)
    ids, cols = t.ids(), {"embedding": t.slot("embedding").clone()}

    class Twice(HashTable):
        def export_chunks(self, slots, max_rows):
            yield ids, {"embedding": cols["embedding"]}
            yield ids[:1].clone(), {"embedding": cols["embedding"][:1].clone()}

        def sparse_meta(self):
            m = super().sparse_meta()
            return type(m)(m.name, m.slots, 11)

    bad = Twice("t", dim=3)
    Saver(Holder(bad), output_dir=str(tmp_path), options=SaveOptions(num_buckets=4, fsync=False)).save("c")
    with pytest.raises(CorruptCheckpointError, match=r"table 't'.*(repeated|twice).*damaged") as ei:
        Saver(Holder(HashTable("t", dim=3, dtype=dtype)), output_dir=str(tmp_path)).load()
    assert ei.value.table == "t"


def test_a_table_refusing_rows_for_its_own_reason_is_not_called_a_damaged_checkpoint(tmp_path):
    """commit_append raising ValueError without a repeated id (a custom table's capacity): every such
    refusal was reported as an id stored twice, and on a one-worker checkpoint as damage, so restore()
    skipped intact checkpoints for older ones. It is the table's refusal, said as such."""
    from recckpt import CheckpointManager
    from recckpt.errors import LoadApplyError

    class Capped(HashTable):
        limit = None

        def commit_append(self):
            pending = getattr(self, "_append", None)
            if self.limit is not None and pending and len(self) + pending[0] > self.limit:
                self._append = None
                raise ValueError(f"table {self.name!r} is full: {self.limit} rows at most")
            return super().commit_append()

    src = Holder(Capped("t", dim=4))
    mgr = CheckpointManager(Saver(src, output_dir=str(tmp_path), max_keep=None), save_interval=1)
    for step in range(2):
        src.tables[0](torch.arange(step * 40, step * 40 + 40))
        mgr.step()
    dst = Holder(Capped("t", dim=4))
    dst.tables[0].limit = 60
    mgr2 = CheckpointManager(Saver(dst, output_dir=str(tmp_path)), save_interval=1)
    with pytest.raises(LoadApplyError, match=r"table 't' is full: 60 rows at most") as ei:
        mgr2.restore()
    assert "damaged" not in str(ei.value) and "more than once" not in str(ei.value)
    assert mgr2.restore_skipped == []


# ------------------------------------------------------------------ HashTable bulk append
def test_append_views_commit_and_errors():
    t = HashTable("t", dim=2)
    t.add_slot("acc", torch.float32, (2,), init=0.25)
    t.import_rows(torch.tensor([10], dtype=torch.int64), {"embedding": torch.zeros(1, 2)})
    ids, cols = t.append_views(3, ["embedding"])
    assert len(t) == 1 and ids.shape == (3,) and cols["embedding"].shape == (3, 2)
    ids.copy_(torch.tensor([1, 2, 3]))
    cols["embedding"].copy_(torch.arange(6.0).reshape(3, 2))
    assert int(t.lookup(torch.tensor([2]))) == -1  # not visible before the commit
    t.commit_append()
    assert len(t) == 4
    rows = t.lookup(torch.tensor([1, 2, 3]))
    assert torch.equal(t.read_rows("embedding", rows), torch.arange(6.0).reshape(3, 2))
    assert torch.equal(t.read_rows("acc", rows), torch.full((3, 2), 0.25))
    # an id already present: nothing appended, table intact
    ids, cols = t.append_views(2, ["embedding"])
    ids.copy_(torch.tensor([99, 10]))
    cols["embedding"].zero_()
    with pytest.raises(ValueError, match="id 10 .*already in the table or repeated"):
        t.commit_append()
    assert len(t) == 4 and int(t.lookup(torch.tensor([99]))) == -1 and int(t.lookup(torch.tensor([3]))) == 3
    # repeated within the batch
    ids, _ = t.append_views(2, [])
    ids.copy_(torch.tensor([50, 50]))
    with pytest.raises(ValueError, match="id 50"):
        t.commit_append()
    assert len(t) == 4
    with pytest.raises(RuntimeError, match="without a matching append_views"):
        t.commit_append()
    # a modification between append_views and commit_append invalidates the append
    t.append_views(1, [])
    t.clear_rows()
    with pytest.raises(RuntimeError):
        t.commit_append()
    with pytest.raises(ValueError, match="no slot"):
        t.append_views(1, ["nope"])


def test_append_views_grows_storage():
    t = HashTable("t", dim=1)
    total = 0
    for k in range(5):
        n = 100 * (k + 1)
        ids, cols = t.append_views(n, ["embedding"])
        ids.copy_(torch.arange(total, total + n))
        cols["embedding"].copy_(torch.arange(total, total + n, dtype=torch.float32).reshape(n, 1))
        t.commit_append()
        total += n
    assert len(t) == total
    rows = t.lookup(torch.arange(total))
    assert torch.equal(t.read_rows("embedding", rows).reshape(-1), torch.arange(total, dtype=torch.float32))


# ------------------------------------------------------------------ IdMap.insert_new
def test_idmap_insert_new():
    m = _C.IdMap(0)
    ids = np.array([5, -(2 ** 63), 2 ** 63 - 1, 0, -1], dtype=np.int64)
    assert m.insert_new(ids) == 5
    assert np.array_equal(m.keys(), ids)
    assert np.array_equal(m.lookup(ids), np.arange(5))
    assert m.insert_new(np.array([7, 8, 0, 9], dtype=np.int64)) == 2  # 0 present: stops there
    assert np.array_equal(m.keys(), np.concatenate([ids, [7, 8]]))
    assert m.insert_new(np.array([11, 11], dtype=np.int64)) == 1
    assert m.insert_new(np.array([], dtype=np.int64)) == 0
    big = np.arange(100_000, dtype=np.int64) * 1_000_003 + 12345
    m2 = _C.IdMap(0)
    assert m2.insert_new(big) == big.size
    assert np.array_equal(m2.lookup(big), np.arange(big.size))
    with pytest.raises(TypeError):
        m2.insert_new(np.zeros(3, dtype=np.int32))


# ------------------------------------------------------------------ slow stress
@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 2, 4, 7])
def test_stress_many_segments(tmp_path, concurrency):
    opts = SaveOptions(num_buckets=64, chunk_bytes=4096 + 12, segment_bytes=(1 << 20) + 7, fsync=False)
    t = filled("t", 300_000, dim=16, seed=concurrency)
    src, dst = roundtrip(tmp_path, [t], opts, concurrency)
    assert_tables_equal(src.tables[0], dst.tables[0])


# ------------------------------------------------------------------ benchmark smoke run
def test_compare_benchmark_smoke(tmp_path):
    """The benchmark runs every method end to end on a tiny state and reports every number (all in this
    process), and two of them in fresh processes as it does by default."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    try:
        import compare
    finally:
        sys.path.pop(0)
    out = tmp_path / "r.json"
    res = compare.main(["--ids", "3000", "--dim", "8", "--dense-mb", "4", "--repeat", "1", "--threads", "2",
                        "--dir", str(tmp_path / "scratch"), "--json", str(out), "--in-process"])
    saved = json.loads(out.read_text())
    assert set(saved["methods"]) == set(compare.ALL_METHODS)
    for m, r in saved["methods"].items():
        assert r["save_s"] > 0 and r["load_s"] > 0 and r["load_warm_s"] > 0, m
        assert r["bytes_written"] >= res["state_bytes"] * 0.99, m
    assert set(saved["targets"]) == {"save_vs_best_peer", "load_cold_vs_best_peer", "load_warm_vs_best_peer",
                                     "mmap_load_warm_vs_best_peer", "save_vs_parallel_raw",
                                     "load_cold_vs_parallel_pread", "load_warm_vs_fresh_memory_floor",
                                     "save_peak_extra_bytes"}
    assert saved["targets"]["load_warm_vs_fresh_memory_floor"]["value"] == pytest.approx(
        saved["methods"]["recckpt"]["load_warm_s"] / saved["fresh_memory_floor_s"])
    best_warm = min(saved["methods"][p]["load_warm_s"] for p in ("torch", "torch-mmap", "safetensors", "dcp"))
    assert saved["targets"]["mmap_load_warm_vs_best_peer"]["value"] == pytest.approx(
        best_warm / saved["methods"]["recckpt-mmap"]["load_warm_s"])
    assert saved["fresh_memory_floor_s"] > 0 and len(saved["fresh_memory_floor_s_all"]) == 1
    assert saved["ratios"]["recckpt"]["torch"]["load_warm"] == pytest.approx(
        saved["methods"]["torch"]["load_warm_s"] / saved["methods"]["recckpt"]["load_warm_s"])
    assert saved["ratios"]["recckpt"]["raw"]["save"] == pytest.approx(
        saved["methods"]["raw"]["save_s"] / saved["methods"]["recckpt"]["save_s"])
    # CPU seconds of every phase, and their ratios, for comparisons on a machine shared with other jobs
    for m, r in saved["methods"].items():
        assert all(r[f"{k}_cpu_s"] > 0 for k in ("save", "load", "load_warm")), m
    assert saved["cpu_ratios"]["recckpt"]["torch"]["load_warm"] == pytest.approx(
        saved["methods"]["torch"]["load_warm_cpu_s"] / saved["methods"]["recckpt"]["load_warm_cpu_s"])
    assert saved["fresh_memory_floor_cpu_s"] > 0 and len(saved["fresh_memory_floor_cpu_s_all"]) == 1
    # The default runs each method in a fresh process (CI pays that start-up for two methods, not seven)
    fresh = tmp_path / "fresh.json"
    compare.main(["--ids", "3000", "--dim", "8", "--dense-mb", "4", "--repeat", "1", "--threads", "2",
                  "--methods", "recckpt,raw", "--dir", str(tmp_path / "scratch2"), "--json", str(fresh)])
    got = json.loads(fresh.read_text())["methods"]
    assert set(got) == {"recckpt", "raw"} and all(r["load_warm_s"] > 0 and r["save_cpu_s"] > 0 for r in got.values())
    # --warm-alone: each warm load in a process of its own, from the files (and fingerprint) the first left
    alone = tmp_path / "alone.json"
    compare.main(["--ids", "3000", "--dim", "8", "--dense-mb", "4", "--repeat", "1", "--threads", "2",
                  "--methods", "recckpt,raw", "--warm-alone", "--dir", str(tmp_path / "scratch3"), "--json", str(alone)])
    doc = json.loads(alone.read_text())
    assert doc["warm_alone"] and all(r["load_warm_s"] > 0 and r["load_warm_cpu_s"] > 0 and r["load_s"] > 0
                                     for r in doc["methods"].values())
    assert sorted(os.listdir(tmp_path / "scratch3")) == ["record-raw-0.json", "record-recckpt-0.json"], \
        "each method's files are removed once its warm load has run"
    with pytest.raises(SystemExit):   # needs both caches and fresh processes
        compare.parse_args(["--warm-alone", "--in-process"])
