"""Rows of a fixed-size table (FixedSize: TorchRec's): from a source that does not know its layout
(`OwnedRows`), and straight from the shard files into the storage the table lends (`DirectRows`).

A chain of increments is folded by id over buckets; under format version 3's hash layout a row range
spreads over every bucket, so the fold covers them all and this filter keeps the rows the table's layout
gives this process (all of them when replicated) and, for column-split slots, its columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch

from ..errors import IncompatibleCheckpointError
from ..format.sparse_io import RunIds
from ..state.protocol import LendsRows, column_split_slots


class OwnedRows:
    """`import_rows` of a fixed-size table, fed rows of every bucket: keeps this process's rows and columns."""

    def __init__(self, table, target: str, where: str):
        self.table, self.target, self.where = table, target, where
        self.layout = table.row_layout()
        self.split = set(column_split_slots(table.sparse_meta()))
        self._starts = np.array([a for a, _ in self.layout.owned_rows], dtype=np.int64)
        self._ends = np.array([b for _, b in self.layout.owned_rows], dtype=np.int64)
        self.rows = 0

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        lay = self.layout
        a = ids.numpy()
        if len(a) and (int(a.min()) < 0 or int(a.max()) >= lay.num_rows):
            bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
            raise IncompatibleCheckpointError(
                f"checkpoint {self.where}: holds row id {bad}, outside model table {self.target!r}'s "
                f"{lay.num_rows} rows", table=self.target)
        if not lay.replicated:
            if not lay.owned_rows:
                return
            k = np.searchsorted(self._starts, a, side="right") - 1
            keep = torch.from_numpy(np.nonzero((k >= 0) & (a < self._ends[np.maximum(k, 0)]))[0])
            ids, columns = ids[keep], {s: c[keep] for s, c in columns.items()}
        if ids.shape[0] == 0:
            return
        if lay.columns is not None:
            c0, c1 = lay.columns
            columns = {s: (c[:, c0:c1] if s in self.split else c) for s, c in columns.items()}
        self.table.import_rows(ids.contiguous(), {s: c.contiguous() for s, c in columns.items()})
        self.rows += int(ids.shape[0])

    @staticmethod
    def of_pieces(pieces, target: str, where: str) -> "OwnedRows | EveryPiece":
        """The sink of a table's column ranges (`protocol.pieces_of`): itself when it is one."""
        sinks = [OwnedRows(p, target, where) for p in pieces]
        return sinks[0] if len(sinks) == 1 else EveryPiece(sinks)


class EveryPiece:
    """`import_rows` into every column range a process holds of a table (`ColumnPieces`), each keeping its
    rows and columns; `rows` counts a row once."""

    def __init__(self, sinks: List[OwnedRows]):
        self.sinks = sinks

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        for sink in self.sinks:
            sink.import_rows(ids, columns)

    @property
    def rows(self) -> int:
        return max(s.rows for s in self.sinks)


class DirectRows:
    """Reads a fixed-size table's rows from the shard files straight into the storage it lends
    (`LendsRows`): one parallel read of its slot columns (after one of its ids, where they are stored),
    each range of rows landing at its place in the live storage. Format version 4 writes a fixed-size
    table's rows in row order ("row_range" buckets over exported row ranges), so a segment's ids are a run
    [a, a + n), which version 5 stores as a row run (no ids: nothing to read), and the rows of an owned
    range are one byte range per column (per column group in version 5, placed into the rows by the
    engine): no filter, no copy out of a staging buffer. A batch whose ids are not such runs (another
    writer, an old format) is left to the caller's importing path (`load_batch` returns None before
    writing)."""

    def __init__(self, blocks: List[Tuple[int, int, List[np.ndarray]]], num_rows: int, table):
        self.blocks, self.num_rows, self.table = blocks, num_rows, table

    @staticmethod
    def of(table, slots, dtype_of) -> "DirectRows | None":
        """The table's lent storage for `slots` ((slot, SlotInfo, SlotSpec) triples), or None when it
        lends none or the checkpoint's slots need a cast or another shape. `dtype_of`: SlotInfo -> torch dtype."""
        if not isinstance(table, LendsRows):
            return None
        if any(dtype_of(si) != spec.dtype or tuple(si.shape) != tuple(spec.shape) for _, si, spec in slots):
            return None
        views = table.row_views([s for s, _, _ in slots])
        layout = table.row_layout()
        if views is None or len(views) != len(layout.owned_rows):
            return None
        blocks = []
        for (a, b), (row0, cols) in zip(layout.owned_rows, views):
            if row0 != a:
                return None
            flat = []
            for s, si, _ in slots:
                t = cols[s]
                if (t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != b - a
                        or t.numel() * t.element_size() != (b - a) * si.row_bytes):
                    return None
                flat.append(t.detach().reshape(-1).view(torch.uint8).numpy())
            blocks.append((a, b, flat))
        return DirectRows(blocks, layout.num_rows, table)

    def load_batch(self, segments, batch, name: str, target: str, where: str) -> "int | None":
        """Read `batch` (a `SegmentReader.batches` batch of checkpoint table `name`) into the lent storage;
        the number of rows written, or None (nothing written) when its ids are not runs of rows."""
        planned = self.plan_batch(segments, batch, name, target, where)
        if planned is None:
            return None
        if planned.reqs:
            segments.read(name, planned.reqs, planned.dsts)
        return self.loaded(planned)

    def plan_batch(self, segments, batch, name: str, target: str, where: str) -> "PlannedRows | None":
        """The reads that put `batch` into the lent storage, for the caller to make (alone, or with other
        tables' in one engine call: `SegmentReader.read_together`), then to report with `loaded`; None when
        its ids are not runs of rows. Nothing is written into the table here: only stored ids are read."""
        # A row run's ids (format version 5) are its index entry's: only stored ids are read and checked.
        stored = [reqs[0] for _, reqs in batch.parts if not isinstance(reqs[0], RunIds)]
        read = iter(segments.read(name, stored) if stored else ())
        runs = []
        for n, reqs in batch.parts:
            if isinstance(reqs[0], RunIds):
                a = reqs[0].first
            else:
                ids = next(read).view("<i8")
                a = int(ids[0])
                if n > 1 and (int(ids[-1]) - a != n - 1 or not bool(np.all(np.diff(ids) == 1))):
                    return None
            if a < 0 or a + n > self.num_rows:
                bad = a if a < 0 else a + n - 1
                raise IncompatibleCheckpointError(
                    f"checkpoint {where}: table {name!r} holds row id {bad}, outside model table {target!r}'s "
                    f"{self.num_rows} rows", table=target)
            runs.append(a)
        planned = PlannedRows(name, [], [], [])
        for (n, preqs), a in zip(batch.parts, runs):
            for b0, b1, flat in self.blocks:
                i0, i1 = max(a, b0), min(a + n, b1)
                if i1 <= i0:
                    continue
                for r, rb, dst in zip(preqs[1:], batch.row_bytes, flat):
                    planned.reqs.append(r.rows(i0 - a, i1 - a, rb))
                    planned.dsts.append(dst[(i0 - b0) * rb:(i1 - b0) * rb])
                planned.done.append((i0, i1 - i0))
        return planned

    def loaded(self, planned: "PlannedRows") -> int:
        """Tell the table that `planned`'s reads were made (`LendsRows.rows_loaded`); the rows written."""
        for row0, rows in planned.done:
            self.table.rows_loaded(row0, rows)
        return sum(rows for _, rows in planned.done)


@dataclass
class PlannedRows:
    """`DirectRows.plan_batch`: the reads (`reqs` into `dsts`, views of the lent storage) of checkpoint table
    `table`, and the row runs (first row, rows) they write."""
    table: str
    reqs: list
    dsts: List[np.ndarray]
    done: List[Tuple[int, int]]
