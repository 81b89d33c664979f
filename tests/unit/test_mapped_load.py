"""Mapped loads (LoadConfig.mmap): the engine's read_ranges(map_into=...), format version 2's aligned
slot columns that make mapping possible, HashTable.adopt_storage, and the load path that ties them
together. Every mapped load is compared with a copying load of the same checkpoint."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.tables import DictTable, assert_tables_equal, table_contents
from recckpt import _C, HashTable, LoadConfig, SaveOptions, Saver, verify
from recckpt.errors import CorruptCheckpointError, DuplicateIdsError, LoadConfigError
from recckpt.format import layout
from recckpt.format.layout import row_granule
from recckpt.format.sparse_io import SegmentReader
from recckpt.state.protocol import AdoptStorage
from unit.test_engine_paths import Holder, empty_like, filled

PAGE = _C.MappedRegion.page_size
OPTS = SaveOptions(num_buckets=8, chunk_bytes=1000, segment_bytes=256 << 10, fsync=False)
MMAP = {"mmap": True}


def save(tmp_path, *tables, opts=OPTS, concurrency=2, ckpt="c"):
    Saver(Holder(*tables), output_dir=str(tmp_path), concurrency=concurrency, options=opts).save(ckpt)
    return tmp_path / ckpt


def load(tmp_path, *tables, conf=None, shard=(0, 1), ckpt="c"):
    dst = Holder(*tables)
    res = Saver(dst, output_dir=str(tmp_path)).load(ckpt_id=ckpt, load_conf=conf, shard_id=shard[0],
                                                    shard_num=shard[1])
    return dst, res


# ------------------------------------------------------------------ engine: read_ranges(map_into=)
def _column_file(tmp_path, offset, nbytes, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    path = str(tmp_path / "col.bin")
    with open(path, "wb") as f:
        f.write(bytes(offset))
        f.write(data.tobytes())
    return path, data


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("offset", [0, 100, PAGE, 3 * PAGE + 17])
def test_congruent_column_is_mapped_verified_and_copy_on_write(tmp_path, threads, offset):
    nbytes = 7 * PAGE + 123
    path, data = _column_file(tmp_path, offset, nbytes)
    crcs = _C.crc32c_chunks(data, 1000)
    region = _C.MappedRegion(nbytes + 2 * PAGE)
    shift = offset % PAGE
    dst = np.frombuffer(region, dtype=np.uint8)[shift:shift + nbytes]
    nread, errors = _C.read_ranges([(path, offset, nbytes, 1000, crcs, 0, nbytes, dst)], threads, map_into=region)
    assert errors == [] and nread == nbytes
    np.testing.assert_array_equal(dst, data)
    whole_pages = ((shift + nbytes) // PAGE - (shift + PAGE - 1) // PAGE) * PAGE
    assert region.bytes_mapped == whole_pages > 0
    dst[:] = 0  # private: the file keeps its bytes
    with open(path, "rb") as f:
        assert f.read()[offset:] == data.tobytes()


@pytest.fixture
def failing_mmap():
    """Arms the engine's test hook to fail the first column mmap with ENOMEM (as vm.max_map_count
    would); the hook unmaps the range first, the worst a failed MAP_FIXED may do."""
    import errno
    _C._inject_fault("mmap", 1, errno.ENOMEM)
    yield
    _C._inject_fault("mmap", 0)


def test_failed_mmap_restores_the_region_and_reads_the_column(tmp_path, failing_mmap):
    nbytes = 6 * PAGE
    path, data = _column_file(tmp_path, PAGE, nbytes)
    crcs = _C.crc32c_chunks(data, 1000)
    region = _C.MappedRegion(2 * nbytes)
    view = np.frombuffer(region, dtype=np.uint8)
    first, second = view[:nbytes], view[nbytes:]
    reqs = [(path, PAGE, nbytes, 1000, crcs, 0, nbytes, first), (path, PAGE, nbytes, 1000, crcs, 0, nbytes, second)]
    nread, errors = _C.read_ranges(reqs, 2, map_into=region)
    assert errors == [] and nread == 2 * nbytes
    assert _C._fault_seen("mmap") == 2
    np.testing.assert_array_equal(first, data)   # read into restored anonymous memory
    np.testing.assert_array_equal(second, data)  # mapped
    assert region.bytes_mapped == nbytes
    view[:] = 7  # both writable, and neither write reaches the file
    with open(path, "rb") as f:
        assert f.read()[PAGE:] == data.tobytes()


def test_only_whole_columns_at_congruent_addresses_inside_the_region_are_mapped(tmp_path):
    nbytes = 5 * PAGE
    path, data = _column_file(tmp_path, PAGE, nbytes)
    crcs = _C.crc32c_chunks(data, 1000)
    region = _C.MappedRegion(2 * nbytes + PAGE)
    view = np.frombuffer(region, dtype=np.uint8)
    skewed = view[1:1 + nbytes]                       # not congruent with the file offset
    part = view[nbytes + PAGE:nbytes + PAGE + 3000]   # a partial range is always copied
    outside = np.empty(nbytes, dtype=np.uint8)        # memory the region does not own
    reqs = [(path, PAGE, nbytes, 1000, crcs, 0, nbytes, skewed),
            (path, PAGE, nbytes, 1000, crcs, 1000, 4000, part),
            (path, PAGE, nbytes, 1000, crcs, 0, nbytes, outside)]
    _, errors = _C.read_ranges(reqs, 2, map_into=region)
    assert errors == [] and region.bytes_mapped == 0
    np.testing.assert_array_equal(skewed, data)
    np.testing.assert_array_equal(part, data[1000:4000])
    np.testing.assert_array_equal(outside, data)


def test_corruption_in_a_mapped_column_is_reported_with_its_chunk(tmp_path):
    nbytes = 6 * PAGE
    path, data = _column_file(tmp_path, 0, nbytes)
    crcs = _C.crc32c_chunks(data, 1000)
    with open(path, "r+b") as f:
        f.seek(4 * PAGE + 5)
        f.write(bytes([data[4 * PAGE + 5] ^ 0x10]))
    region = _C.MappedRegion(nbytes)
    dst = np.frombuffer(region, dtype=np.uint8)
    _, errors = _C.read_ranges([(path, 0, nbytes, 1000, crcs, 0, nbytes, dst)], 2, map_into=region)
    chunk = (4 * PAGE + 5) // 1000
    assert region.bytes_mapped == nbytes
    assert errors and errors[0][0] == 0 and f"CRC mismatch in chunk {chunk}" in errors[0][1]


def test_padding_before_a_column_must_be_zero(tmp_path):
    path, data = _column_file(tmp_path, 300, 2000)
    crcs = _C.crc32c_chunks(data, 1000)
    def req(pad, lo=0):
        return (path, 300, 2000, 1000, crcs, lo, 2000, np.empty(2000 - lo, np.uint8), pad)

    assert _C.read_ranges([req(300)], 1)[1] == []
    with open(path, "r+b") as f:
        f.seek(123)
        f.write(b"\x01")
    _, errors = _C.read_ranges([req(300)], 1)
    assert errors and "non-zero byte in the padding before the column, at file offset 123" in errors[0][1]
    assert _C.read_ranges([req(100)], 1)[1] == []        # the flipped byte is before this padding
    assert _C.read_ranges([req(300, lo=1000)], 1)[1] == []  # a partial read does not read the padding
    _, errors = _C.read_ranges([req(301)], 1)
    assert errors and "pad_before must be in [0, col_offset]" in errors[0][1]


def test_region_lives_as_long_as_a_tensor_over_it():
    region = _C.MappedRegion(3 * PAGE + 1)
    assert len(region) == 3 * PAGE + 1
    t = torch.frombuffer(region, dtype=torch.uint8)
    del region
    t[-1] = 9
    assert int(t.sum()) == 9  # zeroed memory, still mapped
    assert len(_C.MappedRegion(0)) == 0
    with pytest.raises(ValueError):
        _C.MappedRegion(-1)


# ------------------------------------------------------------------ format version 2
def test_row_granule():
    assert row_granule([256]) == 16
    assert row_granule([12, 4]) == 1024
    assert row_granule([4096, 8192]) == 1
    assert row_granule([2, 0]) == 2048
    assert _C.COLUMN_ALIGN == layout.COLUMN_ALIGN   # the engine pads to the layout module's rule


def _index(ckpt):
    """The checkpoint's validated index (format version 4 records where columns are by rule, so tests
    read positions from the parsed index, not from the JSON)."""
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.storage import open_storage
    return CheckpointReader(open_storage(str(ckpt)), "").index


def test_saved_segments_are_whole_granules_and_slot_columns_aligned(tmp_path):
    t = filled("t", 5000, dim=16, extra_slot=False)  # 64-byte rows: granule 64
    ckpt = save(tmp_path, t, opts=SaveOptions(num_buckets=8, segment_bytes=100_000, fsync=False))
    idx = _index(ckpt)
    assert idx.format_version == 5
    segs = idx.tables["t"][1]
    rows = [s.rows for s in segs]
    assert sum(rows) == 5000 and len(rows) > 3
    assert sum(r % 64 != 0 for r in rows) == 1, rows  # only the short tail is not whole granules
    # segments of at least layout.PACK_BELOW bytes are aligned; the short tail may be packed
    for s in segs:
        if s.rows * (8 + 64 + 8) >= layout.PACK_BELOW:
            assert not s.packed and s.columns[1].offset % 4096 == 0
        else:
            assert s.packed and s.columns[1].offset == s.columns[0].offset + s.columns[0].length


def _fixture(tmp_path, rel):
    import os
    import shutil
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", rel)
    dst = tmp_path / "fixture"
    shutil.copytree(src, dst)
    return dst


def test_version_1_checkpoints_still_load_with_and_without_mmap(tmp_path, monkeypatch):
    ckpt = _fixture(tmp_path, "v1/ckpt")   # tests/fixtures: no padding, nothing can be mapped
    assert json.loads((ckpt / "manifest.json").read_text())["format_version"] == 1

    def load_fixture(conf):
        dst = Holder(HashTable("user", 4))
        res = Saver(dst, output_dir=str(tmp_path / "o")).load(str(ckpt), direct_path=True,
                                                               load_conf={"strict": False, **(conf or {})})
        return dst.tables[0], res
    a, _ = load_fixture(None)
    calls = []
    orig = SegmentReader.map_table
    monkeypatch.setattr(SegmentReader, "map_table", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    b, res = load_fixture(MMAP)
    assert len(a) == 40
    assert_tables_equal(a, b)
    assert calls == [1]  # the mapped path ran; unaligned columns were read into its storage
    assert res.bytes_mapped == 0


def test_misaligned_version_2_column_is_refused(tmp_path):
    from helpers.hostile import read_json, write_json
    ckpt = _fixture(tmp_path, "v2/ckpt")
    idx = read_json(str(ckpt), "index.json")
    idx["tables"]["user"]["segments"][0]["columns"][1]["offset"] -= 8
    write_json(str(ckpt), "index.json", idx)
    with pytest.raises(CorruptCheckpointError, match=r"columns\[1\]\.offset.*padded to a multiple of 4096"):
        Saver(Holder(HashTable("user", 4)), output_dir=str(tmp_path / "o")).load(
            str(ckpt), direct_path=True, load_conf={"strict": False})


def test_packed_flag_of_an_aligned_segment_is_refused(tmp_path):
    """Format version 4 derives column offsets from the packed flag: flipping it moves every column,
    and the segments no longer tile the file."""
    from helpers.hostile import read_json, write_json
    ckpt = save(tmp_path, filled("t", 3000, dim=16), concurrency=1)
    idx = read_json(str(ckpt), "index.json")
    packed = idx["tables"]["t"]["segments"]["packed"]
    i = packed.index(0)
    packed[i] = 1
    write_json(str(ckpt), "index.json", idx)
    with pytest.raises(CorruptCheckpointError, match="do not tile the file"):
        load(tmp_path, empty_like(filled("t", 0, dim=16)))


@pytest.mark.parametrize("mmap", [False, True])
def test_flipped_padding_byte_fails_the_load_and_verify(tmp_path, mmap):
    t = filled("t", 3000, dim=16)
    ckpt = save(tmp_path, t, concurrency=1)
    idx = _index(ckpt)
    seg = next(s for s in idx.tables["t"][1] if not s.packed)
    ids_end = seg.columns[0].offset + seg.columns[0].length
    assert seg.columns[1].offset > ids_end, "this layout has padding before slot 0"
    shard = ckpt / idx.files[seg.file][0]
    data = bytearray(shard.read_bytes())
    data[ids_end] = 0xAA
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="non-zero byte in the padding"):
        load(tmp_path, empty_like(t), conf={"mmap": mmap})
    report = verify(str(ckpt))
    assert not report.ok and "non-zero byte in the padding" in str(report.problems)


# ------------------------------------------------------------------ HashTable.adopt_storage
def _storage(cap, dim, ids):
    out = torch.zeros(cap, dtype=torch.int64)
    out[:len(ids)] = ids
    return out, {"embedding": torch.arange(cap * dim, dtype=torch.float32).view(cap, dim)}


def test_adopt_storage_takes_the_tensors_and_initialises_other_slots():
    t = HashTable("t", dim=2)
    t.add_slot("acc", torch.float32, (2,), init=0.25)
    assert isinstance(t, AdoptStorage)
    ids, cols = _storage(10, 2, torch.tensor([5, -3, 9]))
    t.adopt_storage(3, ids, cols)
    assert len(t) == 3 and t.capacity == 10
    assert t.slot("embedding").data_ptr() == cols["embedding"].data_ptr()  # no copy
    assert torch.equal(t.lookup(torch.tensor([9, 5, 7])), torch.tensor([2, 0, -1]))
    assert torch.equal(t.slot("acc"), torch.full((3, 2), 0.25))
    t.lookup(torch.arange(100, 120), insert=True)  # grows past the adopted capacity: values kept
    assert len(t) == 23 and torch.equal(t.read_rows("embedding", torch.tensor([1])), torch.tensor([[2.0, 3.0]]))


def test_adopt_storage_refuses_without_changing_the_table():
    t = HashTable("t", dim=2)
    ids, cols = _storage(4, 2, torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match="id 1 .*repeated; nothing was adopted"):
        t.adopt_storage(3, ids, cols)
    assert len(t) == 0 and t.lookup(torch.tensor([2])).item() == -1
    with pytest.raises(ValueError, match=r"slot 'embedding'.*shape \(4, 2\)"):
        t.adopt_storage(1, ids, {"embedding": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"rows must be an int in \[0, 4\]"):
        t.adopt_storage(5, ids, cols)
    t.lookup(torch.tensor([7]), insert=True)
    with pytest.raises(ValueError, match="needs an empty table"):
        t.adopt_storage(1, ids, cols)


# ------------------------------------------------------------------ the mapped load path
def _slot_bytes(t):
    return len(t) * sum(t.slot(s)[:1].nbytes for s in t.slot_names)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_mapped_load_equals_a_copying_load(tmp_path, concurrency):
    t = filled("t", 20_000, dim=16)
    small = filled("small", 7, dim=5, seed=2)
    save(tmp_path, t, small, concurrency=concurrency)
    a, ra = load(tmp_path, empty_like(t), empty_like(small))
    b, rb = load(tmp_path, empty_like(t), empty_like(small), conf=MMAP)
    for x, y, src in zip(a.tables, b.tables, (t, small)):
        assert_tables_equal(src, x)
        assert_tables_equal(src, y)
    assert ra.bytes_mapped == 0 and ra.tables_mapped == []
    assert rb.tables_mapped == ["t"]  # "small" is copied: none of its columns spans a whole page
    # everything but the short tail segment and partial pages at column ends is mapped
    assert 0.8 * _slot_bytes(t) < rb.bytes_mapped <= _slot_bytes(t)
    assert b.tables[0].capacity == len(t) + len(t) // 2  # room to grow without copying
    slots = b.tables[0].store.map.capacity  # ... or rehashing the id map
    b.tables[0].lookup(torch.arange(10**9, 10**9 + len(t) // 4), insert=True)
    assert b.tables[0].store.map.capacity == slots


def test_mapped_load_of_an_empty_table_and_a_one_row_table(tmp_path):
    empty = filled("empty", 0, dim=8)
    wide = filled("wide", 1, dim=9000, seed=3)  # one row spanning whole pages in every slot, not packed
    save(tmp_path, empty, wide)
    m, res = load(tmp_path, empty_like(empty), empty_like(wide), conf=MMAP)
    assert_tables_equal(empty, m.tables[0])
    assert_tables_equal(wide, m.tables[1])
    assert res.tables_mapped == ["wide"] and res.bytes_mapped > 0
    for t in m.tables:  # both grow normally afterwards
        t.lookup(torch.arange(100, 105), insert=True)
        assert len(t) == 5 + (t.name == "wide")


def test_training_writes_after_a_mapped_load_never_reach_the_checkpoint(tmp_path):
    t = filled("t", 5000, dim=16)
    ckpt = save(tmp_path, t)
    before = {p: p.read_bytes() for p in (ckpt / "sparse").iterdir()}
    m, _ = load(tmp_path, empty_like(t), conf=MMAP)
    table = m.tables[0]
    table.slot("embedding").mul_(-1)
    table.write_rows("acc", torch.arange(100), torch.zeros(100, 16))
    table.lookup(torch.arange(10_000, 14_000), insert=True)  # and grows past the mapped capacity
    assert {p: p.read_bytes() for p in (ckpt / "sparse").iterdir()} == before
    again, _ = load(tmp_path, empty_like(t), conf=MMAP)
    assert_tables_equal(t, again.tables[0])


def test_mapped_table_survives_its_checkpoint_being_deleted_and_saves_again(tmp_path):
    t = filled("t", 3000, dim=16)
    save(tmp_path, t)
    m, _ = load(tmp_path, empty_like(t), conf=MMAP)
    import shutil
    shutil.rmtree(tmp_path / "c")
    assert_tables_equal(t, m.tables[0])
    Saver(m, output_dir=str(tmp_path / "next"), options=OPTS).save("d")
    again, res = load(tmp_path / "next", empty_like(t), conf=MMAP, ckpt="d")
    assert_tables_equal(t, again.tables[0]) and res.bytes_mapped > 0


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 2), (2, 1), (1, 3)])
def test_mapped_distributed_and_resharded_loads(tmp_path, saved_world, loaded_world):
    """At the saving world size each rank maps its own workers' segments whole; resharding maps whole
    segments and reads the rows of partial ones."""
    full = filled("t", 6000, dim=16)
    ids = full.ids()
    buckets = torch.from_numpy(_C.bucket_of(ids.numpy(), 8))
    for w in range(saved_world):
        lo, hi = w * 8 // saved_world, (w + 1) * 8 // saved_world
        mine = ids[(buckets >= lo) & (buckets < hi)]
        part = empty_like(full)
        rows = full.lookup(mine)
        part.import_rows(mine, {s: full.read_rows(s, rows) for s in full.slot_names})
        Saver(Holder(part), output_dir=str(tmp_path), options=OPTS).save("c", shard_id=w, shard_num=saved_world)
    seen = {}
    mapped = 0
    for r in range(loaded_world):
        copy, _ = load(tmp_path, empty_like(full), shard=(r, loaded_world))
        m, res = load(tmp_path, empty_like(full), conf=MMAP, shard=(r, loaded_world))
        assert_tables_equal(copy.tables[0], m.tables[0])
        seen.update(table_contents(m.tables[0])["embedding"])
        mapped += res.bytes_mapped
    assert set(seen) == set(ids.tolist())
    if saved_world == loaded_world or loaded_world == 1:
        assert mapped > 0.5 * _slot_bytes(full)


def test_mmap_falls_back_to_copying_where_it_cannot_map(tmp_path):
    t = filled("t", 2000, dim=16)
    save(tmp_path, t)
    cast, res = load(tmp_path, empty_like(t, dtype=torch.bfloat16), conf=MMAP)  # a dtype cast
    assert res.tables_mapped == [] and res.bytes_mapped == 0 and len(cast.tables[0]) == 2000
    merged = empty_like(t)
    merged.lookup(torch.tensor([1]), insert=True)
    m, res = load(tmp_path, merged, conf={"mmap": True, "merge": True})  # a merge keeps existing rows
    assert res.tables_mapped == [] and len(m.tables[0]) == 2001
    dict_table = DictTable("t", {s: t.slot_spec(s) for s in t.slot_names})  # no AdoptStorage
    d, res = load(tmp_path, dict_table, conf=MMAP)
    assert res.tables_mapped == [] and len(table_contents(d.tables[0])["embedding"]) == 2000


def test_load_falls_back_to_reading_a_column_whose_mmap_fails(tmp_path):
    t = filled("t", 20_000, dim=16)
    save(tmp_path, t)
    _, full = load(tmp_path, empty_like(t), conf=MMAP)
    import errno
    _C._inject_fault("mmap", 1, errno.ENOMEM)
    try:
        m, res = load(tmp_path, empty_like(t), conf=MMAP)
    finally:
        _C._inject_fault("mmap", 0)
    assert_tables_equal(t, m.tables[0])
    assert 0 < res.bytes_mapped < full.bytes_mapped and res.tables_mapped == ["t"]
    table = m.tables[0]
    before = t.read_rows("embedding", t.lookup(table.ids()))
    table.slot("embedding").mul_(2)  # the restored memory is ordinary writable storage
    assert torch.equal(table.slot("embedding"), before * 2)


def test_corrupt_mapped_column_fails_the_load_naming_the_file(tmp_path):
    t = filled("t", 3000, dim=16)
    ckpt = save(tmp_path, t, concurrency=1)
    _, res = load(tmp_path, empty_like(t), conf=MMAP)
    assert res.bytes_mapped > 0
    idx = _index(ckpt)
    seg = next(s for s in idx.tables["t"][1] if s.rows % 1024 == 0 and not s.packed)  # a mapped segment
    col = seg.columns[1]
    shard = ckpt / idx.files[seg.file][0]
    data = bytearray(shard.read_bytes())
    data[col.offset + 2 * PAGE + 7] ^= 0x01  # a whole page inside the mapped embedding column
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"shard-00000-000\.bin.*table 't'.*CRC mismatch.*left empty"):
        load(tmp_path, empty_like(t), conf=MMAP)


def test_mapped_load_under_inference_mode_leaves_a_trainable_table(tmp_path):
    t = filled("t", 3000, dim=16)
    save(tmp_path, t)
    with torch.inference_mode():
        m, res = load(tmp_path, empty_like(t), conf=MMAP)
    table = m.tables[0]
    assert res.tables_mapped == ["t"] and not table.slot("embedding").is_inference()
    table.write_rows("embedding", torch.tensor([0]), torch.ones(1, 16))  # what an optimizer step does
    table.lookup(torch.tensor([-1, -2]), insert=True)
    assert len(table) == 3002


def test_a_table_with_adopt_storage_alone_is_mapped(tmp_path):
    class AdoptOnly(HashTable):
        append_views = None  # no BulkAppend: mapping must not depend on it

    t = filled("t", 3000, dim=16)
    save(tmp_path, t)
    dst = AdoptOnly("t", dim=16)
    for s in t.slot_names[1:]:
        spec = t.slot_spec(s)
        dst.add_slot(s, spec.dtype, spec.shape, category=spec.category)
    m, res = load(tmp_path, dst, conf=MMAP)
    assert res.tables_mapped == ["t"]
    assert_tables_equal(t, m.tables[0])


def test_repeated_id_is_reported_by_a_mapped_load(tmp_path):
    for w in range(2):  # both workers store id 7: a job that routed ids inconsistently
        part = HashTable("t", dim=4)
        part.import_rows(torch.tensor([7, 100 + w]), {"embedding": torch.full((2, 4), float(w))})
        Saver(Holder(part), output_dir=str(tmp_path), options=OPTS).save("c", shard_id=w, shard_num=2)
    with pytest.raises(DuplicateIdsError, match=r"table 't' stores an id more than once"):
        load(tmp_path, HashTable("t", dim=4), conf=MMAP)


def test_mmap_option_is_validated():
    assert LoadConfig(mmap=True).mmap is True
    with pytest.raises(LoadConfigError, match="mmap must be a bool"):
        LoadConfig(mmap="yes")
