"""Tests of the C++ engine (recckpt._C) through Python: hashing, CRC32C, ShardWriter, read_ranges.

References here are independent of the engine: a bit-by-bit CRC-32C in Python, mix64 in numpy uint64
arithmetic, and a numpy stable sort for the bucket order.
"""
import errno
import gc
import json
import os
import subprocess
import sys
import threading
import weakref
import zlib  # noqa: F401  (documents the `value` continuation convention being mirrored)

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from recckpt import _C

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------------------------------- refs
def crc32c_ref(data: bytes, value: int = 0) -> int:
    """Bit-at-a-time CRC-32C (reflected polynomial 0x82F63B78)."""
    c = value ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def mix64_ref(ids: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = ids.astype(np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def bucket_ref(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    return (mix64_ref(ids) % np.uint64(num_buckets)).astype(np.int64)


EXTREME_IDS = np.array([0, 1, -1, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 2**32, -(2**32)], np.int64)


# ---------------------------------------------------------------------------------------------- crc32c
KNOWN = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),  # RFC 3720 B.4
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data,expected", KNOWN)
def test_crc32c_known_vectors(data, expected):
    assert _C.crc32c(data) == expected
    assert _C._crc32c_software(data) == expected
    assert crc32c_ref(data) == expected


def test_crc32c_backend_reports_hardware_when_present():
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    expected = "sse4.2" if "sse4_2" in flags else "software"
    assert _C.crc32c_backend() == expected


@SETTINGS
@given(data=st.binary(max_size=3000), value=st.integers(0, 2**32 - 1))
def test_crc32c_matches_bitwise_reference(data, value):
    assert _C.crc32c(data, value) == crc32c_ref(data, value)
    assert _C._crc32c_software(data, value) == crc32c_ref(data, value)


@SETTINGS
@given(n=st.integers(0, 200_000), start=st.integers(0, 15), seed=st.integers(0, 2**32 - 1))
def test_crc32c_hardware_equals_software(n, start, seed):
    # Lengths up to 200 KB cross the 3x8192 and 3x256 interleaved loops; `start` varies alignment.
    buf = np.random.default_rng(seed).integers(0, 256, size=n + start, dtype=np.uint8)[start:]
    assert _C.crc32c(buf) == _C._crc32c_software(buf)


@pytest.mark.parametrize("n", [7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 3 * 8192 + 3 * 256 + 13, 1 << 20])
def test_crc32c_interleave_boundaries(n):
    buf = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    assert _C.crc32c(buf) == _C._crc32c_software(buf)


@SETTINGS
@given(data=st.binary(max_size=50_000), cut=st.integers(0, 50_000))
def test_crc32c_value_continues(data, cut):
    cut = min(cut, len(data))
    whole = _C.crc32c(data)
    assert _C.crc32c(data[cut:], _C.crc32c(data[:cut])) == whole
    assert _C._crc32c_software(data[cut:], _C._crc32c_software(data[:cut])) == whole
    assert _C._crc32c_combine(_C.crc32c(data[:cut]), _C.crc32c(data[cut:]), len(data) - cut) == whole


@SETTINGS
@given(data=st.binary(max_size=5000), chunk=st.integers(1, 700))
def test_crc32c_chunks_equals_per_chunk(data, chunk):
    got = _C.crc32c_chunks(data, chunk)
    assert got.dtype == np.uint32
    expected = [_C.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert got.tolist() == expected
    assert len(got) == -(-len(data) // chunk)


def test_crc32c_accepts_buffers_and_rejects_bad_input():
    a = np.arange(100, dtype=np.float32)
    assert _C.crc32c(a) == _C.crc32c(a.tobytes()) == _C.crc32c(memoryview(a.tobytes()))
    assert _C.crc32c(bytearray(b"123456789")) == 0xE3069283
    with pytest.raises(ValueError, match="contiguous"):
        _C.crc32c(np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(ValueError):
        _C.crc32c(b"x", -1)
    with pytest.raises(ValueError):
        _C.crc32c(b"x", 2**32)
    with pytest.raises(ValueError):
        _C.crc32c_chunks(b"x", 0)
    with pytest.raises(TypeError):
        _C.crc32c("not bytes")


# -------------------------------------------------------------------------------------------- bucket_of
@SETTINGS
@given(
    ids=st.lists(st.integers(INT64_MIN, INT64_MAX), max_size=200),
    num_buckets=st.one_of(st.integers(1, 5000), st.integers(1, INT64_MAX), st.sampled_from([1, 2, 3, 4096, 2**62, 2**62 + 1, INT64_MAX])),
)
def test_bucket_of_matches_numpy_reference(ids, num_buckets):
    arr = np.concatenate([np.array(ids, dtype=np.int64), EXTREME_IDS])
    got = _C.bucket_of(arr, num_buckets)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, bucket_ref(arr, num_buckets))
    assert ((got >= 0) & (got < num_buckets)).all()


def test_bucket_of_large_random_many_divisors():
    ids = np.random.default_rng(1).integers(INT64_MIN, INT64_MAX, size=200_000, dtype=np.int64, endpoint=True)
    for b in [1, 7, 1000, 4096, 1000003, 2**31 - 1, 2**33 + 5, 2**63 - 25]:
        np.testing.assert_array_equal(_C.bucket_of(ids, b), bucket_ref(ids, b))


def test_mix64_known_values():
    # splitmix64 from state 0: the first output is mix64(0) with the golden-ratio increment applied.
    assert int(mix64_ref(np.array([0], np.int64))[0]) == 0xE220A8397B1DCDAF
    assert _C.bucket_of(np.array([0], np.int64), 2**63 - 1)[0] == 0xE220A8397B1DCDAF % (2**63 - 1)


def test_bucket_of_rejects_bad_input():
    with pytest.raises(ValueError):
        _C.bucket_of(np.zeros(3, np.int64), 0)
    with pytest.raises(TypeError, match="int64"):
        _C.bucket_of(np.zeros(3, np.int32), 4)
    with pytest.raises(ValueError, match="contiguous"):
        _C.bucket_of(np.zeros(6, np.int64)[::2], 4)
    with pytest.raises(ValueError, match="1-D"):
        _C.bucket_of(np.zeros((2, 3), np.int64), 4)


# ------------------------------------------------------------------------------------- writer helpers
def expected_segment(ids, cols, num_buckets, num_rows=0):
    """(bucket offsets, [ids bytes, col bytes...]) in stable bucket order, computed with numpy."""
    b = ids * num_buckets // num_rows if num_rows else bucket_ref(ids, num_buckets)
    order = np.argsort(b, kind="stable")
    offsets = np.zeros(num_buckets + 1, np.int64)
    np.cumsum(np.bincount(b, minlength=num_buckets), out=offsets[1:])
    data = [ids[order].tobytes()] + [c[order].tobytes() for c in cols]
    return offsets, data


def make_segment(rng, n, row_bytes):
    ids = rng.integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64, endpoint=True)
    if n >= 4:
        ids[: min(n, len(EXTREME_IDS))] = EXTREME_IDS[: min(n, len(EXTREME_IDS))]
    cols = [rng.integers(0, 256, size=(n, rb), dtype=np.uint8) for rb in row_bytes]
    return ids, cols


def step_ref(length, chunk_bytes):
    """Format version 4's checksum step (docs/FORMAT.md), written out independently."""
    q = -(-length // 64)
    if q >= chunk_bytes:
        return chunk_bytes
    p = 512
    while p < q:
        p *= 2
    return min(p, chunk_bytes)


def check_file(path, records, segments, num_buckets, chunk_bytes, num_rows=0):
    """Parses a shard file with the records and checks every byte against the numpy expectation
    (format version 4: bucket directory, packing, checksum steps)."""
    data = open(path, "rb").read()
    pos = 0
    for r in records:
        ids, cols, table = segments[r["segment"]]
        assert r["table"] == table
        assert r["rows"] == len(ids)
        assert r["offset"] == pos, "segments are contiguous, in file order"
        offsets, expected_cols = expected_segment(ids, cols, num_buckets, num_rows)
        nonempty = np.nonzero(np.diff(offsets))[0]
        k = len(nonempty)
        assert r["dir"] == k and r["first"] == nonempty[0] and r["last"] == nonempty[-1]
        bk = r["buckets"]
        assert bk["offset"] == r["offset"] and bk["length"] == 8 * k
        block = data[bk["offset"] : bk["offset"] + bk["length"]]
        got_dir = np.frombuffer(block, "<u4")
        np.testing.assert_array_equal(got_dir[:k], nonempty)
        np.testing.assert_array_equal(got_dir[k:], offsets[nonempty])
        assert _C.crc32c(block) == bk["crc32c"]
        if len(block) <= 256:
            assert crc32c_ref(block) == bk["crc32c"]
        pos = bk["offset"] + bk["length"]
        assert len(r["columns"]) == 1 + len(cols)
        assert r["packed"] == (sum(len(e) for e in expected_cols) < _C.PACK_BELOW)
        for k, (c, exp) in enumerate(zip(r["columns"], expected_cols)):
            if k > 0 and exp and not r["packed"]:  # a non-empty slot column starts on a 4096-byte boundary
                pad = -pos % 4096
                assert data[pos:pos + pad] == bytes(pad), "padding is zero bytes"
                pos += pad
            assert c["offset"] == pos and c["length"] == len(exp)
            got = data[c["offset"] : c["offset"] + c["length"]]
            assert got == exp
            step = step_ref(len(exp), chunk_bytes)
            assert c["step"] == step == _C.column_step(len(exp), chunk_bytes)
            assert list(c["crc32c"]) == [_C.crc32c(exp[i : i + step]) for i in range(0, len(exp), step)]
            pos += c["length"]
    assert pos == len(data), "no bytes besides the segments"


def write_segments(paths, num_buckets, chunk_bytes, specs, max_inflight=1 << 30, seed=0, num_rows=0):
    """specs: list of (table, n, row_bytes tuple). Returns (records, {segment: (ids, cols, table)}).
    An empty segment is refused (format version 4: a segment holds at least one row) and left out."""
    rng = np.random.default_rng(seed)
    w = _C.ShardWriter(paths, num_buckets, chunk_bytes, max_inflight)
    segments = {}
    for table, n, rbs in specs:
        ids, cols = make_segment(rng, n, rbs)
        if num_rows:
            ids = rng.integers(0, num_rows, size=n, dtype=np.int64)
        if n == 0:
            with pytest.raises(ValueError, match="1 to 2"):
                w.submit(table, ids, cols)
            continue
        sid = w.submit(table, ids, cols, num_rows)
        assert sid not in segments
        segments[sid] = (ids, cols, table)
    return w.finish(), segments


# ------------------------------------------------------------------------------------------ ShardWriter
ROW_BYTES = (0, 1, 3, 8, 256)


@pytest.mark.parametrize("nfiles", [1, 2, 4])
def test_writer_round_trip_layout(tmp_path, nfiles):
    paths = [str(tmp_path / f"shard{i}.bin") for i in range(nfiles)]
    specs = [(0, 0, ROW_BYTES), (1, 1, ROW_BYTES), (2, 1000, ROW_BYTES), (0, 5000, (4, 12)), (3, 2, ())]
    specs += [(7, n, (3,)) for n in range(0, 30, 3)]  # many tiny segments
    records, segments = write_segments(paths, 13, 100, specs)
    assert len(records) == nfiles
    assert sorted(r["segment"] for f in records for r in f) == list(range(sum(1 for sp in specs if sp[1])))
    for p, recs in zip(paths, records):
        check_file(p, recs, segments, 13, 100)


@SETTINGS
@given(
    num_buckets=st.sampled_from([1, 2, 5, 64, 1000]),
    chunk_bytes=st.sampled_from([1, 7, 64, 4096, 1 << 20]),
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    row_bytes=st.lists(st.sampled_from([0, 1, 3, 8, 17, 256]), max_size=3),
)
def test_writer_round_trip_hypothesis(tmp_path_factory, num_buckets, chunk_bytes, sizes, row_bytes):
    d = tmp_path_factory.mktemp("w")
    paths = [str(d / "a"), str(d / "b")]
    records, segments = write_segments(paths, num_buckets, chunk_bytes, [(i, n, tuple(row_bytes)) for i, n in enumerate(sizes)])
    for p, recs in zip(paths, records):
        check_file(p, recs, segments, num_buckets, chunk_bytes)


def test_writer_duplicate_ids_and_single_bucket_keep_input_order(tmp_path):
    p = str(tmp_path / "s")
    ids = np.array([5, 5, -1, 5, INT64_MIN, -1], np.int64)
    col = np.arange(6, dtype=np.uint8).reshape(6, 1)
    w = _C.ShardWriter([p], 1, 4, 1 << 20)
    w.submit(0, ids, [col])
    (rec,), = w.finish()
    data = open(p, "rb").read()
    c0, c1 = rec["columns"]
    np.testing.assert_array_equal(np.frombuffer(data[c0["offset"] : c0["offset"] + c0["length"]], np.int64), ids)
    assert data[c1["offset"] : c1["offset"] + 6] == bytes(range(6))


def test_writer_large_rows_bigger_than_staging(tmp_path):
    # Rows larger than the 8 MiB staging buffer take the direct path.
    p = str(tmp_path / "big")
    rng = np.random.default_rng(3)
    ids = np.array([3, 1, 2], np.int64)
    col = rng.integers(0, 256, size=(3, (9 << 20) + 5), dtype=np.uint8)
    w = _C.ShardWriter([p], 2, 1 << 20, 0)
    w.submit(9, ids, [col])
    records = w.finish(fsync=False)
    check_file(p, records[0], {0: (ids, [col], 9)}, 2, 1 << 20)


def test_writer_large_segment_multi_stage(tmp_path):
    # 200k rows x 64 bytes: several staging flushes and CRC blocks per column; chunks straddle flushes.
    paths = [str(tmp_path / "x"), str(tmp_path / "y")]
    records, segments = write_segments(paths, 4096, 3 << 20 | 17, [(0, 200_000, (64, 3)), (1, 70_000, (8,))])
    for p, recs in zip(paths, records):
        check_file(p, recs, segments, 4096, 3 << 20 | 17)


def test_writer_in_order_columns_are_written_from_the_source(tmp_path):
    # A fixed-size table's row range is already in "row_range" bucket order: columns of >= 4 MiB are
    # checksummed and written from the caller's memory in 4 MiB blocks (no staging), the small ones staged,
    # next to segments that are not in order; checksum chunks (odd size) straddle the blocks. Every byte,
    # offset, padding and checksum is checked.
    n_rows = 1_000_000
    p = str(tmp_path / "x")
    rng = np.random.default_rng(11)
    w = _C.ShardWriter([p], 4096, 3 << 20 | 17, 1 << 30)
    segments = {}
    for a, n, rbs in [(0, 70_001, (64, 3)), (500_000, 20_000, (260,)), (70_001, 1, (64, 3))]:
        ids = np.arange(a, a + n, dtype=np.int64)
        cols = [rng.integers(0, 256, size=(n, rb), dtype=np.uint8) for rb in rbs]
        segments[w.submit(0, ids, cols, n_rows)] = (ids, cols, 0)
    ids = rng.permutation(np.arange(300_000, 370_000, dtype=np.int64))   # not in order: gathered
    cols = [rng.integers(0, 256, size=(70_000, 64), dtype=np.uint8)]
    segments[w.submit(1, ids, cols, n_rows)] = (ids, cols, 1)
    records = w.finish(fsync=False)
    check_file(p, records[0], segments, 4096, 3 << 20 | 17, n_rows)


def test_writer_in_order_write_failure_raises_naming_path():
    w = _C.ShardWriter(["/dev/full"], 4096, 1 << 20, 1 << 30)
    with pytest.raises(OSError) as e:
        w.submit(0, np.arange(100_000, dtype=np.int64), [np.zeros((100_000, 64), np.uint8)], 100_000)
        w.finish()
    assert e.value.errno == 28 and e.value.filename == "/dev/full"


def test_writer_small_max_inflight_blocks_and_completes(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    specs = [(i % 3, n, (8, 3)) for i, n in enumerate([500, 0, 3000, 1, 10_000] * 4)]
    records, segments = write_segments(paths, 64, 256, specs, max_inflight=1)
    assert sum(len(f) for f in records) == sum(1 for sp in specs if sp[1])
    for p, recs in zip(paths, records):
        check_file(p, recs, segments, 64, 256)


def test_writer_drops_references_after_writing(tmp_path):
    # With max_inflight_bytes=0 a submit waits until nothing is in flight, so the previous segment's
    # arrays must have been released by the time it returns; all of them after finish().
    w = _C.ShardWriter([str(tmp_path / "a")], 16, 64, 0)
    refs = []
    for i in range(5):
        ids = np.arange(i * 1000, (i + 1) * 1000, dtype=np.int64)
        col = np.ones((1000, 16), np.uint8)
        refs.append((weakref.ref(ids), weakref.ref(col)))
        w.submit(0, ids, [col])
        del ids, col
        gc.collect()
        if i >= 1:
            assert refs[i - 1][0]() is None and refs[i - 1][1]() is None
    w.finish()
    gc.collect()
    assert all(r() is None for pair in refs for r in pair)


def test_writer_wait_returns_once_a_segment_is_written(tmp_path):
    # Compaction reuses its buffers after wait(): by then the writer must hold no reference to them.
    w = _C.ShardWriter([str(tmp_path / "a"), str(tmp_path / "b")], 16, 1 << 16, 1 << 30)
    ids = np.arange(200_000, dtype=np.int64)
    col = np.ones((200_000, 128), np.uint8)
    refs = (weakref.ref(ids), weakref.ref(col))
    first = w.submit(0, ids, [col])
    later = w.submit(0, np.arange(10, dtype=np.int64), [np.zeros((10, 128), np.uint8)])
    del ids, col
    w.wait(first)
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    w.wait(first)          # again: already written
    w.wait(later)
    assert sum(len(f) for f in w.finish(False)) == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_writer_wait_raises_the_failure_of_the_writer(tmp_path):
    w = _C.ShardWriter(["/dev/full"], 8, 64, 1 << 30)
    ids = np.arange(100_000, dtype=np.int64)
    segs = [w.submit(0, ids, [np.zeros((100_000, 64), np.uint8)]) for _ in range(3)]
    with pytest.raises(OSError) as e:
        for s in segs:
            w.wait(s)
    assert e.value.errno == 28 and e.value.filename == "/dev/full"
    w.abort()


def test_writer_rejects_bad_arrays(tmp_path):
    w = _C.ShardWriter([str(tmp_path / "a")], 4, 64, 1 << 20)
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(TypeError, match="int64"):
        w.submit(0, ids.astype(np.int32), [])
    with pytest.raises(TypeError, match="uint8"):
        w.submit(0, ids, [np.zeros((4, 2), np.float32)])
    with pytest.raises(ValueError, match="rows"):
        w.submit(0, ids, [np.zeros((3, 2), np.uint8)])
    with pytest.raises(ValueError, match="shape"):
        w.submit(0, ids, [np.zeros(4, np.uint8)])
    with pytest.raises(ValueError, match="contiguous"):
        w.submit(0, ids, [np.zeros((4, 4), np.uint8)[:, :2]])
    with pytest.raises(ValueError, match="contiguous"):
        w.submit(0, np.arange(8, dtype=np.int64)[::2], [])
    assert w.submit(0, ids, [np.zeros((4, 2), np.uint8)]) == 0  # rejected submits took no id
    assert len(w.finish()[0]) == 1
    with pytest.raises(RuntimeError):
        w.submit(0, ids, [])
    with pytest.raises(ValueError):
        _C.ShardWriter([str(tmp_path / "b")], 0, 64, 0)
    with pytest.raises(ValueError):
        _C.ShardWriter([str(tmp_path / "b")], 4, 0, 0)
    with pytest.raises(ValueError, match="duplicate"):
        _C.ShardWriter([str(tmp_path / "b"), str(tmp_path / "b")], 4, 64, 0)


def test_writer_open_failure_names_path(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(OSError) as e:
        _C.ShardWriter([str(tmp_path / "ok"), str(d)], 4, 64, 0)
    assert str(d) in str(e.value) and e.value.errno is not None
    with pytest.raises(FileNotFoundError, match="missing"):
        _C.ShardWriter([str(tmp_path / "missing" / "x")], 4, 64, 0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_writer_worker_failure_raises_naming_path(tmp_path):
    # Writes to /dev/full fail with ENOSPC inside the worker; the next submit or finish raises.
    w = _C.ShardWriter([str(tmp_path / "good"), "/dev/full"], 8, 64, 1 << 30)
    ids = np.arange(1000, dtype=np.int64)
    col = np.zeros((1000, 8), np.uint8)
    errors = []
    try:
        for _ in range(50):
            w.submit(0, ids, [col])
    except OSError as e:  # raised by a submit after the worker failed
        errors.append(e)
    with pytest.raises(OSError) as e:  # finish always reports the failure (and closes the files)
        w.finish()
    errors.append(e.value)
    for err in errors:
        assert err.errno == 28 and err.filename == "/dev/full"
        assert "/dev/full" in str(err) and "No space left" in str(err) and "pwrite" in str(err)
    with pytest.raises(RuntimeError):  # the writer is finished after the failure
        w.finish()
    assert os.path.getsize(tmp_path / "good") > 0  # the other file's worker kept writing


# A child process: one segment of n rows written to argv[1] with the faults argv[3] armed, then again
# without them; prints the first write's error, how often the faults' operations ran, and the rows written.
_FAULTED_WRITE = """
import json, os, sys
import numpy as np
from recckpt import _C

path, n, faults = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
rng = np.random.default_rng(0)
ids = rng.integers(-(2**62), 2**62, size=n, dtype=np.int64)   # out of bucket order: staged, not written in place
col = rng.integers(0, 256, size=(n, 96), dtype=np.uint8)


def write():
    w = _C.ShardWriter([path], 64, 1 << 16, 1 << 30)
    w.submit(0, ids, [col])
    return w.finish(False)[0]


for op, at, err in faults:
    _C._inject_fault(op, at, err)
out = {}
try:
    write()
    out["error"] = None
except OSError as e:
    out["error"] = [e.errno, e.filename, str(e)]
out["seen"] = {op: _C._fault_seen(op) for op, _, _ in faults}
for op, _, _ in faults:
    _C._inject_fault(op, 0)
recs = write()
out["rows"] = sum(r["rows"] for r in recs)
out["end"] = max(c["offset"] + c["length"] for r in recs for c in r["columns"])
out["size"] = os.path.getsize(path)
print(json.dumps(out))
"""


@pytest.mark.parametrize("n,faults", [
    # 2 MB staged: the worker's last drain hands it to the pwrite thread, making the vector of that one write
    pytest.param(20_000, [("alloc", 1, 0)], id="worker-drain-vector"),
    # ... whose pwrite fails, and the pwrite thread builds the error's message
    pytest.param(20_000, [("write", 1, errno.EIO), ("alloc", 2, 0)], id="pwrite-thread-message"),
    # 100 KB staged: the drain writes it on the worker, which builds the failed pwrite's message
    pytest.param(1_000, [("write", 1, errno.EIO), ("alloc", 1, 0)], id="worker-drain-message"),
])
def test_writer_out_of_memory_in_a_writer_thread_fails_the_write(tmp_path, n, faults):
    """std::bad_alloc in the pwrite thread or in the worker's last drain fails the write with ENOMEM naming
    the file; it used to leave the thread and std::terminate the process (the training job). Run in a child
    process so that such a regression is a failed test, not a killed test run."""
    path = str(tmp_path / "f.bin")
    p = subprocess.run([sys.executable, "-c", _FAULTED_WRITE, path, str(n), json.dumps(faults)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"the writer ended the process (return code {p.returncode}): {p.stderr[-3000:]}"
    out = json.loads(p.stdout)
    assert out["seen"] == {op: at for op, at, _ in faults}, "each fault fired where the test means it to"
    assert out["error"] is not None, "the write failed"
    err, filename, msg = out["error"]
    assert err == errno.ENOMEM and filename == path, out
    assert "out of memory" in msg and path in msg, msg
    assert out["rows"] == n and out["size"] == out["end"], "the next write, without the fault, succeeded"


def _fds_under(root) -> list[str]:
    """The files under `root` this process holds open (other tests' threads may open and close others)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # closed meanwhile
            continue
        if target.startswith(str(root) + os.sep):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads open descriptors in /proc/self/fd (Linux)")
@pytest.mark.parametrize("what,error,opened", [("out of memory", MemoryError, 3), ("same file", ValueError, 2),
                                              ("cannot create", OSError, 2)])
def test_writer_constructor_that_fails_midway_closes_the_files_it_opened(tmp_path, what, error, opened):
    """A ShardWriter whose constructor fails after opening some of its files closes them: a save that retries
    after running out of memory (or on a bad path) must not leak a descriptor per file each time."""
    paths = [str(tmp_path / f"f{i}") for i in range(4)]
    if what == "same file":
        open(paths[0], "wb").close()
        os.link(paths[0], paths[2])
    elif what == "cannot create":
        paths[2] = str(tmp_path / "no-such-dir" / "f2")
    _C._inject_fault("setup", 3 if what == "out of memory" else 0)   # (0: off, and counts files set up)
    try:
        with pytest.raises(error) as ei:
            _C.ShardWriter(paths, 8, 64, 1 << 20)
        assert _C._fault_seen("setup") == opened, "files were open when the constructor failed"
    finally:
        _C._inject_fault("setup", 0)
    if what == "cannot create":
        assert ei.value.errno == errno.ENOENT and paths[2] in str(ei.value)
    assert _fds_under(tmp_path) == [], "every file the constructor opened is closed again"


def test_writer_abort_keeps_files_and_stops(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    w = _C.ShardWriter(paths, 8, 64, 1 << 30)
    for _ in range(10):
        w.submit(0, np.arange(10_000, dtype=np.int64), [np.zeros((10_000, 32), np.uint8)])
    w.abort()
    w.abort()  # idempotent
    assert all(os.path.exists(p) for p in paths)
    with pytest.raises(RuntimeError):
        w.submit(0, np.arange(3, dtype=np.int64), [])
    with pytest.raises(RuntimeError):
        w.finish()


def test_writer_accepts_pathlike_and_concurrent_submitters(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    w = _C.ShardWriter(paths, 32, 128, 1 << 16)
    rng = np.random.default_rng(5)
    segs = [make_segment(rng, 2000, (8,)) for _ in range(16)]
    got = {}
    lock = threading.Lock()

    def run(k):
        for i in range(k, len(segs), 4):
            sid = w.submit(i, segs[i][0], segs[i][1])
            with lock:
                got[sid] = (segs[i][0], segs[i][1], i)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = w.finish()
    assert len(got) == len(segs)
    for p, recs in zip(paths, records):
        check_file(str(p), recs, got, 32, 128)


# ------------------------------------------------------------------------------------------ read_ranges
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One shard file with a few columns; chunk_bytes 100 (odd sizes so chunks split rows)."""
    d = tmp_path_factory.mktemp("rr")
    path = str(d / "shard.bin")
    records, segments = write_segments([path], 16, 100, [(0, 3000, (3, 8, 256)), (1, 0, (4,)), (2, 1, (5,))])
    cols = []
    for r in records[0]:
        _, expected = expected_segment(segments[r["segment"]][0], segments[r["segment"]][1], 16)
        for c, exp in zip(r["columns"], expected):
            cols.append((c, exp))
    return path, cols


def req(path, col, lo, hi, chunk=None, dst=None, crcs=None):
    if dst is None:
        dst = np.empty(hi - lo, np.uint8)
    if crcs is None:
        crcs = np.array(col["crc32c"], np.uint32)
    return (path, col["offset"], col["length"], col["step"] if chunk is None else chunk, crcs, lo, hi, dst)


def chunk_expanded(lo, hi, length, chunk):
    if lo == hi:
        return 0
    a = lo // chunk * chunk
    b = min(length, -(-hi // chunk) * chunk)
    return b - a


@SETTINGS
@given(data=st.data(), threads=st.sampled_from([1, 2, 4]), readahead=st.sampled_from([0, 1, 150, 64 << 20]))
def test_read_ranges_subranges(written, data, threads, readahead):
    path, cols = written
    picks = data.draw(st.lists(st.integers(0, len(cols) - 1), min_size=1, max_size=6))
    reqs, exps, total = [], [], 0
    for k in picks:
        col, exp = cols[k]
        lo = data.draw(st.integers(0, col["length"]))
        hi = data.draw(st.integers(lo, col["length"]))
        reqs.append(req(path, col, lo, hi))
        exps.append(exp[lo:hi])
        total += chunk_expanded(lo, hi, col["length"], 100)
    nbytes, errors = _C.read_ranges(reqs, threads, readahead_bytes=readahead)
    assert errors == []
    assert nbytes == total
    for r, e in zip(reqs, exps):
        assert r[7].tobytes() == e


def test_read_ranges_whole_columns_and_list_crcs(written):
    path, cols = written
    reqs = [req(path, c, 0, c["length"], crcs=list(c["crc32c"])) for c, _ in cols]
    nbytes, errors = _C.read_ranges(reqs, 3)
    assert errors == []
    assert nbytes == sum(c["length"] for c, _ in cols)
    for r, (_, e) in zip(reqs, cols):
        assert r[7].tobytes() == e


def test_read_ranges_dst_outside_range_untouched(written):
    # Partial chunks are read into scratch: dst gets exactly [lo, hi), nothing around it is written,
    # and a typed (int64) destination works.
    path, cols = written
    col, exp = cols[3]  # 3000 x 8-byte column, chunks of 100 bytes
    guard = np.full(14, -7, np.int64)
    dst = guard[2:12]  # 80 bytes: column bytes [88, 168) straddle chunks 0 and 1
    nbytes, errors = _C.read_ranges([req(path, col, 88, 168, dst=dst)], 1)
    assert errors == []
    assert dst.tobytes() == exp[88:168]
    assert (guard[:2] == -7).all() and (guard[12:] == -7).all()
    assert nbytes == chunk_expanded(88, 168, col["length"], 100) == 200


@pytest.mark.parametrize("readahead", [0, 1, 20 << 20, -5])  # -5: treated as 0 (off)
def test_read_ranges_large_request_split_across_threads(tmp_path, readahead):
    # 76.8 MB in 8 MiB pieces: the read-ahead hints run ahead of the threads over many pieces.
    path = str(tmp_path / "big")
    n = 300_000
    records, segments = write_segments([path], 4, 64 << 10, [(0, n, (64,))])
    col = records[0][0]["columns"][1]
    _, expected = expected_segment(segments[0][0], segments[0][1], 4)
    lo, hi = 12345, col["length"] - 999
    dst = np.empty(hi - lo, np.uint8)
    nbytes, errors = _C.read_ranges([req(path, col, lo, hi, chunk=64 << 10, dst=dst)], 4, readahead_bytes=readahead)
    assert errors == []
    assert dst.tobytes() == expected[1][lo:hi]
    assert nbytes == chunk_expanded(lo, hi, col["length"], 64 << 10)


def test_read_ranges_crc_error_names_chunk(tmp_path):
    path = str(tmp_path / "c")
    records, _ = write_segments([path], 4, 100, [(0, 500, (16,))])
    col = records[0][0]["columns"][1]  # 8000 bytes, 80 chunks
    with open(path, "r+b") as f:
        f.seek(col["offset"] + 7 * 100 + 42)  # a byte of chunk 7
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    reqs = [
        req(path, col, 7 * 100 + 5, 7 * 100 + 6),  # one byte of chunk 7: whole chunk checked
        req(path, col, 0, 700),  # chunks 0..6: fine
        req(path, col, 800, col["length"]),  # chunks 8..: fine
        req(path, col, 650, 900),  # straddles chunk 7
    ]
    nbytes, errors = _C.read_ranges(reqs, 2)
    assert [i for i, _ in errors] == [0, 3]
    for _, msg in errors:
        assert "CRC mismatch in chunk 7" in msg
    assert reqs[1][7].tobytes() == open(path, "rb").read()[col["offset"] : col["offset"] + 700]


def test_read_ranges_truncated_and_missing_files(tmp_path):
    path = str(tmp_path / "t")
    records, _ = write_segments([path], 4, 100, [(0, 500, (16,))])
    col = records[0][0]["columns"][1]
    os.truncate(path, col["offset"] + col["length"] - 1)
    nbytes, errors = _C.read_ranges([req(path, col, 0, 10), req(str(tmp_path / "nope"), col, 0, 10)], 2)
    assert nbytes == 0
    assert errors[0][0] == 0 and "file too small" in errors[0][1]
    assert errors[1][0] == 1 and "open error" in errors[1][1] and "No such file" in errors[1][1]


def test_read_ranges_invalid_requests_reported(written):
    path, cols = written
    col, exp = cols[1]
    good = req(path, col, 10, 50)
    bad = [
        req(path, col, 50, 10, dst=np.empty(0, np.uint8)),  # lo > hi
        req(path, col, 0, col["length"] + 1),  # hi > length
        req(path, col, -1, 5, dst=np.empty(6, np.uint8)),  # lo < 0
        req(path, col, 0, 10, crcs=np.array(col["crc32c"][:-1], np.uint32)),  # wrong crcs length
        req(path, col, 0, 10, dst=np.empty(9, np.uint8)),  # wrong dst size
        req(path, col, 0, 10, chunk=0),  # bad chunk size
        req(path, col, 0, 10, crcs=[-1] + list(col["crc32c"][1:])),  # not a uint32
    ]
    nbytes, errors = _C.read_ranges([good] + bad, 2)
    assert [i for i, _ in errors] == list(range(1, len(bad) + 1))
    msgs = [m for _, m in errors]
    assert "lo <= hi" in msgs[0] and "lo <= hi" in msgs[1] and "0 <= lo" in msgs[2]
    assert "crcs has" in msgs[3] and "dst has 9 bytes" in msgs[4] and "chunk_bytes" in msgs[5]
    assert "uint32" in msgs[6]
    assert good[7].tobytes() == exp[10:50]
    assert nbytes == 100  # only the good request read (chunk 0)


def test_read_ranges_bad_argument_types_raise(written):
    path, cols = written
    col, _ = cols[1]
    with pytest.raises(TypeError):
        _C.read_ranges([("only", "three", "items")], 1)
    with pytest.raises(TypeError, match="writable"):
        _C.read_ranges([req(path, col, 0, 4, dst=b"1234")], 1)
    with pytest.raises(TypeError):
        _C.read_ranges([req(path, col, "0", 4)], 1)
    with pytest.raises(ValueError, match="contiguous"):
        _C.read_ranges([req(path, col, 0, 4, dst=np.empty(8, np.uint8)[::2])], 1)


def test_read_ranges_empty(written):
    path, cols = written
    col, _ = cols[1]
    assert _C.read_ranges([], 4) == (0, [])
    assert _C.read_ranges([req(path, col, 5, 5)], 4) == (0, [])


def test_writer_row_range_buckets_follow_rows(tmp_path):
    """num_rows = N: bucket = row * B // N (format version 4's row_range), ids outside [0, N) refused."""
    p = str(tmp_path / "rr")
    records, segments = write_segments([p], 16, 100, [(0, 500, (4,)), (1, 3, (8,))], num_rows=1000)
    check_file(p, records[0], segments, 16, 100, num_rows=1000)
    w = _C.ShardWriter([str(tmp_path / "bad")], 16, 100, 1 << 20)
    for bad in (-1, 1000):
        with pytest.raises(ValueError, match="not a row"):
            w.submit(0, np.array([0, bad], np.int64), [], 1000)
    w.abort()
    np.testing.assert_array_equal(_C.bucket_of(np.array([0, 999, 1000, -1], np.int64), 16, 1000), [0, 15, -1, -1])


# ------------------------------------------------------------------------------- many segments at once
@pytest.mark.parametrize("nfiles", [1, 3])
def test_writer_submit_many_writes_what_submit_writes(tmp_path, nfiles):
    """A batch of small segments (many small tables) queued in one call: every byte, record and segment
    id as if submitted one by one, in order."""
    rng = np.random.default_rng(7)
    specs = [(t, int(rng.integers(1, 300)), (4, 64, 64)) for t in range(120)] + [(500, 3000, (8,))]
    segs = [(t, *make_segment(rng, n, rbs)) for t, n, rbs in specs]
    paths = [str(tmp_path / f"f{k}") for k in range(nfiles)]
    w = _C.ShardWriter(paths, 256, 4096, 1 << 30)
    ids_a = w.submit_many([(t, ids, cols, 0, 0) for t, ids, cols in segs[:70]])
    ids_b = w.submit_many([(t, ids, cols, 0, 0) for t, ids, cols in segs[70:]])
    assert list(ids_a) + list(ids_b) == list(range(len(segs)))
    records = w.finish()
    for path, recs in zip(paths, records):
        check_file(path, recs, {i: (ids, cols, t) for i, (t, ids, cols) in enumerate(segs)}, 256, 4096)
    assert sum(len(r) for r in records) == len(segs)


def test_writer_submit_many_checks_every_segment_before_queueing_any(tmp_path):
    rng = np.random.default_rng(8)
    good = make_segment(rng, 10, (8,))
    w = _C.ShardWriter([str(tmp_path / "f")], 64, 4096, 1 << 30)
    with pytest.raises(ValueError, match="rows, ids has"):
        w.submit_many([(0, *good, 0, 0), (1, good[0], [np.zeros((9, 8), np.uint8)], 0, 0)])
    assert w.finish() == [[]]   # nothing was queued
    assert os.path.getsize(tmp_path / "f") == 0


@pytest.mark.parametrize("threads", [1, 4])
def test_row_digests_many_equals_one_call_per_job(threads):
    rng = np.random.default_rng(9)
    jobs = []
    for k in range(200):
        n = int(rng.integers(0, 50)) if k != 7 else 20000
        ids = rng.integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64)
        specs, cols = [], []
        for itemsize, width, full, first in [(4, 16, 16, 0), (2, 3, 8, 5), (8, 1, 1, 0)][: 1 + k % 3]:
            cols.append(rng.integers(0, 256, size=(n, itemsize * width), dtype=np.uint8))
            specs.append((itemsize * width, itemsize, width, full, first))
        jobs.append((ids, cols, specs))
    got = _C.row_digests_many(jobs, threads)
    want = np.concatenate([_C.row_digests(ids, cols, specs, 1) for ids, cols, specs in jobs])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="job 1: column 0 holds"):
        _C.row_digests_many([jobs[0], (jobs[1][0], [c[:-1] for c in jobs[1][1]], jobs[1][2])], threads)
