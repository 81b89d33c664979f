"""How a live table becomes what the writer reads (`TableSource`): its bucketing (hash, row range or id
range), its column block on this process, and its rows as chunks of row bytes, whole or as the changes
since a parent."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointSaveError
from ..format import dtypes
from ..format.layout import granule_cut, row_granule, segment_rows
from ..format.schema import ColumnBlocks, SlotInfo, column_groups_for
from ..format.sparse_write import TableSource
from ..state.eviction import FREQ, LAST_STEP, EvictionPolicy
from ..state.protocol import FixedSize, RoutedRows, SparseState, column_split_slots, implements
from ..state.staging import StagingPool

log = logging.getLogger("recckpt")


def row_bytes_view(t: torch.Tensor, n: int, row_bytes: int):
    """[n, *shape] host tensor → zero-copy uint8 numpy [n, row_bytes] (contiguous copy only if needed).
    Through numpy where it can (a few torch calls less per slot of a thousand tables' chunks)."""
    try:
        a = t.numpy()
    except (TypeError, RuntimeError):   # a dtype numpy lacks (bfloat16), or a tensor that needs grad
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().reshape(n, row_bytes)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    # [n, ...] C-contiguous: its last axis is viewed as bytes in place, the reshape folds the rest of the row
    return a.view(np.uint8).reshape(n, row_bytes)


def ids_view(ids: torch.Tensor) -> np.ndarray:
    """int64 [n] host tensor (checked by the caller) → C-contiguous int64 numpy [n], zero-copy where it can."""
    try:
        a = ids.numpy()
    except (TypeError, RuntimeError):   # a tensor that needs grad, or not on the host
        a = ids.detach().cpu().numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


@dataclass(frozen=True)
class _SlotLayout:
    """How a table of given slots is written (`TableSources._slot_layout`): slot specs in column order, bytes a
    row of each slot, rows per chunk, the granule chunks are cut at, bytes a row with its id."""
    slots: dict
    row_bytes: dict
    max_rows: int
    granule: int
    whole_row: int


def step_for(step: int | None, table) -> int:
    """The step eviction rules compare `last_step` with: the save's step, else the table's own."""
    return step if step is not None else int(getattr(table, "step", 0))


class TableSources:
    """Builds the `TableSource`s of a Saver's saves. Keeps the slot layouts it worked out (a model of a
    thousand tables has a few distinct ones) and writes device tables through `staging`."""

    def __init__(self, segment_bytes: int, staging: StagingPool):
        self._segment_bytes = segment_bytes
        self._staging = staging
        self._layouts: dict[tuple, _SlotLayout] = {}   # see _slot_layout

    def source(self, table: SparseState, since: int | None = None, step: int | None = None,
               shard_id: int = 0, meta=None, write_filter: EvictionPolicy | None = None
               ) -> tuple[TableSource, TableSource | None]:
        """The table as the writer reads it: all rows, or with `since` (a mark of the parent) only the
        rows changed since, then a second source of the removed ids (None: the table is written whole).
        A replicated fixed-size table (data-parallel, or an unsharded module) is written by worker 0 only.
        `meta`: the table's `sparse_meta()`, when the caller has it. `write_filter`: as `Saver`'s."""
        meta = table.sparse_meta() if meta is None else meta
        num_rows = 0   # "hash" buckets; a fixed-size table's rows are bucketed "row_range" (docs/FORMAT.md)
        blocks, block = None, 0   # a column-split table: its column blocks and the one this process writes
        groups = None             # a fixed-size table's split slots are stored by column group (format v5)
        input_size = table.id_space() if implements(table, RoutedRows) else 0   # > 0: "id_range" buckets
        if implements(table, FixedSize):
            layout = table.row_layout()
            num_rows = layout.num_rows
            split = column_split_slots(meta)
            groups = column_groups_for(split, meta.slots[split[0]].shape[0] if split else 0)
            if layout.columns is not None and layout.column_blocks is None:
                raise CheckpointSaveError(
                    f"table {meta.name!r} is split by columns on this process (columns {layout.columns}) but "
                    f"its layout names no column_blocks (the ranges every process holds), so the processes "
                    f"cannot agree on the checkpoint's column blocks; the table's adapter must report them")
            if layout.column_blocks is not None:
                blocks = ColumnBlocks(column_split_slots(meta), layout.column_blocks)
                block = layout.column_blocks.index(layout.columns) if layout.owned_rows else 0
                since = None   # increments hold a column-split table whole (docs/FORMAT.md, Column blocks)
            if layout.replicated and shard_id != 0:
                slots = {k: SlotInfo(dtypes.name_of(s.dtype), tuple(s.shape), s.category)
                         for k, s in meta.slots.items()}
                return TableSource(meta.name, slots, 0, iter(()), num_rows=num_rows, column_groups=groups), None
        lay = self._slot_layout(meta, blocks, block)
        slots, row_bytes, max_rows, granule, whole_row = (dict(lay.slots), lay.row_bytes, lay.max_rows, lay.granule,
                                                          lay.whole_row)
        names = list(slots)
        split = set(blocks.slots) if blocks is not None else set()

        changes = None
        if since is not None:
            changes = table.export_changes(since, names, max_rows)
            if changes is None:
                log.info("recckpt: table %r cannot tell what changed since the parent; saved in full", meta.name)
        exported = table.export_chunks(names, max_rows) if changes is None else changes.chunks
        filt = write_filter
        if filt is not None and not {FREQ, LAST_STEP} <= set(names):
            log.info("recckpt: table %r has no %s/%s slots; write_filter does not apply", meta.name, FREQ, LAST_STEP)
            filt = None
        filt_step = step_for(step, table)

        def chunks():
            # Chunks on a device come back as host pieces in the staging buffers, which are reused for
            # the next piece; the writer keeps what it is given until written, so those are copied out.
            for piece in self._staging.stage(exported, f"table {meta.name!r}", granule):
                ids, cols = piece.ids, piece.cols
                if piece.borrowed:
                    ids, cols = ids.clone(), {k: c.clone() for k, c in cols.items()}
                if filt is not None:  # vectorised over the chunk's counter columns
                    keep = ~filt.select(cols[FREQ], cols[LAST_STEP], filt_step)
                    if not bool(keep.all()):
                        ids, cols = ids[keep], {k: v[keep] for k, v in cols.items()}
                    if ids.shape[0] == 0:
                        continue
                n = ids.shape[0]
                if ids.dtype != torch.int64 or ids.dim() != 1:
                    raise CheckpointSaveError(f"table {meta.name!r}: export_chunks gave ids of dtype {ids.dtype} "
                                              f"and shape {tuple(ids.shape)}; expected int64 [n]")
                out = []
                for k in names:
                    c, spec = cols.get(k), meta.slots[k]
                    if c is None:
                        raise CheckpointSaveError(f"table {meta.name!r}: export_chunks gave no column {k!r}")
                    # a split slot of a column block carries that block's columns only
                    shape = (n, *spec.shape) if k not in split else (n, *spec.shape[:-1], blocks.width(block))
                    if c.dtype != spec.dtype or tuple(c.shape) != shape:
                        raise CheckpointSaveError(
                            f"table {meta.name!r}, slot {k!r}: export_chunks gave {c.dtype} {tuple(c.shape)}; "
                            f"the table's metadata says {spec.dtype} {shape}")
                    out.append(row_bytes_view(c, n, row_bytes[k]))
                ids_np = ids_view(ids)
                cut = granule_cut(n, granule, whole_row)
                if 0 < cut < n:  # whole granules, then the short rest as its own segment
                    yield ids_np[:cut], [c[:cut] for c in out]
                    yield ids_np[cut:], [c[cut:] for c in out]
                else:
                    yield ids_np, out

        if changes is None:
            return TableSource(meta.name, slots, meta.num_rows, chunks(), num_rows=num_rows,
                               column_blocks=blocks, block=block, input_size=input_size, column_groups=groups), None
        removed = changes.removed.detach().cpu().to(torch.int64).contiguous().numpy()
        per = max(1, self._segment_bytes // 8)   # removed ids per segment
        return (TableSource(meta.name, slots, changes.rows, chunks(), num_rows=num_rows, input_size=input_size,
                            column_groups=groups),
                TableSource(meta.name, {}, len(removed),
                            ((removed[i:i + per], []) for i in range(0, len(removed), per)), num_rows=num_rows,
                            input_size=input_size))

    def _slot_layout(self, meta, blocks: ColumnBlocks | None, block: int) -> _SlotLayout:
        """How a table with `meta`'s slots (of column block `block` when split) is written; worked out once
        per distinct slots (a model of a thousand tables has a few)."""
        key = (tuple(meta.slots.items()), blocks, block, self._segment_bytes)
        lay = self._layouts.get(key)
        if lay is None:
            slots = {k: SlotInfo(dtypes.name_of(s.dtype), tuple(s.shape), s.category) for k, s in meta.slots.items()}
            split = set(blocks.slots) if blocks is not None else set()
            row_bytes = {k: slots[k].row_bytes_for(blocks.width(block) if k in split else None) for k in slots}
            # Segments of whole granules (and one short tail) keep slot rows page-aligned for mapped loads.
            lay = _SlotLayout(slots, row_bytes, segment_rows(self._segment_bytes, list(row_bytes.values())),
                              row_granule(row_bytes.values()), 8 + sum(row_bytes.values()))
            if len(self._layouts) < 1024:
                self._layouts[key] = lay
        return lay
