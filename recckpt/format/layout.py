"""Where a segment's bytes sit in a shard file: the one home of the layout rules (docs/FORMAT.md,
"Shard files").

A segment is, in this order: its bucket offsets block, then its columns (ids, then one per slot).
From format version 2 on, every non-empty *slot* column is preceded by zero padding that brings its
offset to a multiple of COLUMN_ALIGN, so that a load can map a column's pages instead of copying
them; nothing else leaves a gap. The C++ engine writes that padding (csrc/shard_writer.cpp,
kColumnAlign, which a test keeps equal to COLUMN_ALIGN); the index validation, the verifier and the
reader compute it only through the functions below, and the saver cuts segments with `row_granule`.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

#: Format version 2: non-empty slot columns start at multiples of this (the page size we map on).
COLUMN_ALIGN = 4096

#: The first format version whose slot columns are aligned.
ALIGNED_FROM_VERSION = 2

#: Format version 4: recckpt packs (writes without alignment padding) a segment of fewer bytes than this
#: (`rows * (8 + sum of slot row bytes)`); the engine's kPackBelow, kept equal by a test. Readers follow
#: each segment's `packed` flag, never this rule.
PACK_BELOW = 64 << 10

#: Format version 4 checksum steps: a column of L bytes has one CRC per
#: min(C, max(MIN_STEP, next power of two >= ceil(L / STEPS_PER_COLUMN))) bytes.
MIN_STEP = 512
STEPS_PER_COLUMN = 64


def checksum_step(length: int, chunk_bytes: int) -> int:
    """Format version 4: bytes per CRC of a column of `length` bytes (the engine's column_step)."""
    q = -(-length // STEPS_PER_COLUMN)
    if q >= chunk_bytes:
        return chunk_bytes
    return min(chunk_bytes, max(MIN_STEP, 1 << max(0, (q - 1).bit_length())))


def checksum_steps(lengths: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """`checksum_step` of every length of an int64 array (lengths >= 0)."""
    q = -(-lengths // STEPS_PER_COLUMN)
    small = np.minimum(q, chunk_bytes)          # below 2**31: exact in float64
    bits = np.frexp(np.maximum(small - 1, 0).astype(np.float64))[1].astype(np.int64)
    pow2 = np.left_shift(np.int64(1), bits)
    return np.where(q >= chunk_bytes, chunk_bytes, np.minimum(chunk_bytes, np.maximum(MIN_STEP, pow2)))


def crc_count(lengths, steps):
    """CRCs of columns of `lengths` bytes checked in `steps`-byte pieces (ints or int64 arrays)."""
    return -(-lengths // steps)


def is_aligned(k: int, length: int, format_version: int) -> bool:
    """Whether column `k` of a segment (0: ids, 1..: slots) of `length` bytes is preceded by alignment
    padding."""
    return format_version >= ALIGNED_FROM_VERSION and k > 0 and length > 0


def align_up(pos):
    """The first multiple of COLUMN_ALIGN at or after `pos` (an int, or an int64 numpy array)."""
    return pos + (-pos % COLUMN_ALIGN)


def column_start(prev_end: int, k: int, length: int, format_version: int) -> int:
    """Where column `k` of `length` bytes starts when the column before it ends at `prev_end`."""
    return align_up(prev_end) if is_aligned(k, length, format_version) else prev_end


def pad_before(prev_end: int, offset: int, k: int, format_version: int) -> int:
    """Zero bytes between the column before (ending at `prev_end`) and column `k` at `offset`: the
    alignment padding of format version 2 (< COLUMN_ALIGN once the index is validated); 0 for the ids
    column, in version 1 and in a packed segment of version 4 (its columns are contiguous)."""
    if k == 0 or format_version < ALIGNED_FROM_VERSION:
        return 0
    return max(0, offset - prev_end)


def row_granule(row_bytes: Iterable[int]) -> int:
    """The smallest row count g such that g rows of every slot fill whole COLUMN_ALIGN blocks.

    Segments of a multiple of g rows keep, in a table's storage, every later segment's rows on the
    same page offset as in the file (slot columns start aligned), which is what lets a load map them
    instead of copying. The saver cuts segments at multiples of g (`segment_rows`, `granule_cut`)."""
    g = 1
    for rb in row_bytes:
        if rb > 0:
            g = math.lcm(g, COLUMN_ALIGN // math.gcd(rb, COLUMN_ALIGN))
    return g


def segment_rows(segment_bytes: int, row_bytes: Iterable[int]) -> int:
    """Rows per exported chunk (one segment each) for segments of about `segment_bytes`: whole
    granules when at least one fits, else as many rows as fit (at least 1). `row_bytes` are the slots'
    row sizes; the 8 bytes of the id are added here."""
    row_bytes = list(row_bytes)
    rows = max(1, segment_bytes // (8 + sum(row_bytes)))
    granule = row_granule(row_bytes)
    return rows - rows % granule if rows >= granule else rows


def granule_cut(n: int, granule: int, row_bytes: int | None = None) -> int:
    """Where a chunk of `n` rows is split so that its first part is whole granules and the short rest
    becomes a segment of its own; 0 or `n` when no split is needed. `row_bytes` (the id and every slot):
    a chunk of fewer than PACK_BELOW bytes is written packed, unaligned, so a cut would only add a
    segment (a second index entry, directory and read per small table); it is not cut."""
    if row_bytes is not None and n * row_bytes < PACK_BELOW:
        return n
    return n - n % granule
