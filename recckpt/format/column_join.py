"""Rows of a column-split table (docs/FORMAT.md, Column blocks) joined across its column blocks.

A table saved by a column-wise plan holds, per column block, every row of the table with the block's
columns of the split slots and a copy of the unsplit slots. A reader that needs columns [c0, c1) reads
only the blocks that overlap them, row range by row range ("row_range" buckets make a row range a
bucket range), and places each block's columns side by side. Memory stays within one chunk of rows.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from . import dtypes
from .schema import TableInfo
from .sparse_io import SegmentReader

#: Unsplit slots from block 0 only (the rows as the format defines them: what digests and exports show).
FROM_BLOCK0 = "block0"
#: Unsplit slots from every block read, each weighted by how many of the wanted columns it holds (the
#: caller combines them: a TorchRec load gives each column shard the width-weighted mean, docs/TORCHREC.md).
FROM_OVERLAP = "overlap"


def row_range_of_buckets(info: TableInfo, num_buckets: int, lo: int, hi: int) -> tuple[int, int]:
    """The rows [a, b) of a "row_range" table whose buckets (id * B // N) lie in [lo, hi)."""
    n = info.num_rows
    return min(n, -(-lo * n // num_buckets)), min(n, -(-hi * n // num_buckets))


def iter_joined(segments: SegmentReader, table: str, info: TableInfo, slots: list[str],
                row_ranges: list[tuple[int, int]], columns: tuple[int, int] | None, chunk_rows: int,
                unsplit: str = FROM_BLOCK0
                ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray], dict[str, list[tuple[int, np.ndarray]]]]]:
    """Yield `(ids, split, unsplit)` for the rows of `row_ranges` the checkpoint holds, in id order, at most
    `chunk_rows` rows a chunk: `split` maps each requested split slot to uint8 rows holding its columns
    [c0, c1) (`columns`, None: all), `unsplit` each other requested slot to `[(weight, uint8 rows)]`, one
    entry per block it is taken from (see FROM_BLOCK0 / FROM_OVERLAP). Fresh arrays each chunk."""
    cb = info.column_blocks
    if cb is None or info.bucket_fn != "row_range":
        raise IncompatibleCheckpointError(
            f"table {table!r}: column blocks are read by row range, and the table is bucketed "
            f"{info.bucket_fn!r}", table=table)
    d = cb.blocks[-1][1]
    c0, c1 = columns or (0, d)
    need = [j for j, (a, b) in enumerate(cb.blocks) if a < c1 and b > c0]
    split = [s for s in slots if s in cb.slots]
    other = [s for s in slots if s not in cb.slots]
    per_block: dict[int, list[str]] = {j: list(split) for j in need}
    if other:
        for j in ([0] if unsplit == FROM_BLOCK0 else need):
            per_block.setdefault(j, [])
            per_block[j] += other
    if not per_block:
        per_block[need[0] if need else 0] = []
    nb, n_rows = segments.index.num_buckets, info.num_rows
    for a, b in row_ranges:
        a, b = max(a, 0), min(b, n_rows)
        for r0 in range(a, b, max(1, chunk_rows)):
            r1 = min(b, r0 + max(1, chunk_rows))
            yield _chunk(segments, table, info, per_block, split, other, c0, c1, r0, r1, nb)


def _chunk(segments, table, info, per_block, split, other, c0, c1, r0, r1, nb):
    cb, n = info.column_blocks, r1 - r0
    wide = {s: _geometry(info, s) for s in split}   # (leading elements, element bytes)
    out = {s: np.zeros((n, p, (c1 - c0) * e), dtype=np.uint8) for s, (p, e) in wide.items()}
    got: dict[str, list[tuple[int, np.ndarray]]] = {s: [] for s in other}
    have = None
    blo, bhi = r0 * nb // info.num_rows, (r1 - 1) * nb // info.num_rows + 1
    # Column groups (format version 5): a block's split slots are read in the columns [x0, x1) wanted only,
    # by the groups that hold them; without, a block's columns are read whole and cut here.
    grouped = info.column_groups is not None
    for j, names in sorted(per_block.items()):
        a, b = cb.blocks[j]
        x0, x1 = max(a, c0), min(b, c1)
        ra, rb_ = (x0, x1) if grouped and x1 > x0 else (a, b)   # the columns each row read holds
        mine = {s: np.zeros((n, info.slots[s].row_bytes), dtype=np.uint8) for s in names if s in got}
        seen = np.zeros(n, dtype=bool)
        rbs = [info.slots[s].row_bytes_for(rb_ - ra if s in wide else None) for s in names]
        window = (ra, rb_) if grouped and any(s in wide for s in names) else None
        for ids, parts in segments.iter_table(table, names, rbs, blo, bhi, block=j, columns=window):
            sel = np.nonzero((ids >= r0) & (ids < r1))[0]
            if not len(sel):
                continue
            local = ids[sel] - r0
            seen[local] = True
            for s, raw in zip(names, parts):
                if s in wide:
                    p, e = wide[s]
                    rows = raw[sel].reshape(len(sel), p, (rb_ - ra) * e)
                    out[s][local, :, (x0 - c0) * e:(x1 - c0) * e] = rows[:, :, (x0 - ra) * e:(x1 - ra) * e]
                else:
                    mine[s][local] = raw[sel]
        if have is None:
            have = seen
        elif not np.array_equal(have, seen):
            raise CorruptCheckpointError(
                f"{segments.storage.describe(segments.ckpt_dir)}: table {table!r}: column blocks {j} and another "
                f"hold different rows of [{r0}, {r1}); every block holds every row (docs/FORMAT.md)", table=table)
        for s, arr in mine.items():
            got[s].append((max(x1 - x0, 0) or (b - a), arr))
    keep = np.nonzero(have)[0] if have is not None else np.zeros(0, dtype=np.int64)
    ids = (keep + r0).astype(np.int64)
    return (ids, {s: v[keep].reshape(len(keep), -1) for s, v in out.items()},
            {s: [(w, v[keep]) for w, v in lst] for s, lst in got.items()})


def _geometry(info: TableInfo, slot: str) -> tuple[int, int]:
    si = info.slots[slot]
    p = 1
    for x in si.shape[:-1]:
        p *= x
    return p, dtypes.itemsize(si.dtype)


__all__ = ["FROM_BLOCK0", "FROM_OVERLAP", "iter_joined", "row_range_of_buckets"]
