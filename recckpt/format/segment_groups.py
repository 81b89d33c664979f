"""Many small segments, of many tables, read and checked in one pass.

A model of a thousand small tables is a thousand segments of a few kilobytes each. Read one table at a
time, each costs two engine calls (its bucket directory, then its rows) and a few dozen Python and numpy
calls around them; read here, a group of them costs two engine calls in all and a few numpy passes:
every directory read into one buffer and checked at once (`check_dirs`: the rule of
`bucket_dirs.BucketDir.valid_many`), then every row range into one buffer laid out table by
table, column by column (`read_rows`). Used by loads of small tables (recckpt/load/small_tables.py)
and by `verify` (its groups of small segments).

Nothing here words an error: a group that fails any check answers None, and the caller reads those
tables one by one, which finds the problem and names its table and file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CorruptCheckpointError
from .bucket_dirs import BucketDir
from .schema import Segment
from .sparse_io import ReadRequest, SegmentReader

#: Bucket numbers fit 24 bits (NUM_BUCKETS_LIMIT); a segment's number above them orders every entry.
_SEG_SHIFT = 32


@dataclass
class Dirs:
    """The checked bucket directories of segments [0, S) of a group, concatenated (entries of segment i at
    [at[i], at[i + 1]))."""
    buckets: np.ndarray   # int64[K]
    starts: np.ndarray    # int64[K] first row of each entry's bucket
    at: np.ndarray        # int64[S + 1]
    rows: np.ndarray      # int64[S]

    def row_ranges(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(r0, r1) per segment: its rows in buckets [lo, hi), as `BucketDir`'s d[lo], d[hi]."""
        seg = np.repeat(np.arange(len(self.rows), dtype=np.int64), np.diff(self.at))
        key = (seg << _SEG_SHIFT) | self.buckets
        base = np.arange(len(self.rows), dtype=np.int64) << _SEG_SHIFT

        def first_row(b: int) -> np.ndarray:   # of the first bucket >= b holding rows, else the end
            j = np.searchsorted(key, base | b, side="left")
            out = self.rows.copy()
            inside = j < self.at[1:]
            out[inside] = self.starts[j[inside]]
            return out
        return first_row(lo), first_row(hi)

    def bucket_of_rows(self) -> np.ndarray:
        """The bucket of every row of every segment, in segment order (what their ids must hash to)."""
        nxt = np.empty_like(self.starts)
        if len(nxt):
            nxt[:-1] = self.starts[1:]
            nxt[self.at[1:] - 1] = self.rows   # each segment's last entry runs to its end
        return np.repeat(self.buckets, nxt - self.starts)


def check_dirs(raw: np.ndarray, offsets: list[int], segs: list[Segment], num_buckets: int) -> Dirs | None:
    """The directories of `segs` (format version 4), whose verified bytes lie in `raw` at `offsets`,
    if every one is a valid partition of its segment's rows (`BucketDir.from_bytes`); else None."""
    k = np.asarray([s.dir_entries for s in segs], dtype=np.int64)
    if not len(segs):
        return Dirs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))
    if (k < 1).any():
        return None   # a version 1-3 offsets block: BucketDir.from_bytes, one by one
    at = np.zeros(len(segs) + 1, dtype=np.int64)
    np.cumsum(k, out=at[1:])
    words = raw[:raw.size - raw.size % 4].view("<u4")   # (a caller's buffer may go on with other columns)
    base = np.repeat(np.asarray(offsets, dtype=np.int64) // 4 - at[:-1], k)   # u32 word of entry 0
    j = np.arange(at[-1], dtype=np.int64)
    b = words[base + j].astype(np.int64)                      # bucket[k] of each segment, then
    st = words[base + j + np.repeat(k, k)].astype(np.int64)   # start[k]
    if not BucketDir.valid_many(b, st, k, segs, num_buckets).all():
        return None
    rows = np.asarray([s.rows for s in segs], dtype=np.int64)
    return Dirs(b, st, at, rows)


def read_dirs(reader: SegmentReader, table: str, segs: list[Segment]) -> Dirs | None:
    """The bucket directories of `segs` in one engine call, checked; None if any read or check fails."""
    size = sum(s.buckets.length for s in segs)
    buf = np.empty(size + (-size % 8), dtype=np.uint8)
    offsets, dsts, pos = [], [], 0
    for s in segs:
        offsets.append(pos)
        dsts.append(buf[pos:pos + s.buckets.length])
        pos += s.buckets.length
    reqs = [ReadRequest(s.file, s.buckets, 0, s.buckets.length, "bucket offsets", max(s.buckets.length, 1))
            for s in segs]
    try:
        if reqs:
            reader.read(table, reqs, dsts)
    except (CorruptCheckpointError, OSError):
        return None
    return check_dirs(buf, offsets, segs, reader.index.num_buckets)


@dataclass
class TableRows:
    """Rows of one table read by `read_rows`: `rows` rows, and its columns (ids, then each slot asked
    for) as uint8 views of the group's buffer, each `rows * row bytes` long."""
    rows: int
    columns: list[np.ndarray]


def read_rows(reader: SegmentReader, jobs: list[tuple[str, list[str], list[int]]], bucket_lo: int,
              bucket_hi: int) -> dict[str, TableRows] | None:
    """Buckets [lo, hi) of each of `jobs` ((table, slots, row bytes of each slot); tables whose segments
    hold whole rows, not column blocks), verified as a table's own read verifies them, in two engine
    calls: every directory the range needs, then every row range. None when anything fails."""
    nb = reader.index.num_buckets
    placed = []   # (table, segment, rows [r0, r1) when known without its directory, else None)
    for table, _, _ in jobs:
        _, segs = reader.table_segments(table)
        for seg in segs:
            use = reader.dir_use(seg, bucket_lo, bucket_hi)
            if use == "whole":
                placed.append((table, seg, (0, seg.rows)))
            elif use == "run":   # format version 5: a row run's rows in the range follow from its ids
                d = reader.run_dir(table, seg)
                placed.append((table, seg, (d[bucket_lo], d[bucket_hi])))
            elif use == "read":
                placed.append((table, seg, None))
    need = [seg for _, seg, known in placed if known is None]
    dirs = read_dirs(reader, jobs[0][0] if jobs else "", need)
    if dirs is None:
        return None
    full = (bucket_lo, bucket_hi) == (0, nb)
    r0, r1 = (np.zeros(len(need), np.int64), dirs.rows) if full else dirs.row_ranges(bucket_lo, bucket_hi)
    r0_l, r1_l = r0.tolist(), r1.tolist()
    spans, k = {}, 0
    for table, seg, known in placed:
        if known is not None:
            if known[1] > known[0]:
                spans.setdefault(table, []).append((seg, *known))
        else:
            if r1_l[k] > r0_l[k]:
                spans.setdefault(table, []).append((seg, r0_l[k], r1_l[k]))
            k += 1
    widths = {t: [8] + list(rbs) for t, _, rbs in jobs}
    total = sum(sum(r1 - r0 for _, r0, r1 in spans.get(t, ())) * sum(widths[t]) for t, _, _ in jobs)
    buf = np.empty(total, dtype=np.uint8)
    out, reqs, dsts, pos = {}, [], [], 0
    for table, slots, rbs in jobs:
        parts = spans.get(table, [])
        n = sum(r1 - r0 for _, r0, r1 in parts)
        cols = []
        for w in widths[table]:
            cols.append(buf[pos:pos + n * w])
            pos += n * w
        at = 0
        for seg, a, b in parts:
            reqs += reader.row_requests(table, seg, a, b, slots, rbs)
            dsts += [c[at * w:(at + b - a) * w] for c, w in zip(cols, widths[table])]
            at += b - a
        out[table] = TableRows(n, cols)
    try:
        if reqs:
            reader.read(jobs[0][0], reqs, dsts)
    except (CorruptCheckpointError, OSError):
        return None
    return out


__all__ = ["Dirs", "TableRows", "check_dirs", "read_dirs", "read_rows"]
