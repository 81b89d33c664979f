"""Where each slot of a table lies among a segment's columns (docs/FORMAT.md, "Column groups").

A segment stores its ids (column 0, empty in a row run of format version 5), then each slot in slot
order. A slot is one column of whole rows, except a *split* slot of a table saved with column blocks or
column groups (the embedding and elementwise optimizer state of a TorchRec table: shape (D,)). A segment
of column block [c0, c1) (all of [0, D) when the table has no blocks) stores a split slot as one column
per column group: with group width G, the groups [c0 + kG, min(c1, c0 + (k+1)G)); without groups, one
column of [c0, c1). Only the column that begins a slot is padded to the alignment (in a segment that is
not packed); the other groups of the slot follow their predecessor directly.

This module is the one home of that arithmetic: the index validation, the writer, the readers and the
verifier take a table's columns from here. It knows slots by duck type (`dtype`, `shape`, `row_bytes`) so
that the schema can use it without an import cycle.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Iterable, Mapping

from . import dtypes

#: The column group width recckpt writes (docs/FORMAT.md): TorchRec's kernels need an embedding dim that is
#: a multiple of 4, so a column-wise plan's shards start and end on multiples of 4 and a group of 4 columns
#: lets every such shard read exactly its columns. A dim that is not a multiple of 4 gets a narrower last
#: group.
GROUP_WIDTH = 4


@dataclass(frozen=True)
class Piece:
    """Bytes `[src, src + nbytes)` of each row of segment column `column`, which go to bytes
    `[dst, dst + nbytes)` of each row of a reader's destination."""
    column: int
    src: int
    nbytes: int
    dst: int


@dataclass(frozen=True)
class SlotColumns:
    """One slot's columns in the segments of one column block."""
    slot: str
    first: int                                     # index of its first column in Segment.columns
    ranges: tuple[tuple[int, int], ...] | None     # split: the [c0, c1) of the last dim of each column
    unit: int                                      # split: bytes of one entry of the last dim in a row;
    #                                                else the row bytes of its one column (0: not known)
    flat: bool = True                              # split: the slot has one dim (column windows are byte ranges)

    @property
    def count(self) -> int:
        return 1 if self.ranges is None else len(self.ranges)

    @property
    def span(self) -> tuple[int, int] | None:
        """The [c0, c1) of the last dim this block stores (split slots), else None."""
        return None if self.ranges is None else (self.ranges[0][0], self.ranges[-1][1])

    def widths(self) -> list[int]:
        """Bytes a row of each of the slot's columns."""
        return [self.unit] if self.ranges is None else [self.unit * (b - a) for a, b in self.ranges]

    def row_bytes(self, columns: tuple[int, int] | None = None) -> int:
        """Bytes of a row as a read of `columns` (None: all the block stores) delivers it."""
        if columns is None or self.ranges is None:
            return sum(self.widths())
        lo, hi = self.span
        return self.unit * max(0, min(hi, columns[1]) - max(lo, columns[0]))

    def pieces(self, columns: tuple[int, int] | None = None) -> list[Piece]:
        """What a read of `columns` [a, b) of the slot's last dim (None: all the block stores) takes from
        each column that holds any of them, placed side by side from column max(a, block start)."""
        if columns is None or self.ranges is None:
            out, pos = [], 0
            for k, w in enumerate(self.widths()):
                out.append(Piece(self.first + k, 0, w, pos))
                pos += w
            return out
        if not self.flat:
            raise ValueError(f"slot {self.slot!r}: a column window of a slot of more than one dim is not a byte range")
        a = max(columns[0], self.span[0])
        out = []
        for k, (c0, c1) in enumerate(self.ranges):
            x0, x1 = max(c0, columns[0]), min(c1, columns[1])
            if x1 > x0:
                out.append(Piece(self.first + k, (x0 - c0) * self.unit, (x1 - x0) * self.unit, (x0 - a) * self.unit))
        return out


@dataclass(frozen=True)
class TableGeometry:
    """A table's columns in its segments, per column block (one block when the table has none)."""
    slots: tuple[str, ...]
    blocks: tuple[tuple[SlotColumns, ...], ...]    # per block: per slot, in slot order
    num_rows: int = 0                              # > 0: row_range over N rows whose segments may be runs

    @property
    def runs(self) -> bool:
        """Whether a segment of the table may be a row run (no ids, no directory: format version 5)."""
        return self.num_rows > 0

    @property
    def grouped(self) -> bool:
        """Whether some slot is stored in more than one column (column groups)."""
        return any(p.count > 1 for places in self.blocks for p in places)

    def place(self, slot: str, block: int = 0) -> SlotColumns:
        return self.blocks[block][self.slots.index(slot)]

    def ncols(self, block: int = 0) -> int:
        return 1 + sum(p.count for p in self.blocks[block])

    def widths(self, block: int = 0) -> list[int]:
        """Bytes a row of each column of a segment of `block` (the ids first: 8; a run stores none)."""
        return [8] + [w for p in self.blocks[block] for w in p.widths()]

    def begins_slot(self, block: int = 0) -> list[bool]:
        """Per column: whether it begins a slot (padded to the alignment, when not empty, in a segment
        that is not packed)."""
        return [False] + [k == 0 for p in self.blocks[block] for k in range(p.count)]

    # Geometries are shared between a model's tables (`TableGeometry.shared`), so these are worked out once
    # per distinct layout, not once per table of an index.
    @functools.cached_property
    def widths_per_block(self) -> list[list[int]]:
        """`widths(j)` of every column block j (do not modify: shared)."""
        return [self.widths(j) for j in range(len(self.blocks))]

    @functools.cached_property
    def begins_per_block(self) -> list[list[bool]]:
        """`begins_slot(j)` of every column block j (do not modify: shared)."""
        return [self.begins_slot(j) for j in range(len(self.blocks))]

    def column_name(self, k: int, block: int = 0) -> str:
        """A column named for errors: "ids", "slot 'embedding'", "slot 'embedding' columns [4, 8)"."""
        if k == 0:
            return "ids"
        for p in self.blocks[block]:
            if p.first <= k < p.first + p.count:
                if p.ranges is None:
                    return f"slot {p.slot!r}"
                a, b = p.ranges[k - p.first]
                return f"slot {p.slot!r} columns [{a}, {b})"
        return f"column {k}"

    @staticmethod
    def plain(slots: Iterable[str], row_bytes: Iterable[int] | None = None, num_rows: int = 0) -> "TableGeometry":
        """Every slot in one column of whole rows (no blocks, no groups)."""
        slots = tuple(slots)
        rbs = list(row_bytes) if row_bytes is not None else [0] * len(slots)
        return TableGeometry(slots, (tuple(SlotColumns(s, 1 + k, None, rb) for k, (s, rb) in
                                           enumerate(zip(slots, rbs))),), num_rows)

    @staticmethod
    def shared(slots: Mapping[str, object], column_blocks=None, column_groups=None, runs_over: int = 0
               ) -> "TableGeometry":
        """`of`, one instance per distinct arguments: geometries are immutable, and a model's tables mostly
        share a few specs, so a thousand small tables cost two geometries, not two thousand (a 1000-table
        verify built each twice: ~50 ms; a save builds one per table). Specs that cannot be a key are
        built afresh."""
        try:   # (an int key: numpy's int64 would otherwise share the entry of the equal int)
            return _shared(tuple(slots.items()), column_blocks, column_groups, operator.index(runs_over))
        except TypeError:
            return TableGeometry.of(slots, column_blocks, column_groups, runs_over)

    @staticmethod
    def of(slots: Mapping[str, object], column_blocks=None, column_groups=None, runs_over: int = 0
           ) -> "TableGeometry":
        """The geometry of a table with slot specs `slots` (name -> SlotInfo, in column order), its
        `column_blocks` (ColumnBlocks or None) and `column_groups` (ColumnGroups or None); `runs_over` = N
        when its segments may be row runs of a row_range table of N rows (format version 5), else 0."""
        split = set(column_blocks.slots if column_blocks is not None else ()) | set(
            column_groups.slots if column_groups is not None else ())
        names = tuple(slots)
        if split:
            d = next(slots[s].shape[-1] for s in names if s in split)
            spans = tuple(column_blocks.blocks) if column_blocks is not None else ((0, d),)
        else:
            spans = ((0, 0),)
        g = column_groups.width if column_groups is not None else 0
        blocks = []
        for c0, c1 in spans:
            places, col = [], 1
            for s in names:
                si = slots[s]
                if s in split:
                    ranges = (tuple((a, min(c1, a + g)) for a in range(c0, c1, g)) if g
                              else ((c0, c1),))
                    unit = dtypes.itemsize(si.dtype)
                    for x in si.shape[:-1]:
                        unit *= x
                    p = SlotColumns(s, col, ranges, unit, len(si.shape) == 1)
                else:
                    p = SlotColumns(s, col, None, si.row_bytes)
                places.append(p)
                col += p.count
            blocks.append(tuple(places))
        return TableGeometry(names, tuple(blocks), runs_over)


@functools.lru_cache(maxsize=1024)
def _shared(slots: tuple, column_blocks, column_groups, runs_over: int) -> TableGeometry:
    return TableGeometry.of(dict(slots), column_blocks, column_groups, runs_over)


__all__ = ["GROUP_WIDTH", "Piece", "SlotColumns", "TableGeometry"]
