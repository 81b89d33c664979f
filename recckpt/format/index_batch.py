"""A version 4 index's tables validated all at once: the checks of `schema._segs_v4` and
`schema._segments_from` (one table at a time, about twenty numpy calls each) run on every table's
segment lists concatenated, so an index of a thousand small tables costs a few numpy passes and one
loop over its segments, not a thousand rounds of calls.

The rules are the per-table functions'; this module only batches them. It answers None whenever
anything is out of order, and the caller then runs the per-table functions, which find the same first
problem and word it exactly (naming the table, field and position): a hostile or corrupt index is
refused with the same message either way, only more slowly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout
from .schema import _HEX, _SEG_KEYS, _U32, Column, IndexDoc, Segment, _SegArrays

_LIMIT = 1 << 62
#: The keys a table's SEGS holds: (with packed, with block) -> keys.
_KEYS = {(p, b): frozenset(_SEG_KEYS) | {"crc32c"} | ({"packed"} if p else set()) | ({"block"} if b else set())
         for p in (False, True) for b in (False, True)}


@dataclass(frozen=True)
class SegsInput:
    """One table's SEGS as `schema._segs_v4` takes it."""
    where: str
    raw: object
    row_bytes: list[list[int]]   # per column block: bytes of a row of each column, ids first
    with_packed: bool
    with_block: bool
    nblocks: int


def _ints(values: list) -> np.ndarray | None:
    """`values` as int64 when every one is a Python int in [-2**63, 2**63), else None."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, values)) != {int}:
        return None
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        return None


def phase1(items: list[SegsInput], doc: IndexDoc) -> list[_SegArrays] | None:
    """`schema._segs_v4` of every item, or None where any of them would fail."""
    cols = {k: [] for k in (*_SEG_KEYS, "packed", "block")}
    counts, ncols, rb_rows, rb_base, nblocks = [], [], [], [], []
    for it in items:
        raw = it.raw
        if type(raw) is not dict or raw.keys() != _KEYS[(it.with_packed, it.with_block)]:
            return None
        n = len(raw["file"]) if type(raw["file"]) is list else -1
        for k in _SEG_KEYS:
            lst = raw[k]
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        for k, present in (("packed", it.with_packed), ("block", it.with_block)):
            lst = raw[k] if present else [0] * n
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        if any(x * (_U32 - 1) >= _LIMIT for rbs in it.row_bytes for x in rbs):
            return None   # "a slot row is too large for any segment"
        counts.append(n)
        ncols.append(len(it.row_bytes[0]))
        rb_base.append(len(rb_rows))
        rb_rows += it.row_bytes
        nblocks.append(it.nblocks)
    a = {}
    for k, lst in cols.items():
        a[k] = _ints(lst)
        if a[k] is None:
            return None
    nb, nfiles = doc.num_buckets, len(doc.files)
    fi, off, rows, dirs, first, last, packed, block = (a[k] for k in (*_SEG_KEYS, "packed", "block"))
    counts_a = np.asarray(counts, dtype=np.int64)
    table_of = np.repeat(np.arange(len(items)), counts_a)
    ok = ((fi >= 0) & (fi < nfiles) & (off >= 0) & (rows >= 1) & (rows < _U32)
          & (dirs >= 1) & (dirs <= np.minimum(rows, nb)) & (first >= 0) & (first <= last) & (last < nb)
          & (last - first + 1 >= dirs) & ((packed == 0) | (packed == 1))
          & (block >= 0) & (block < np.maximum(np.asarray(nblocks, dtype=np.int64), 1)[table_of]))
    if not ok.all():
        return None
    width = max(ncols, default=1)
    rb = np.zeros((len(rb_rows), width), dtype=np.int64)
    for j, r in enumerate(rb_rows):
        rb[j, :len(r)] = r
    lengths = rows[:, None] * rb[np.asarray(rb_base, dtype=np.int64)[table_of] + block]   # < 2**62
    starts = np.empty_like(lengths)
    pos = off + 8 * dirs
    if (pos >= _LIMIT).any():
        return None
    unpadded = packed.astype(bool)
    for k in range(width):
        ln = lengths[:, k]
        starts[:, k] = pos if k == 0 else np.where(unpadded | (ln == 0), pos, layout.align_up(pos))
        pos = starts[:, k] + ln
        if (pos >= _LIMIT).any():
            return None
    if len(pos) and (pos > np.asarray([sz for _, sz in doc.files], dtype=np.int64)[fi]).any():
        return None
    out, lo = [], 0
    for it, n, w in zip(items, counts, ncols):
        hi = lo + n
        out.append(_SegArrays(it.where, it.raw, {k: a[k][lo:hi] for k in _SEG_KEYS}, packed[lo:hi],
                              block[lo:hi], starts[lo:hi, :w], lengths[lo:hi, :w], pos[lo:hi]))
        lo = hi
    return out


def phase2(parts: list[_SegArrays], doc: IndexDoc) -> list[list[Segment]] | None:
    """`schema._segments_from` of every part (phase 1 passed), or None where any CRC string is wrong."""
    if not parts:
        return []
    width = max(p.lengths.shape[1] for p in parts)
    lengths = np.zeros((sum(len(p.ends) for p in parts), width), dtype=np.int64)
    lo = 0
    for p in parts:
        lengths[lo:lo + len(p.ends), :p.lengths.shape[1]] = p.lengths
        lo += len(p.ends)
    steps = layout.checksum_steps(lengths, doc.chunk_bytes)
    per_col = layout.crc_count(lengths, steps)
    counts = 1 + per_col.sum(axis=1)   # the directory's CRC, then the columns'
    texts, lo = [], 0
    for p in parts:
        text = p.raw.get("crc32c") if type(p.raw) is dict else None
        n = len(p.ends)
        if type(text) is not str or len(text) != 8 * int(counts[lo:lo + n].sum()):
            return None
        texts.append(text)
        lo += n
    joined = "".join(texts)
    if not _HEX.fullmatch(joined):
        return None
    crcs = np.frombuffer(bytes.fromhex(joined), dtype=">u4").astype(np.uint32)
    ends = np.cumsum(counts).tolist()
    lengths_l, steps_l, per_l = lengths.tolist(), steps.tolist(), per_col.tolist()
    out, i, c0 = [], 0, 0
    for p in parts:
        w = p.lengths.shape[1]
        file_l, off_l, rows_l, dir_l, first_l, last_l = (p.a[k].tolist() for k in _SEG_KEYS)
        packed_l, block_l, starts_l = p.packed.tolist(), p.block.tolist(), p.starts.tolist()
        segs = []
        for j in range(len(file_l)):
            c = c0 + 1
            cs = []
            for k in range(w):
                m = per_l[i][k]
                cs.append(Column(starts_l[j][k], lengths_l[i][k], crcs[c:c + m], steps_l[i][k]))
                c += m
            k_dir = dir_l[j]
            segs.append(Segment(file_l[j], rows_l[j], Column(off_l[j], 8 * k_dir, crcs[c0:c0 + 1], 8 * k_dir),
                                tuple(cs), k_dir, first_l[j], last_l[j], bool(packed_l[j]), block_l[j]))
            c0 = ends[i]
            i += 1
        out.append(segs)
    return out


__all__ = ["SegsInput", "phase1", "phase2"]
