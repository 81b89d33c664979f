"""The engine's O_DIRECT reads (read_ranges(direct=...), ReadOptions.direct_reads; docs/ENGINE.md).

A cold load reads shard files past the page cache: straight into the destination when its chunks land
block-aligned, else through an aligned buffer per thread, checked and copied in cache-sized steps. Every
way must return the same bytes, the same byte count and the same errors as a read through the page cache;
a file system that refuses direct reads must be read through the cache instead; "auto" must read
directly exactly what is not cached."""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest
import torch

from helpers.pagecache import drop_cache
from recckpt import _C, HashTable, Saver
from recckpt.errors import CorruptCheckpointError, InvalidArgumentError
from recckpt.format.sparse_io import ReadOptions

NEVER, AUTO, ALWAYS = _C.DIRECT_NEVER, _C.DIRECT_AUTO, _C.DIRECT_ALWAYS


def make_file(path, size, seed=0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def column(data: bytes, offset: int, length: int, chunk: int) -> dict:
    return {"offset": offset, "length": length, "chunk": chunk,
            "crcs": _C.crc32c_chunks(np.frombuffer(data[offset:offset + length], np.uint8), chunk)}


def request(path, col, lo, hi, dst):
    return (path, col["offset"], col["length"], col["chunk"], col["crcs"], lo, hi, dst)


def aligned(n: int, shift: int = 0) -> np.ndarray:
    """n writable bytes starting `shift` bytes after a page boundary (the mapping lives with the array)."""
    m = mmap.mmap(-1, n + shift + 4096)
    return np.frombuffer(m, np.uint8)[shift:shift + n]


def read(reqs, direct, threads=2):
    _C._inject_fault("direct", 0)   # resets the count of direct reads
    out = _C.read_ranges(reqs, threads, direct=direct)
    return out, _C._fault_seen("direct")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("direct") / "shard.bin")
    data = make_file(path, 30 << 20)
    return path, data


# (offset, length, chunk, dst shift): aligned columns read straight into aligned memory (with a tail that
# is not a whole block), unaligned columns or destinations through the bounce buffer, and a single chunk
# bigger than the bounce buffer (its crc summed across blocks).
CASES = [
    (8192, (3 << 20) + 123, 64 << 10, 0),
    (8192, (3 << 20) + 123, 64 << 10, 64),
    (5000, (2 << 20) + 7, 100_000, 0),
    (4096, (20 << 20) + 5, (20 << 20) + 5, 0),
    (4096, (20 << 20) + 5, (20 << 20) + 5, 16),
    (12288, 1 << 20, 1 << 20, 0),
]


@pytest.mark.parametrize("offset,length,chunk,shift", CASES)
@pytest.mark.parametrize("threads", [1, 4])
def test_direct_reads_return_what_the_page_cache_returns(shard, offset, length, chunk, shift, threads):
    path, data = shard
    col = column(data, offset, length, chunk)
    ref_dst, dst = np.empty(length, np.uint8), aligned(length, shift)
    (n_ref, e_ref), _ = read([request(path, col, 0, length, ref_dst)], NEVER, threads)
    (n, e), direct_reads = read([request(path, col, 0, length, dst)], ALWAYS, threads)
    assert e == e_ref == []
    assert n == n_ref == length
    assert dst.tobytes() == ref_dst.tobytes() == data[offset:offset + length]
    assert direct_reads >= 1   # the direct path ran, not a silent fallback


def test_direct_partial_ranges_equal_cached_reads(shard):
    path, data = shard
    rng = np.random.default_rng(3)
    for offset, length, chunk, shift in CASES:
        col = column(data, offset, length, chunk)
        for _ in range(6):
            lo = int(rng.integers(0, length))
            hi = int(rng.integers(lo, length + 1))
            a, b = np.empty(hi - lo, np.uint8), aligned(hi - lo, shift)
            (na, ea), _ = read([request(path, col, lo, hi, a)], NEVER)
            (nb, eb), _ = read([request(path, col, lo, hi, b)], ALWAYS)
            assert ea == eb == [] and na == nb
            assert b.tobytes() == a.tobytes() == data[offset + lo:offset + hi]


def test_direct_reads_leave_memory_around_the_destination_alone(shard):
    path, data = shard
    col = column(data, 8192, 1 << 20, 64 << 10)
    buf = aligned((1 << 20) + 8192)
    buf[:] = 0xAB
    dst = buf[4096:4096 + 300_000]    # aligned start, rows [1000, 301000) of the column
    (_, errors), _ = read([request(path, col, 1000, 301_000, dst)], ALWAYS)
    assert errors == []
    assert dst.tobytes() == data[8192 + 1000:8192 + 301_000]
    assert (buf[:4096] == 0xAB).all() and (buf[4096 + 300_000:] == 0xAB).all()


@pytest.mark.parametrize("shift", [0, 64])
@pytest.mark.parametrize("big_chunk", [False, True])
def test_a_corrupt_chunk_fails_a_direct_read_as_it_fails_a_cached_one(tmp_path, shift, big_chunk):
    path = str(tmp_path / "c.bin")
    data = bytearray(make_file(path, 12 << 20, seed=1))
    chunk = (10 << 20) + 3 if big_chunk else 64 << 10
    col = column(bytes(data), 4096, (10 << 20) + 3, chunk)
    bad = 4096 + (9 << 20) + 17          # a byte inside chunk 0 (big) or chunk 144 (64 KiB chunks)
    with open(path, "r+b") as f:
        f.seek(bad)
        f.write(bytes([data[bad] ^ 1]))
    want = f"CRC mismatch in chunk {0 if big_chunk else (9 << 20) // (64 << 10)}"
    msgs = []
    for direct in (NEVER, ALWAYS):
        (_, errors), _ = read([request(path, col, 0, col["length"], aligned(col["length"], shift))], direct)
        assert len(errors) == 1 and want in errors[0][1], errors
        msgs.append(errors[0][1])
    assert msgs[0] == msgs[1]   # the same words, chunk and offsets, whichever way the bytes came


def test_a_refused_direct_read_is_read_through_the_page_cache(shard):
    path, data = shard
    col = column(data, 8192, 4 << 20, 64 << 10)
    dst = aligned(4 << 20)
    _C._inject_fault("direct", 1, errno.EINVAL)   # e.g. a file system whose O_DIRECT needs other alignment
    try:
        n, errors = _C.read_ranges([request(path, col, 0, 4 << 20, dst)], 1, direct=ALWAYS)
    finally:
        _C._inject_fault("direct", 0)
    assert errors == [] and n == 4 << 20
    assert dst.tobytes() == data[8192:8192 + (4 << 20)]


def test_a_direct_read_error_is_reported_naming_the_chunk(shard):
    path, data = shard
    col = column(data, 8192, 4 << 20, 64 << 10)
    _C._inject_fault("direct", 1, errno.EIO)
    try:
        _, errors = _C.read_ranges([request(path, col, 0, 4 << 20, aligned(4 << 20, 8))], 1, direct=ALWAYS)
    finally:
        _C._inject_fault("direct", 0)
    assert len(errors) == 1
    assert "read error in chunk 0" in errors[0][1] and "direct read" in errors[0][1]
    assert "Input/output error" in errors[0][1]


@pytest.mark.parametrize("no_cachestat", [False, True])
def test_auto_reads_directly_what_is_not_cached_and_through_the_cache_what_is(tmp_path, no_cachestat):
    # no_cachestat: the kernel's cachestat is made to fail, so the cache is asked with mincore.
    path = str(tmp_path / "a.bin")
    data = make_file(path, 24 << 20, seed=2)
    col = column(data, 0, 24 << 20, 256 << 10)

    def auto_read():
        if no_cachestat:
            _C._inject_fault("cachestat", 1, errno.ENOSYS)
        dst = aligned(24 << 20)
        try:
            _C._inject_fault("direct", 0)
            n, errors = _C.read_ranges([request(path, col, 0, 24 << 20, dst)], 2, direct=AUTO)
            seen = _C._fault_seen("direct")
        finally:
            _C._inject_fault("cachestat", 0)
        assert errors == [] and n == 24 << 20 and dst.tobytes() == data
        return seen

    drop_cache(path)
    assert auto_read() >= 3            # cold: the pieces went past the page cache
    with open(path, "rb") as f:        # now every page is cached
        while f.read(8 << 20):
            pass
    assert auto_read() == 0            # warm: all through the cache


def test_auto_reads_small_pieces_through_the_page_cache_even_when_cold(tmp_path):
    """Many small columns (a model of many small tables): under auto, a piece under 256 KiB is read through
    the page cache without asking the cache or the device about it first; the large column beside them,
    cold, still goes past the cache. Bytes and checks are the same either way."""
    path = str(tmp_path / "small.bin")
    data = make_file(path, 8 << 20, seed=3)
    small = [column(data, k * 40_000, 40_000, 4096) for k in range(50)]   # 2 MB of 40 kB columns
    big = column(data, 4 << 20, 4 << 20, 256 << 10)
    dsts = [np.zeros(40_000, np.uint8) for _ in small]
    drop_cache(path)
    (n, errors), seen = read([request(path, c, 0, 40_000, d) for c, d in zip(small, dsts)], AUTO)
    assert errors == [] and n == 50 * 40_000 and seen == 0
    assert b"".join(d.tobytes() for d in dsts) == data[:2_000_000]
    drop_cache(path)   # (the small reads' read-ahead may have cached some of the big column)
    dst = aligned(4 << 20)
    (n, errors), seen = read([request(path, big, 0, 4 << 20, dst)], AUTO)
    assert errors == [] and seen >= 1 and dst.tobytes() == data[4 << 20:8 << 20]
    bad = bytearray(data)
    bad[3 * 40_000 + 7] ^= 1
    open(path, "wb").write(bytes(bad))
    drop_cache(path)
    (n, errors), _ = read([request(path, c, 0, 40_000, np.zeros(40_000, np.uint8)) for c in small], AUTO)
    assert [i for i, _ in errors] == [3] and "CRC mismatch in chunk 0" in errors[0][1]


def test_read_options_direct_reads_is_checked():
    assert ReadOptions().direct_reads == "auto"
    assert ReadOptions(direct_reads="never").engine_direct == NEVER
    with pytest.raises(InvalidArgumentError, match="direct_reads"):
        ReadOptions(direct_reads="sometimes")
    with pytest.raises(ValueError, match="direct"):
        _C.read_ranges([], 1, direct=7)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", dim=64)
        self.mlp = torch.nn.Linear(1000, 1001)   # ~4 MB of dense tensors: dense.safetensors is read by the engine


def test_a_cold_load_through_direct_reads_is_exact_and_checked(tmp_path):
    src = _Model()
    src.emb(torch.arange(60_000, dtype=torch.int64) * 7919)    # ~16 MB of rows
    Saver(src, output_dir=str(tmp_path / "ck")).save("c")
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ck" / "c") for f in fs]
    for mode in ("always", "auto", "never"):
        for f in files:
            drop_cache(f)
        dst = _Model()
        Saver(dst, output_dir=str(tmp_path / "ck"), read_options=ReadOptions(direct_reads=mode)).load(ckpt_id="c")
        ids = torch.arange(60_000, dtype=torch.int64) * 7919
        assert torch.equal(dst.emb.read_rows("embedding", dst.emb.lookup(ids)),
                           src.emb.read_rows("embedding", src.emb.lookup(ids))), mode
        assert torch.equal(dst.mlp.weight, src.mlp.weight) and torch.equal(dst.mlp.bias, src.mlp.bias), mode
    shard = max((f for f in files if f.endswith(".bin")), key=os.path.getsize)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    drop_cache(shard)
    with pytest.raises(CorruptCheckpointError, match="CRC mismatch") as e:
        Saver(_Model(), output_dir=str(tmp_path / "ck"),
              read_options=ReadOptions(direct_reads="always")).load(ckpt_id="c")
    assert "'emb'" in str(e.value)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_corrupt_dense_file_is_refused_before_the_model_changes(tmp_path, mode):
    src = _Model()
    Saver(src, output_dir=str(tmp_path / "ck")).save("c")
    dense = tmp_path / "ck" / "c" / "dense.safetensors"
    with open(dense, "r+b") as f:
        f.seek(os.path.getsize(dense) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    drop_cache(str(dense))
    dst = _Model()
    before = dst.mlp.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match="dense.safetensors.*crc32c mismatch"):
        Saver(dst, output_dir=str(tmp_path / "ck"), read_options=ReadOptions(direct_reads=mode)).load(ckpt_id="c")
    assert torch.equal(dst.mlp.weight, before)
