"""Where each bucket's rows lie in one segment: a bucket directory (`BucketDir`, the non-empty buckets and
their first rows, read from the segment's directory column and validated) or a row run's arithmetic
(`RunDir`, format version 5). Both answer `d[b]`, the first row of bucket b."""
from __future__ import annotations

import numpy as np

from .schema import Segment


class RunDir:
    """Where each bucket's rows lie in a row run (format version 5): ids [id0, id0 + rows) of a "row_range"
    table of N rows, so bucket(id) = id * B // N and the first id of bucket b is ceil(b * N / B). Answers
    as BucketDir does, from four integers (nothing is stored or read)."""

    __slots__ = ("id0", "rows", "num_rows", "num_buckets")
    nbytes = 0

    def __init__(self, id0: int, rows: int, num_rows: int, num_buckets: int):
        self.id0, self.rows, self.num_rows, self.num_buckets = id0, rows, num_rows, num_buckets

    def __getitem__(self, b: int) -> int:
        first_id = -(-b * self.num_rows // self.num_buckets)
        return min(self.rows, max(0, first_id - self.id0))

    def bucket_of_rows(self, rows: np.ndarray) -> np.ndarray:
        ids = (self.id0 + np.asarray(rows, dtype=np.int64)).astype(np.uint64)   # id * B < 2**64
        return (ids * np.uint64(self.num_buckets) // np.uint64(self.num_rows)).astype(np.int64)


class BucketDir:
    """Where each bucket's rows lie in one segment: the non-empty buckets (sorted) and their first rows.
    `d[b]` is the first row of bucket b or of the next non-empty one (`rows` past the last), so the rows
    of buckets [lo, hi) are `[d[lo], d[hi])`, as with versions 1-3's dense offsets."""

    __slots__ = ("buckets", "starts", "rows")

    def __init__(self, buckets: np.ndarray, starts: np.ndarray, rows: int):
        self.buckets, self.starts, self.rows = buckets, starts, rows

    @property
    def nbytes(self) -> int:
        return self.buckets.nbytes + self.starts.nbytes

    def __getitem__(self, b: int) -> int:
        j = int(np.searchsorted(self.buckets, b, side="left"))
        return int(self.starts[j]) if j < len(self.starts) else self.rows

    def bucket_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The bucket each of `rows` (row positions in the segment) lies in."""
        return self.buckets[np.searchsorted(self.starts, rows, side="right") - 1]

    @staticmethod
    def from_bytes(raw: np.ndarray, seg: Segment, num_buckets: int) -> "BucketDir | None":
        """The directory of `seg` from its verified block, or None if it is not a valid partition."""
        return BucketDir.all_from_bytes([raw], [seg], num_buckets)[0]

    @staticmethod
    def all_from_bytes(raws: list[np.ndarray], segs: list[Segment], num_buckets: int) -> list["BucketDir | None"]:
        """`from_bytes` of each segment, the version 4 directories checked together: a few numpy passes
        over all of them, not a few per directory (a chain's links hold hundreds of small ones)."""
        out: list[BucketDir | None] = [None] * len(segs)
        v4 = []
        for i, (raw, seg) in enumerate(zip(raws, segs)):
            if not seg.dir_entries:
                out[i] = BucketDir._offsets_block(raw, seg, num_buckets)
            elif len(raw) == 8 * seg.dir_entries:   # format version 4: uint32 bucket[k], uint32 start[k]
                v4.append(i)
        if not v4:
            return out
        k = np.array([segs[i].dir_entries for i in v4], dtype=np.int64)
        both = [raws[i].view("<u4") for i in v4]
        b = np.concatenate([x[:n] for x, n in zip(both, k.tolist())]).astype(np.int64)
        st = np.concatenate([x[n:] for x, n in zip(both, k.tolist())]).astype(np.int64)
        ok = BucketDir.valid_many(b, st, k, [segs[i] for i in v4], num_buckets)
        end = np.cumsum(k)
        first = end - k
        for j, i in enumerate(v4):
            if ok[j]:
                out[i] = BucketDir(b[first[j]:end[j]], st[first[j]:end[j]], segs[i].rows)
        return out

    @staticmethod
    def valid_many(b: np.ndarray, st: np.ndarray, k: np.ndarray, segs: list[Segment],
                   num_buckets: int) -> np.ndarray:
        """Whether each of the version 4 directories concatenated in `b` (their bucket[k]) and `st` (their
        start[k]), `k[i]` >= 1 entries for segment `segs[i]`, is a valid partition of its rows: the one home
        of the rule (`all_from_bytes`, and `segment_groups.check_dirs` for a group of small tables). First
        and last bucket as the index says, the last below the bucket count, starts from row 0 and below the
        segment's rows, both strictly increasing within each directory."""
        if not len(k):
            return np.ones(0, dtype=bool)
        end = np.cumsum(k)
        first = end - k
        ok = ((b[first] == [s.first for s in segs]) & (b[end - 1] == [s.last for s in segs])
              & (b[end - 1] < num_buckets) & (st[first] == 0) & (st[end - 1] < [s.rows for s in segs]))
        rising = (np.diff(b) > 0) & (np.diff(st) > 0)
        rising[end[:-1] - 1] = True   # (a step across two directories does not count)
        bad = np.flatnonzero(~rising)
        if bad.size:
            ok[np.searchsorted(end, bad, side="right")] = False
        return ok

    @staticmethod
    def _offsets_block(raw: np.ndarray, seg: Segment, num_buckets: int) -> "BucketDir | None":
        """Versions 1-3: the dense offsets block as a directory."""
        off = raw.view("<i8")
        if len(off) != num_buckets + 1 or off[0] != 0 or off[num_buckets] != seg.rows or np.any(np.diff(off) < 0):
            return None
        nonempty = np.nonzero(np.diff(off))[0]
        return BucketDir(nonempty.astype(np.int64), off[nonempty].astype(np.int64), seg.rows)
