"""A consistent copy of everything a save writes, taken into host buffers that are reused across saves.

An async save must not let training change what is being written, so the step that saves copies every
part (sparse tables with all slots, dense tensors, extras, IO state) and returns. The copies land in
buffers kept from one save to the next: on a CPU the first touch of fresh memory costs several times
a copy into memory already mapped, so reuse is what keeps the stall small. Buffers grow (with
headroom) only when a table grows; at most one save is in flight, so one set suffices. Tables on a
device reach these buffers through a staging pool (`recckpt.state.staging`) of pinned memory bounded by
`SaveOptions.staging_bytes`, also kept across saves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..errors import CheckpointSaveError
from ..state.protocol import (
    Changes,
    FixedSize,
    RowRangeLayout,
    SparseTableMeta,
    column_split_slots,
    implements,
    pieces_of,
)
from ..state.staging import StagingPool
from .options import SaveOptions


@dataclass
class Snapshot:
    """One worker's part of a save before it is written: sparse tables (anything with `sparse_meta()`
    and `export_chunks()`), dense tensors, the extras tree and the IO-state tree (None: not written
    by this worker). `Saver.capture` takes one from the live objects; `copy_snapshot` freezes it.

    A snapshot taken for an incremental save (`Saver.capture_copy(..., incremental=True)`) also carries
    `chain`, the parent it was taken against, and `marks`, each change-tracking table's mark taken at
    capture time: the changes are what changed up to the capture, never up to the background write."""
    tables: list
    dense: dict[str, torch.Tensor] | None
    extras: Any
    io_state: Any
    marks: dict | None = None        # table name -> its mark at capture (None: not captured with marks)
    chain: Any = None                # the parent state the tables' changes are relative to (incremental)
    full_reason: str | None = None   # why an incremental capture holds every row instead
    stall_seconds: float | None = None  # async saves: how long taking it held the training step (for the log)


@dataclass
class CaptureFailed:
    """What a worker hands its background write when taking its snapshot failed (an IO-state object's
    `dump_io_state` raised, say): the write still joins the save's commit protocol, with `error`, so that
    every worker fails that save together and the next save works. A worker that skipped the save would
    meet the others at its next one with another checkpoint id, and no save would commit again."""
    error: BaseException
    marks: None = None
    chain: None = None
    full_reason: None = None
    stall_seconds: float | None = None


_HEADROOM = 1.25  # a table that grows a little between saves does not reallocate every time


class HostBuffers:
    """Named byte buffers, handed out as typed views and reused by later requests for the same name."""

    def __init__(self, staging_bytes: int = SaveOptions.staging_bytes):
        """`staging_bytes`: the bound on the staging pool device tables are copied through
        (`SaveOptions.staging_bytes` of the saver whose snapshots these buffers hold)."""
        # Keyed by tuple paths of the real keys, never by joined strings: {1: a, "1": b}, "a/b" vs a→b,
        # or a slot named "ids" would otherwise share one buffer and corrupt the snapshot silently.
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._views: dict[tuple, tuple] = {}   # key -> (dtype, shape, typed view) of its last request
        self._staging_bytes = staging_bytes
        self._staging: StagingPool | None = None

    def staging(self) -> StagingPool:
        """The pool device tables are copied through, made on first use and kept."""
        if self._staging is None:
            self._staging = StagingPool(self._staging_bytes)
        return self._staging

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def get(self, key: tuple, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        shape = tuple(shape)
        last = self._views.get(key)
        if last is not None and last[0] == dtype and last[1] == shape:
            return last[2]   # the same view as last time (a thousand tables: no three tensor calls each)
        need = math.prod(shape) * dtype.itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < need:
            cap = need if buf is None else max(need, int(buf.numel() * _HEADROOM))
            buf = torch.empty(max(cap, 1), dtype=torch.uint8)
            self._bufs[key] = buf
        view = buf[:need].view(dtype).view(shape)
        self._views[key] = (dtype, shape, view)
        return view


class SnapshotTable:
    """A sparse table frozen at capture time; `export_chunks` yields views of the host buffers. Frozen
    for an incremental save (`since` given), it holds only the rows changed since the parent's mark
    `since` and the ids removed since, and answers `export_changes(since, ...)` with them."""

    def __init__(self, meta: SparseTableMeta, ids: torch.Tensor, cols: dict[str, torch.Tensor],
                 since: int | None = None, removed: torch.Tensor | None = None):
        self._meta, self._ids, self._cols = meta, ids, cols
        self._since, self._removed = since, removed

    def sparse_meta(self) -> SparseTableMeta:
        return self._meta

    def export_chunks(self, slots: Sequence[str], max_rows: int) -> Iterator[tuple[torch.Tensor, dict]]:
        if self._since is not None:
            raise CheckpointSaveError(f"table {self._meta.name!r}: this snapshot holds only the rows changed "
                                      f"since its parent; it can only be written as an increment on it")
        n = self._ids.shape[0]
        for s in range(0, n, max_rows):
            yield self._ids[s:s + max_rows], {k: self._cols[k][s:s + max_rows] for k in slots}

    def export_changes(self, since: int, slots: Sequence[str], max_rows: int) -> Changes | None:
        if self._since is None or since != self._since:
            return None
        n = self._ids.shape[0]
        chunks = ((self._ids[s:s + max_rows], {k: self._cols[k][s:s + max_rows] for k in slots})
                  for s in range(0, n, max_rows))
        return Changes(n, chunks, self._removed)


class FixedSizeSnapshotTable(SnapshotTable):
    """A fixed-size table's (TorchRec's) local shards frozen at capture time, with the row layout the
    saver writes them by (row-range ownership; a replicated table written by worker 0 only)."""

    def __init__(self, layout: RowRangeLayout, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._layout = layout

    def row_layout(self) -> RowRangeLayout:
        return self._layout


class PiecedSnapshotTable:
    """A fixed-size table of which this process holds several column ranges (`ColumnPieces`), frozen:
    one `FixedSizeSnapshotTable` per range, which the saver writes as its column blocks."""

    def __init__(self, meta: SparseTableMeta, pieces: list):
        self._meta, self._pieces = meta, pieces

    def sparse_meta(self) -> SparseTableMeta:
        return self._meta

    def column_pieces(self) -> list:
        return self._pieces


def _copy_table(table, bufs: HostBuffers, staging: StagingPool, since: dict, shard_id: int = 0):
    meta = table.sparse_meta()
    since = since.get(meta.name)
    name = meta.name
    pieces = pieces_of(table)
    if len(pieces) > 1:   # each column range in buffers of its own
        return PiecedSnapshotTable(meta, [_copy_fixed(p, bufs, staging, shard_id, (name, k))
                                          for k, p in enumerate(pieces)])
    if implements(table, FixedSize):
        return _copy_fixed(table, bufs, staging, shard_id, (name,), since)
    return SnapshotTable(*_copy_rows(table, meta, bufs, staging, since))


def _copy_fixed(table, bufs: HostBuffers, staging: StagingPool, shard_id: int, key: tuple,
                since: int | None = None) -> FixedSizeSnapshotTable:
    """A fixed-size table (or one column range of it), its buffers under `key`."""
    meta = table.sparse_meta()
    name = meta.name
    layout = table.row_layout()
    if layout.replicated and shard_id != 0:
        # Worker 0 alone writes a replicated table: the others copy nothing (only its description).
        empty = SparseTableMeta(name, meta.slots, 0)
        return FixedSizeSnapshotTable(layout, empty, torch.empty(0, dtype=torch.int64),
                                      {k: torch.empty((0, *s.shape), dtype=s.dtype) for k, s in meta.slots.items()})
    narrow = {}
    if layout.column_blocks is not None:   # column-split slots hold this process's columns; saved whole
        c0, c1 = layout.columns or layout.column_blocks[0]
        narrow, since = {k: c1 - c0 for k in column_split_slots(meta)}, None
    return FixedSizeSnapshotTable(layout, *_copy_rows(table, meta, bufs, staging, since, narrow, key))


def _copy_rows(table, meta: SparseTableMeta, bufs: HostBuffers, staging: StagingPool, since: int | None,
               narrow: dict | None = None, key: tuple | None = None):
    """(meta, ids, columns, since, removed) of `table` copied into `bufs`: every row, or with `since` the
    rows changed since that mark and the ids removed since. `narrow`: slot -> the width of its last dim
    that the table exports (a column-split slot of a column-wise process). `key`: where in `bufs` (the
    table's name, and a column range's index)."""
    narrow = narrow or {}
    name = meta.name
    key = (name,) if key is None else key
    changes = None
    if since is not None:  # only what changed since the parent (ChangeTracking), else every row
        changes = table.export_changes(since, list(meta.slots), max(1, meta.num_rows))
    n = meta.num_rows if changes is None else changes.rows
    ids = bufs.get(("sparse", *key, "ids"), torch.int64, (n,))
    cols = {k: bufs.get(("sparse", *key, "slot", k), s.dtype,
                        (n, *s.shape) if k not in narrow else (n, *s.shape[:-1], narrow[k]))
            for k, s in meta.slots.items()}
    off = 0
    exported = table.export_chunks(list(meta.slots), max(1, n)) if changes is None else changes.chunks
    # One chunk per table for implementations that can hand out views of their storage; device chunks
    # come back in bounded host pieces, each copied out before the next is asked for.
    for piece in staging.stage(exported, f"table {name!r}"):
        cids, ccols = piece.ids, piece.cols
        m = cids.shape[0]
        if off + m > n:
            raise CheckpointSaveError(f"table {name!r}: export_chunks gave more than the {n} rows its "
                                      f"sparse_meta() reported; the table changed during the snapshot")
        ids[off:off + m].copy_(cids)
        for k, c in ccols.items():
            try:
                cols[k][off:off + m].copy_(c)
            except RuntimeError as e:
                spec = meta.slots[k]
                raise CheckpointSaveError(
                    f"table {name!r}, slot {k!r}: export_chunks gave {c.dtype} {tuple(c.shape)}; the table's "
                    f"metadata says {spec.dtype} {(m, *spec.shape)} ({e})") from None
        off += m
    if off != n:
        raise CheckpointSaveError(f"table {name!r}: export_chunks gave {off} rows, sparse_meta() reported {n}")
    if changes is None:
        return meta, ids, cols, None, None
    removed = changes.removed.detach().to("cpu", torch.int64).clone()
    return meta, ids, cols, since, removed


def _freeze(obj, bufs: HostBuffers, path: tuple):
    """A copy of a state tree that later training cannot change: containers rebuilt, tensors copied into
    host buffers, numpy arrays copied; immutable leaves shared."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            return t.clone()  # tree_codec rejects it at write time with the key path
        return bufs.get(path, t.dtype, t.shape).copy_(t)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _freeze(v, bufs, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_freeze(v, bufs, path + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_freeze(v, bufs, path + (i,)) for i, v in enumerate(obj))
    if isinstance(obj, bytearray):
        return bytes(obj)
    return obj


def copy_snapshot(live: Snapshot, bufs: HostBuffers, since: dict | None = None, shard_id: int = 0) -> Snapshot:
    """`live` (from `Saver.capture`) with every part copied into `bufs`, so training may go on. `since`:
    table name -> the parent's mark, for an incremental save: those tables (when they can tell) are
    copied as their changes since the mark. `shard_id`: this worker (a replicated fixed-size table is
    copied by worker 0 only). The result carries `live`'s marks, chain and full_reason."""
    since = since or {}
    return Snapshot(
        tables=[_copy_table(t, bufs, bufs.staging(), since, shard_id) for t in live.tables],
        dense=None if live.dense is None else {k: _freeze(v, bufs, ("dense", k)) for k, v in live.dense.items()},
        extras=_freeze(live.extras, bufs, ("extras",)),
        io_state=_freeze(live.io_state, bufs, ("io",)),
        marks=live.marks, chain=live.chain, full_reason=live.full_reason)


__all__ = ["Snapshot", "HostBuffers", "SnapshotTable", "FixedSizeSnapshotTable", "copy_snapshot"]
