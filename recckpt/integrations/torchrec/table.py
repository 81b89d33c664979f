"""One TorchRec table as a recckpt sparse table: rows keyed by global row index, the fused (or in-backward)
optimizer's per-row state as slots. Implements `SparseState` and `FixedSize`.

The table holds views of the live storage (the fused kernel's weights and optimizer state, or an
unsharded module's parameter and its in-backward optimizer's state): a save reads them in chunks and a
load writes into them in place, so nothing is copied whole and a load works before the first step.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from ...errors import InvalidArgumentError
from ...state.protocol import Changes, RowRangeLayout, SlotSpec, SparseTableMeta

EMBEDDING = "embedding"
ADAGRAD = "adagrad.acc"               # elementwise: shape (D,), column-split like the embedding
ROWWISE_ADAGRAD = "rowwise_adagrad.acc"   # one value per row: shape ()


@dataclass
class Shard:
    """One local shard: rows [row0, row0 + rows) and columns [col0, col0 + cols) of the logical table.
    `weight` is a [rows, cols] view of live storage; `states` maps each optimizer slot to its live
    view (or a function giving it, see `state`): [rows, cols] for elementwise slots, [rows] for per-row slots (each
    column shard its own under a column-wise plan: `TorchRecTable.column_pieces`)."""
    row0: int
    rows: int
    col0: int
    cols: int
    weight: torch.Tensor
    states: Dict[str, Any] = field(default_factory=dict)

    def state(self, slot: str) -> torch.Tensor:
        """The live view of optimizer slot `slot`. A value may be a function giving it: state kept by a
        registered dense optimizer (a data-parallel table's), which a load may replace before the
        table's rows are written (torch.optim's load_state_dict installs new tensors)."""
        v = self.states[slot]
        return v() if callable(v) else v


class SlotsTable:
    """What every TorchRec table adapter answers the same way: its schema, its local row count and the
    check of requested slot names. Subclasses set `name`, `slots` and `kind` and define `local_rows()`."""
    kind = "TorchRec table"

    def local_rows(self) -> int:
        raise NotImplementedError

    def sparse_meta(self) -> SparseTableMeta:
        return SparseTableMeta(self.name, self.slots, self.local_rows())

    def __len__(self) -> int:
        return self.local_rows()

    def check_slots(self, slots: Sequence[str]) -> None:
        bad = [s for s in slots if s not in self.slots]
        if bad:
            raise InvalidArgumentError(f"{self.kind} {self.name!r} has no slots {bad}; it has {list(self.slots)}")


class TorchRecTable(SlotsTable):
    """A TorchRec table (one `EmbeddingBagConfig`/`EmbeddingConfig`) as seen from this process."""

    def __init__(self, name: str, num_rows: int, dim: int, dtype: torch.dtype, shards: List[Shard],
                 opt_slots: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]], replicated: bool,
                 sharding: str, column_blocks: Tuple[Tuple[int, int], ...] | None = None,
                 opt_init: Dict[str, float] | None = None, opt_restart: Callable[[], None] | None = None,
                 trackable: bool = True):
        self.name, self.num_rows_global, self.dim, self.dtype = name, num_rows, dim, dtype
        # Whether only the rows its lookups touched change in a step (a fused kernel updates exactly
        # those): what lets increments hold its looked-up rows only. False on TorchRec's "dense" kernel,
        # whose parameter an ordinary optimizer steps whole (momentum, weight decay move every row).
        self.trackable = trackable
        # Sets the per-parameter counters of the optimizer holding this table's slots (torch Adagrad's
        # `step`) back to a fresh optimizer's, when a load restarts all of its slots; None for FBGEMM's
        # fused state, which keeps no such counter per table.
        self.opt_restart = opt_restart
        # What each optimizer slot starts at (`reset_slots`): FBGEMM's fused state starts at 0; an
        # Adagrad-like torch optimizer at its `initial_accumulator_value` (discover.py finds it).
        self.opt_init = {slot: float((opt_init or {}).get(slot, 0.0)) for slot in opt_slots}
        self.column_blocks = column_blocks   # the plan's column shards' ranges (None: whole rows)
        self.shards, self.replicated, self.sharding = shards, replicated, sharding
        self.slots = {EMBEDDING: SlotSpec(dtype, (dim,), "sparse")}
        for slot, (dt, shape) in opt_slots.items():
            self.slots[slot] = SlotSpec(dt, shape, "sparse_opt")
        for s in shards:
            if tuple(s.weight.shape) != (s.rows, s.cols):
                raise InvalidArgumentError(f"TorchRec table {name!r}: local shard at row {s.row0}, column {s.col0} "
                                           f"has shape {tuple(s.weight.shape)}, its plan says {(s.rows, s.cols)}")
        self._layout = self._compute_layout()

    # ---------------------------------------------------------------------------------- layout
    def _compute_layout(self) -> RowRangeLayout | None:
        """The process's layout; None when it holds several column ranges of a column-split plan, each a
        column block of its own (`column_pieces`)."""
        rows = sorted({(s.row0, s.row0 + s.rows) for s in self.shards if s.rows})
        cols = sorted({(s.col0, s.col0 + s.cols) for s in self.shards if s.rows})
        self._piece_columns = tuple(cols) if self.column_blocks is not None and len(cols) > 1 else ()
        if self._piece_columns:
            return None
        if len(cols) > 1:   # several column ranges need column blocks naming them (discover.py)
            raise InvalidArgumentError(
                f"TorchRec table {self.name!r}: this process holds column shards {cols} but no column blocks "
                f"were given for the table (recckpt's TorchRec discovery names them from the plan; a table built "
                f"by hand must pass column_blocks)")
        columns = cols[0] if cols and cols[0] != (0, self.dim) else None
        if self.replicated:
            rows = [(0, self.num_rows_global)]
        return RowRangeLayout(self.num_rows_global, tuple(rows), columns, self.replicated, self.column_blocks)

    def row_layout(self) -> RowRangeLayout:
        if self._layout is None:
            raise InvalidArgumentError(
                f"TorchRec table {self.name!r}: this process holds the column shards {list(self._piece_columns)}, "
                f"each saved and loaded as its own column block: use recckpt.state.protocol.pieces_of(table)")
        return self._layout

    def column_pieces(self) -> List["TorchRecTable"]:
        """`ColumnPieces`: one view per column range this process holds (a column-wise plan's column
        shards, adjacent or not), each with that range as its `columns`, in column order; [self] when it
        holds one range. A view shares the live storage, the tracker and the optimizer hooks."""
        if not self._piece_columns:
            return [self]
        out = []
        for c0, c1 in self._piece_columns:
            piece = copy.copy(self)
            piece.shards = [s for s in self.shards if (s.col0, s.col0 + s.cols) == (c0, c1)]
            piece._layout = piece._compute_layout()
            out.append(piece)
        return out

    def local_rows(self) -> int:
        if self._layout is None:   # the rows of any of its column shards (a row's columns are one row)
            rows, end = 0, 0
            for a, b in sorted((s.row0, s.row0 + s.rows) for s in self.shards if s.rows):
                rows += max(0, b - max(a, end))
                end = max(end, b)
            return rows
        return sum(b - a for a, b in self._layout.owned_rows)

    # -------------------------------------------------------------------------------- protocol
    def export_chunks(self, slots: Sequence[str], max_rows: int
                      ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """Rows of every local shard in chunks of <= max_rows, ids = global row indices. Under a
        column-wise plan the column-split slots carry this process's columns only (`row_layout().columns`);
        each row range is exported once even when this rank holds several column shards of it."""
        self.check_slots(slots)
        if max_rows < 1:
            raise InvalidArgumentError(f"export_chunks: max_rows must be >= 1, got {max_rows}")
        for a, b in self.row_layout().owned_rows:
            parts = sorted((s for s in self.shards if s.row0 == a and s.rows == b - a), key=lambda s: s.col0)
            for i in range(0, b - a, max_rows):
                j = min(b - a, i + max_rows)
                # numpy's arange: torch's took milliseconds under intra-op threads on a busy machine
                ids = torch.from_numpy(np.arange(a + i, a + j, dtype=np.int64))
                yield ids, {slot: self._gather(parts, slot, slice(i, j)) for slot in slots}

    def _gather(self, parts: List[Shard], slot: str, sel) -> torch.Tensor:
        """Rows `sel` (a slice, or int64 local row indices) of `slot` across the column shards `parts` of
        one row range."""
        spec = self.slots[slot]
        i = sel
        if slot == EMBEDDING:
            pieces = [p.weight[i] for p in parts]
        elif len(spec.shape) == 1:
            pieces = [p.state(slot)[i] for p in parts]
        else:   # a per-row value: one column range holds one shard of a row range (`column_pieces`)
            return parts[0].state(slot)[i].contiguous()
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)).contiguous()

    def read_rows(self, ids: torch.Tensor, slots: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Rows `ids` (global row indices this process holds, any order) of `slots`, as new tensors.
        Column-split slots carry this process's columns (`row_layout().columns`), per-row slots the
        row's value. Used by managed-collision tables, whose rows are not ranges."""
        self.check_slots(slots)
        owned = self._owned_mask(ids)
        if not bool(owned.all()):
            raise InvalidArgumentError(f"TorchRec table {self.name!r}: row {int(ids[~owned][0])} is not held by this "
                                       f"process (it holds rows {list(self.row_layout().owned_rows)})")
        c0, c1 = self.row_layout().columns or (0, self.dim)
        out = {}
        for slot in slots:
            spec = self.slots[slot]
            split = len(spec.shape) == 1
            col = torch.empty((ids.shape[0], c1 - c0) if split else (ids.shape[0],), dtype=spec.dtype)
            for s in self.shards:
                sel = (ids >= s.row0) & (ids < s.row0 + s.rows)
                if not bool(sel.any()):
                    continue
                local = ids[sel] - s.row0
                if slot == EMBEDDING:
                    col[sel, s.col0 - c0:s.col0 - c0 + s.cols] = s.weight[local]
                elif split:
                    col[sel, s.col0 - c0:s.col0 - c0 + s.cols] = s.state(slot)[local]
                else:   # a per-row value (one shard a row range: `column_pieces`)
                    col[sel] = s.state(slot)[local]
            out[slot] = col
        return out

    def _owned_mask(self, ids: torch.Tensor) -> torch.Tensor:
        owned = torch.zeros(ids.shape[0], dtype=torch.bool)
        for a, b in self.row_layout().owned_rows:
            owned |= (ids >= a) & (ids < b)
        return owned

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        """Overwrite the rows `ids` (global row indices this process holds) in place. Column-split slots
        carry columns `row_layout().columns` (all columns when None). Everything is checked before any
        row is written."""
        self.check_slots(list(columns))
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidArgumentError(f"TorchRec table {self.name!r}: ids must be int64 [n], got {ids.dtype} "
                                       f"{tuple(ids.shape)}")
        n = ids.shape[0]
        c0, c1 = self.row_layout().columns or (0, self.dim)
        for slot, col in columns.items():
            spec = self.slots[slot]
            shape = (n, c1 - c0) if len(spec.shape) == 1 else (n,)
            if col.dtype != spec.dtype or tuple(col.shape) != shape:
                raise InvalidArgumentError(
                    f"TorchRec table {self.name!r}, slot {slot!r}: expected {spec.dtype} {shape}, got "
                    f"{col.dtype} {tuple(col.shape)}")
        if n == 0:
            return
        owned = self._owned_mask(ids)
        if not bool(owned.all()):
            bad = int(ids[~owned][0])
            raise InvalidArgumentError(
                f"TorchRec table {self.name!r}: row {bad} is not held by this process (it holds rows "
                f"{list(self.row_layout().owned_rows)} of {self.num_rows_global}); nothing was written")
        with torch.no_grad():
            for s in self.shards:
                sel = (ids >= s.row0) & (ids < s.row0 + s.rows)
                if not bool(sel.any()):
                    continue
                whole = bool(sel.all())     # every id in this shard: no masked copies of the columns
                local = (ids if whole else ids[sel]) - s.row0
                lo, hi = s.col0 - c0, s.col0 - c0 + s.cols
                # format v4 reads a row range in row order: one run of rows is a slice copy, not a scatter
                m = local.shape[0]
                run = m > 1 and int(local[-1]) - int(local[0]) == m - 1 and bool((local[1:] > local[:-1]).all())
                at = slice(int(local[0]), int(local[0]) + m) if run or m == 1 else local
                for slot, col in columns.items():
                    part = col if whole else col[sel]
                    if slot == EMBEDDING:
                        s.weight[at] = part[:, lo:hi]
                    elif len(self.slots[slot].shape) == 1:
                        s.state(slot)[at] = part[:, lo:hi]
                    else:   # per-row value: each column shard starts from the row's value
                        s.state(slot)[at] = part
                if self.tracker is not None:   # loaded rows are changes since any earlier mark
                    self.tracker.touch(s.row0, s.rows, local)

    # ------------------------------------------------------------------------- lent storage
    def row_views(self, slots: Sequence[str]) -> "List[Tuple[int, Dict[str, torch.Tensor]]] | None":
        """`LendsRows`: per owned row range, the live storage of `slots` when this process holds every
        column of it in one contiguous CPU tensor per slot (not under a column-wise plan); else None."""
        self.check_slots(slots)
        if self.row_layout().columns is not None:
            return None
        out = []
        for a, b in self.row_layout().owned_rows:
            parts = [s for s in self.shards if s.row0 == a and s.rows == b - a]
            if len(parts) != 1 or parts[0].col0 != 0 or parts[0].cols != self.dim:
                return None
            views = {}
            for slot in slots:
                t = parts[0].weight if slot == EMBEDDING else parts[0].state(slot)
                spec = self.slots[slot]
                if (t.device.type != "cpu" or t.dtype != spec.dtype or not t.is_contiguous()
                        or tuple(t.shape) != (b - a, *spec.shape)):
                    return None
                views[slot] = t
            out.append((a, views))
        return out

    def rows_loaded(self, row0: int, rows: int) -> None:
        """`LendsRows`: rows [row0, row0 + rows) were written into the lent storage: changes since any mark."""
        if self.tracker is None:
            return
        for s in self.shards:
            lo, hi = max(row0, s.row0), min(row0 + rows, s.row0 + s.rows)
            if hi > lo:
                self.tracker.touch_range(s.row0, s.rows, lo - s.row0, hi - s.row0)

    # ------------------------------------------------------------------------ change tracking
    #: the table's `tracking.TableTracker` (rows looked up since a mark), set when the table is found in a
    #: sharded collection; None: the table cannot tell what changed and increments hold it whole
    tracker = None

    def mark_changes(self) -> int:
        return self.tracker.mark() if self.tracker is not None else 0

    def export_changes(self, since: int, slots: Sequence[str], max_rows: int) -> Changes | None:
        """The rows this process holds that were looked up (so possibly updated by the fused optimizer) or
        loaded since mark `since`, in chunks of <= max_rows; None when the tracker cannot tell."""
        self.check_slots(slots)
        if self.tracker is None:
            return None
        found = []
        for a, b in self.row_layout().owned_rows:
            local = self.tracker.changed(a, b - a, since)
            if local is None:
                return None
            found.append((a, b, local))

        def chunks():
            for a, b, local in found:
                parts = sorted((s for s in self.shards if s.row0 == a and s.rows == b - a), key=lambda s: s.col0)
                for i in range(0, local.shape[0], max(1, max_rows)):
                    sel = local[i:i + max_rows]
                    yield sel + a, {slot: self._gather(parts, slot, sel) for slot in slots}
        return Changes(sum(int(x.shape[0]) for _, _, x in found), chunks(), torch.empty(0, dtype=torch.int64))

    def forget_changes(self, upto: int) -> None:
        """A fixed-size table removes no rows: nothing is kept per mark."""

    def clear_rows(self) -> None:
        """A fixed-size table keeps its rows: a replacing load overwrites every row it holds (the loader
        checks that the checkpoint has them all), and resets the slots it does not load (`reset_slots`)."""

    def reset_slots(self, slots: Sequence[str], rows: Tuple[int, int] | None = None) -> None:
        """Set optimizer slots `slots` of the rows this process holds (those in global rows [rows[0],
        rows[1]) when given) to their initial value: what a replacing load that leaves them out gives, as
        a table emptied and refilled would (docs/LOADING.md). The embedding has no initial value recckpt
        knows (the model's initializer drew it), so it cannot be reset."""
        self.check_slots(slots)
        if EMBEDDING in slots:
            raise InvalidArgumentError(f"TorchRec table {self.name!r}: the embedding cannot be reset to an initial "
                                       f"value (its initializer is the model's); load it")
        lo, hi = rows if rows is not None else (0, self.num_rows_global)
        with torch.no_grad():
            for s in self.shards:
                a, b = max(lo, s.row0), min(hi, s.row0 + s.rows)
                if b <= a:
                    continue
                for slot in slots:
                    s.state(slot)[a - s.row0:b - s.row0] = self.opt_init[slot]
                if self.tracker is not None:   # changed rows, as a load's are
                    self.tracker.touch_range(s.row0, s.rows, a - s.row0, b - s.row0)
        every_slot = set(slots) >= {n for n, spec in self.slots.items() if spec.category == "sparse_opt"}
        if self.opt_restart is not None and every_slot and (lo, hi) == (0, self.num_rows_global):
            self.opt_restart()
