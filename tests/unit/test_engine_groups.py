"""The engine's format version 5 pieces (docs/ENGINE.md): ShardWriter's column groups and row runs, and
read_strided, which places column groups (or a window of their columns) into rows. Every byte written is
compared with a numpy expectation; every read with the source rows."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from helpers.pagecache import drop_cache
from recckpt import _C

B = 64


def groups_of(rb: int, gb: int) -> list[tuple[int, int]]:
    """[start, end) bytes of each column group of a row of rb bytes (groups of gb, the last narrower)."""
    return [(g, min(rb, g + gb)) for g in range(0, rb, gb)]


def write(path, segments, *, num_rows=0, runs=False, group_bytes=(), chunk_bytes=1 << 18):
    """segments: [(ids, [uint8 [n, rb] columns])]; returns the writer's records of the one file."""
    w = _C.ShardWriter([path], B, chunk_bytes, 1 << 30)
    for t, (ids, cols) in enumerate(segments):
        w.submit(t, ids, cols, num_rows, 0, list(group_bytes), runs)
    return w.finish(False)[0]


def rows(n, rb, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, rb), dtype=np.uint8)


@pytest.mark.parametrize("n,rb,gb", [(10, 24, 16), (3000, 96, 16), (40_000, 256, 16), (9000, 40, 12),
                                     (50_000, 96, 32), (3, (9 << 20) + 8, 1 << 20)])
@pytest.mark.parametrize("in_order", [True, False])
def test_grouped_columns_hold_each_group_of_each_row(tmp_path, n, rb, gb, in_order):
    """Small slots go group by group through the staging buffer, slots of 1 MiB or more by blocks of rows
    (40 000 x 256 and 50 000 x 96), and a row larger than the 8 MiB staging buffer group by group again
    (it was gathered past the buffer's end): either way group k's column is bytes [k*gb, ...) of every row in
    bucket order, checksummed in its own steps, and only the slot's first group is padded."""
    ids = np.arange(5, 5 + n, dtype=np.int64)
    if not in_order:
        ids = np.random.default_rng(1).permutation(ids)
    emb, acc = rows(n, rb, 1), rows(n, 4, 2)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(ids, [emb, acc])], num_rows=n + 10, group_bytes=[gb, 0])
    data = open(path, "rb").read()
    order = np.argsort(ids * B // (n + 10), kind="stable")
    cols = r["columns"]
    gs = groups_of(rb, gb)
    assert len(cols) == 1 + len(gs) + 1
    np.testing.assert_array_equal(np.frombuffer(data[cols[0]["offset"]:cols[0]["offset"] + 8 * n], "<i8"), ids[order])
    want = [emb[order][:, a:b] for a, b in gs] + [acc[order]]
    pos = cols[0]["offset"] + cols[0]["length"]
    for k, (c, exp) in enumerate(zip(cols[1:], want)):
        if k in (0, len(gs)) and not r["packed"]:   # a slot's first column is aligned, the other groups are not
            pos += -pos % 4096
        assert c["offset"] == pos, k
        got = data[c["offset"]:c["offset"] + c["length"]]
        assert got == exp.tobytes(), k
        step = _C.column_step(len(got), 1 << 18)
        assert c["step"] == step
        assert list(c["crc32c"]) == [_C.crc32c(got[i:i + step]) for i in range(0, len(got), step)]
        pos += c["length"]
    assert pos == len(data)


def test_row_runs_store_no_ids_and_no_directory(tmp_path):
    """A row_range segment whose ids are [id0, id0 + n) in order is a run (with runs=True): no directory,
    no ids, the buckets of its first and last ids recorded. Anything else stores both."""
    n, N = 1000, 100_000
    emb = rows(n, 8)
    path = str(tmp_path / "f.bin")
    run = np.arange(777, 777 + n, dtype=np.int64)
    gap = run.copy()
    gap[500:] += 1
    recs = write(path, [(run, [emb]), (gap, [emb]), (run[::-1].copy(), [emb])], num_rows=N, runs=True)
    plain = write(str(tmp_path / "g.bin"), [(run, [emb])], num_rows=N, runs=False)
    hashed = write(str(tmp_path / "h.bin"), [(run, [emb])], runs=True)
    r = recs[0]
    assert r["id0"] == 777 and r["dir"] == 0 and r["buckets"]["length"] == 0
    assert (r["first"], r["last"]) == (777 * B // N, (777 + n - 1) * B // N)
    assert r["columns"][0]["length"] == 0 and r["columns"][1]["offset"] == r["offset"]
    data = open(path, "rb").read()
    assert data[r["columns"][1]["offset"]:r["columns"][1]["offset"] + 8 * n] == emb.tobytes()
    for other in (recs[1], recs[2], plain[0], hashed[0]):
        assert other["id0"] == -1 and other["dir"] >= 1 and other["columns"][0]["length"] == 8 * n


def _parts(r, gs, take=None):
    """read_strided parts placing `gs` groups (of columns 1..) side by side; `take`: (a, b) bytes of a row."""
    out = []
    a, b = take or (0, gs[-1][1])
    for k, (g0, g1) in enumerate(gs):
        x0, x1 = max(a, g0), min(b, g1)
        if x1 <= x0:
            continue
        c = r["columns"][1 + k]
        out.append((c["offset"], c["length"], c["step"], c["crc32c"], g1 - g0, x0 - g0, x1 - x0, x0 - a, 0))
    return out


@pytest.mark.parametrize("chunk_bytes", [512, 1 << 18])
@pytest.mark.parametrize("r0,r1,take", [(0, 50_000, None), (0, 50_000, (24, 56)), (3, 49_999, (20, 61)),
                                        (12_345, 12_346, None), (100, 40_000, (0, 4))])
def test_read_strided_places_groups_into_rows(tmp_path, chunk_bytes, r0, r1, take):
    """Rows [r0, r1) of every group (or of the groups holding bytes [a, b) of a row, cut at their edges)
    come back as rows, whatever chunk steps, blocks and thread split."""
    n, rb, gb = 50_000, 96, 16
    emb = rows(n, rb)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[gb],
                 chunk_bytes=chunk_bytes)
    a, b = take or (0, rb)
    dst = np.full((r1 - r0, b - a), 7, np.uint8)
    nread, errors = _C.read_strided([(path, r0, r1, dst.reshape(-1), b - a, _parts(r, groups_of(rb, gb), take))], 3)
    assert errors == []
    np.testing.assert_array_equal(dst, emb[r0:r1, a:b])
    touched = sum(1 for g0, g1 in groups_of(rb, gb) if g0 < b and g1 > a) * gb * (r1 - r0)
    assert touched <= nread <= touched + 2 * len(groups_of(rb, gb)) * max(r["columns"][1]["step"], 512)


def test_read_strided_into_a_wider_destination(tmp_path):
    """dst_stride larger than the bytes placed: the rest of each destination row is left alone."""
    n, rb = 1000, 32
    emb = rows(n, rb)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[8])
    dst = np.full((n, 40), 9, np.uint8)
    parts = [(c, ln, st, crc, w, s, nb, d + 4, p) for c, ln, st, crc, w, s, nb, d, p in _parts(r, groups_of(rb, 8))]
    _, errors = _C.read_strided([(path, 0, n, dst.reshape(-1), 40, parts)], 2)
    assert errors == []
    np.testing.assert_array_equal(dst[:, 4:36], emb)
    assert (dst[:, :4] == 9).all() and (dst[:, 36:] == 9).all()


def test_read_strided_never_places_unverified_bytes(tmp_path):
    """A flipped byte in one group: the error names the part, the chunk and the file offset, and the rows of
    the failing block are not written (blocks read and checked before placing)."""
    n, rb, gb = 2000, 32, 16
    emb = rows(n, rb)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[gb],
                 chunk_bytes=1024)
    bad = r["columns"][2]
    with open(path, "r+b") as f:
        f.seek(bad["offset"] + 100)
        x = f.read(1)
        f.seek(bad["offset"] + 100)
        f.write(bytes([x[0] ^ 1]))
    dst = np.full((n, rb), 7, np.uint8)
    _, errors = _C.read_strided([(path, 0, n, dst.reshape(-1), rb, _parts(r, groups_of(rb, gb)))], 1)
    assert len(errors) == 1 and errors[0][0] == 0
    msg = errors[0][1]
    assert "part 1" in msg and "CRC mismatch in chunk 0" in msg and f"file offset {bad['offset']}" in msg
    assert (dst[:64] == 7).all(), "rows of the failing block were placed"


def test_read_strided_checks_padding_from_row_0(tmp_path):
    n = 5000
    emb = rows(n, 32)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=False, group_bytes=[16])
    c = r["columns"][1]
    pad = c["offset"] - (r["columns"][0]["offset"] + r["columns"][0]["length"])
    assert pad > 0
    with open(path, "r+b") as f:
        f.seek(c["offset"] - 1)
        f.write(b"\x01")
    parts = [p[:-1] + (pad if k == 0 else 0,) for k, p in enumerate(_parts(r, groups_of(32, 16)))]
    dst = np.zeros((n, 32), np.uint8)
    _, errors = _C.read_strided([(path, 0, n, dst.reshape(-1), 32, parts)], 2)
    assert errors and "non-zero byte in the padding" in errors[0][1]
    dst = np.zeros((n - 1, 32), np.uint8)   # not from row 0: the padding is not read
    _, errors = _C.read_strided([(path, 1, n, dst.reshape(-1), 32, parts)], 2)
    assert errors == []


def test_read_strided_reports_bad_requests_and_files(tmp_path):
    n = 100
    emb = rows(n, 32)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[16])
    good = _parts(r, groups_of(32, 16))
    os.symlink(path, str(tmp_path / "link.bin"))
    short = str(tmp_path / "short.bin")
    open(short, "wb").write(open(path, "rb").read()[:-10])
    dst = np.zeros(n * 32, np.uint8)
    cases = [
        ((path, 0, n, dst[:-1], 32, good), "dst has"),
        ((path, 0, n + 1, np.zeros((n + 1) * 32, np.uint8), 32, good), "rows up to"),
        ((path, 0, n, dst, 32, [good[0][:4] + (15,) + good[0][5:], good[1]]), "width must"),
        ((path, 0, n, dst, 32, [good[0][:3] + (good[0][3][:-1],) + good[0][4:], good[1]]), "crcs has"),
        ((path, 0, n, dst, 32, [good[0][:7] + (20,) + good[0][8:]]), "dst <= dst + nbytes"),
        ((path, 0, n, dst, 32, []), "no parts"),
        ((str(tmp_path / "link.bin"), 0, n, dst, 32, good), "symbolic links"),   # never followed
        ((short, 0, n, dst, 32, good), "file too small"),
        ((str(tmp_path / "missing.bin"), 0, n, dst, 32, good), "open error"),
    ]
    _, errors = _C.read_strided([c for c, _ in cases], 2)
    assert [i for i, _ in errors] == list(range(len(cases)))
    for (i, msg), (_, want) in zip(errors, cases):
        assert want in msg, (i, msg)
    with pytest.raises(TypeError, match="must be a tuple"):
        _C.read_strided([(path, 0, n, dst, 32)])


def test_a_failed_write_of_groups_is_raised_naming_the_file(tmp_path):
    """A pwrite failure while a large grouped slot is written by blocks of rows surfaces from finish()."""
    n = 60_000
    path = str(tmp_path / "f.bin")
    w = _C.ShardWriter([path], B, 1 << 18, 1 << 30)
    _C._inject_fault("write", 3, errno.EIO)
    try:
        w.submit(0, np.arange(n, dtype=np.int64), [rows(n, 64)], n, 0, [16], True)
        with pytest.raises(OSError, match="f.bin") as e:
            w.finish(False)
        assert e.value.errno == errno.EIO
    finally:
        _C._inject_fault("write", 0)


# ------------------------------------------------------------------ read_strided with direct (O_DIRECT) reads
NEVER, AUTO, ALWAYS = _C.DIRECT_NEVER, _C.DIRECT_AUTO, _C.DIRECT_ALWAYS


def _strided(path, r, n, rb, gb, direct, r0=0, r1=None, take=None, threads=3):
    """read_strided of rows [r0, r1) (columns `take`) with `direct`: (dst, bytes read, errors, direct reads)."""
    r1 = n if r1 is None else r1
    a, b = take or (0, rb)
    dst = np.full((r1 - r0, b - a), 7, np.uint8)
    _C._inject_fault("direct", 0)   # resets the count of direct reads
    nread, errors = _C.read_strided([(path, r0, r1, dst.reshape(-1), b - a, _parts(r, groups_of(rb, gb), take))],
                                    threads, direct=direct)
    return dst, nread, errors, _C._fault_seen("direct")


@pytest.fixture(scope="module")
def grouped_file(tmp_path_factory):
    """60 000 rows of 96 bytes in groups of 16, one row run; chunks of 64 KiB (group columns start unaligned)."""
    n, rb, gb = 60_000, 96, 16
    emb = rows(n, rb, 5)
    path = str(tmp_path_factory.mktemp("strided") / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[gb],
                 chunk_bytes=64 << 10)
    return path, r, emb, n, rb, gb


@pytest.mark.parametrize("r0,r1,take", [(0, None, None), (3, 59_999, (20, 61)), (12_345, 12_346, (0, 16)),
                                        (100, 40_000, (32, 96))])
@pytest.mark.parametrize("threads", [1, 3])
def test_read_strided_direct_reads_return_what_the_page_cache_returns(grouped_file, r0, r1, take, threads):
    """Past the page cache (whole 4 KiB blocks around each group's chunks, into an aligned scratch) the rows,
    the bytes counted and the (absent) errors are those of a read through the cache."""
    path, r, emb, n, rb, gb = grouped_file
    ref, n_ref, e_ref, seen_ref = _strided(path, r, n, rb, gb, NEVER, r0, r1, take, threads)
    got, n_got, e_got, seen = _strided(path, r, n, rb, gb, ALWAYS, r0, r1, take, threads)
    a, b = take or (0, rb)
    assert e_ref == e_got == []
    np.testing.assert_array_equal(ref, emb[r0:(n if r1 is None else r1), a:b])
    np.testing.assert_array_equal(got, ref)
    assert n_got == n_ref
    assert seen_ref == 0 and seen >= 1   # the direct path ran, not a silent fallback


def test_read_strided_refused_direct_reads_go_through_the_page_cache(grouped_file):
    path, r, emb, n, rb, gb = grouped_file
    _C._inject_fault("direct", 1, errno.EINVAL)   # a file system whose O_DIRECT wants another alignment
    try:
        dst = np.zeros((n, rb), np.uint8)
        nread, errors = _C.read_strided([(path, 0, n, dst.reshape(-1), rb, _parts(r, groups_of(rb, gb)))], 2,
                                        direct=ALWAYS)
    finally:
        _C._inject_fault("direct", 0)
    assert errors == [] and nread >= n * rb
    np.testing.assert_array_equal(dst, emb)


def test_read_strided_direct_read_errors_name_the_part_and_leave_the_block_alone(grouped_file):
    path, r, emb, n, rb, gb = grouped_file
    _C._inject_fault("direct", 2, errno.EIO)
    dst = np.full((n, rb), 7, np.uint8)
    try:
        _, errors = _C.read_strided([(path, 0, n, dst.reshape(-1), rb, _parts(r, groups_of(rb, gb)))], 1,
                                    direct=ALWAYS)
    finally:
        _C._inject_fault("direct", 0)
    assert len(errors) == 1 and errors[0][0] == 0
    msg = errors[0][1]
    assert "part 1" in msg and "read error" in msg and "Input/output error" in msg and "direct read" in msg
    assert (dst[:1000] == 7).all(), "rows of the failing block were placed"


def _corrupt_copy(path, r, tmp_path, column, at, mask):
    """A copy of `path` with byte `at` of column `column` (1 + group) XORed with `mask`: (copy, the column)."""
    bad = str(tmp_path / "bad.bin")
    data = bytearray(open(path, "rb").read())
    col = r["columns"][column]
    data[col["offset"] + at] ^= mask
    open(bad, "wb").write(bytes(data))
    return bad, col


def test_read_strided_a_corrupt_chunk_fails_direct_reads_as_it_fails_cached_ones(grouped_file, tmp_path):
    path, r, emb, n, rb, gb = grouped_file
    bad, col = _corrupt_copy(path, r, tmp_path, 3, 70_000, 0x04)   # group 2
    want = f"part 2: CRC mismatch in chunk {70_000 // col['step']} "
    msgs = []
    for direct in (NEVER, ALWAYS):
        _, _, errors, _ = _strided(bad, r, n, rb, gb, direct, threads=1)
        assert len(errors) == 1 and want in errors[0][1], errors
        msgs.append(errors[0][1])
    assert msgs[0] == msgs[1]   # the same words, chunk and offset, whichever way the bytes came


@pytest.mark.parametrize("no_cachestat", [False, True])
def test_read_strided_auto_reads_directly_only_when_cold(grouped_file, tmp_path, no_cachestat):
    """direct=auto: a file not in the page cache is read past it, a cached one through it (asked with cachestat,
    or mincore where the kernel has none)."""
    path, r, emb, n, rb, gb = grouped_file
    copy = str(tmp_path / "copy.bin")
    open(copy, "wb").write(open(path, "rb").read())

    def auto_read():
        if no_cachestat:
            _C._inject_fault("cachestat", 1, errno.ENOSYS)
        try:
            dst, _, errors, seen = _strided(copy, r, n, rb, gb, AUTO)
        finally:
            _C._inject_fault("cachestat", 0)
        assert errors == []
        np.testing.assert_array_equal(dst, emb)
        return seen

    drop_cache(copy)
    assert auto_read() >= 1
    with open(copy, "rb") as f:   # every page cached
        while f.read(8 << 20):
            pass
    assert auto_read() == 0


def test_read_strided_direct_is_checked():
    with pytest.raises(ValueError, match="direct"):
        _C.read_strided([], 1, direct=7)


# ------------------------------------------- read_strided, cold through the page cache: file by file, swept
def _two_files(tmp_path):
    """Two files of two segments each (rows of 96 bytes in groups of 16, chunks of 64 KiB), and the requests
    reading every segment into a destination of its own, listed so that neither files nor offsets are in
    order: (requests, [(dst, expected rows)], paths)."""
    n, rb, gb = 30_000, 96, 16
    reqs, want, paths = [], [], []
    for f in range(2):
        path = str(tmp_path / f"f{f}.bin")
        segs = [(np.arange(n, dtype=np.int64), [rows(n, rb, 10 * f + s)]) for s in range(2)]
        recs = write(path, segs, num_rows=n, runs=True, group_bytes=[gb], chunk_bytes=64 << 10)
        paths.append(path)
        for r, (_, (emb,)) in zip(recs, segs):
            dst = np.full((n, rb), 7, np.uint8)
            reqs.append((path, 0, n, dst.reshape(-1), rb, _parts(r, groups_of(rb, gb))))
            want.append((dst, emb))
    order = [3, 0, 2, 1]
    return [reqs[i] for i in order], [want[i] for i in order], paths


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_read_strided_cold_reads_each_file_in_order_and_places_every_row(tmp_path, threads):
    """A cold read through the page cache goes file by file, each swept sequentially ahead of its blocks
    (docs/ENGINE.md): every row lands where its request says, as in a warm read, and only the cold read sweeps."""
    reqs, want, paths = _two_files(tmp_path)
    for temp in ("cold", "warm"):
        for dst, _ in want:
            dst.fill(7)
        if temp == "cold":
            for p in paths:
                drop_cache(p)
        _C._inject_fault("sweep", 0)   # resets the count of sweep reads
        nread, errors = _C.read_strided(reqs, threads, direct=NEVER)
        swept = _C._fault_seen("sweep")
        assert errors == []
        for dst, emb in want:
            np.testing.assert_array_equal(dst, emb)
        assert nread >= sum(e.nbytes for _, e in want)
        if temp == "cold":
            # every file read sequentially once: at least its bytes in reads of at most 1 MiB
            assert swept >= sum(os.path.getsize(p) for p in paths) * 0.9 // (1 << 20), swept
        else:
            assert swept == 0


def test_read_strided_a_failed_sweep_only_costs_time(tmp_path):
    """The sweep only fills the page cache: a read error in it leaves the rows to the blocks' own reads."""
    reqs, want, paths = _two_files(tmp_path)
    for p in paths:
        drop_cache(p)
    _C._inject_fault("sweep", 2, errno.EIO)
    try:
        _, errors = _C.read_strided(reqs, 2, direct=NEVER)
    finally:
        _C._inject_fault("sweep", 0)
    assert errors == []
    for dst, emb in want:
        np.testing.assert_array_equal(dst, emb)


def test_read_strided_a_corrupt_chunk_fails_a_cold_read_as_it_fails_a_warm_one(grouped_file, tmp_path):
    path, r, emb, n, rb, gb = grouped_file
    bad, col = _corrupt_copy(path, r, tmp_path, 5, 200_000, 0x10)   # group 4
    msgs = []
    for temp in ("cold", "warm"):
        if temp == "cold":
            drop_cache(bad)
        _C._inject_fault("sweep", 0)
        dst, _, errors, _ = _strided(bad, r, n, rb, gb, NEVER, threads=2)
        assert (_C._fault_seen("sweep") > 0) == (temp == "cold")
        assert len(errors) == 1 and f"part 4: CRC mismatch in chunk {200_000 // col['step']} " in errors[0][1], errors
        msgs.append(errors[0][1])
    assert msgs[0] == msgs[1]


def test_read_strided_a_cold_share_of_a_segment_sweeps_only_its_rows(tmp_path):
    """A resharding load reads a share of a segment's rows: its cold read sweeps each group's piece of
    those rows, not the other rows lying between them (16 groups of 2 MiB; 20 000 rows, 5 blocks, need
    320 KB of each)."""
    n, rb, gb = 131_072, 256, 16
    emb = rows(n, rb, 3)
    path = str(tmp_path / "f.bin")
    (r,) = write(path, [(np.arange(n, dtype=np.int64), [emb])], num_rows=n, runs=True, group_bytes=[gb],
                 chunk_bytes=64 << 10)
    drop_cache(path)
    _C._inject_fault("sweep", 0)
    dst, _, errors, _ = _strided(path, r, n, rb, gb, NEVER, 40_000, 60_000, threads=2)
    swept = _C._fault_seen("sweep")
    assert errors == []
    np.testing.assert_array_equal(dst, emb[40_000:60_000])
    # one read per group's piece (each under 1 MiB), the last group's swept block by block (5 blocks); sweeping
    # the whole span between the first group's piece and the last one's took 36 reads of up to 1 MiB
    assert 16 <= swept <= 16 + 5, swept
