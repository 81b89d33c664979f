"""Reading the rows of tables that keep their rows through a load (`FixedSize`: TorchRec's sharded tables,
by global row index; `RoutedRows`: managed-collision tables, by id range): which bucket ranges hold this
process's rows, and the reads that put them in place (straight into the storage the table lends where it
can, else imported row range by row range). The loader (`load_apply`) decides when; this module says how.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import IncompatibleCheckpointError
from ..format import dtypes
from ..format.checkpoint import CheckpointReader
from ..format.column_join import FROM_OVERLAP, iter_joined
from ..format.hashing import id_range_buckets
from ..format.schema import Manifest
from ..state.protocol import column_split_slots, pieces_of
from .casting import cast_to
from .fixed_rows import DirectRows, OwnedRows
from .sparse_load import slot_tensors, slot_where


def load_fixed(reader: CheckpointReader, name: str, target: str, table, slots) -> int:
    """Rows of a fixed-size table (TorchRec's): this process keeps the row ids its layout owns (all
    of them when replicated) and the columns it holds of column-split slots. A table saved with
    format version 4's "row_range" buckets over the same N rows is read by the bucket ranges that
    hold the owned rows only (docs/FORMAT.md: what a loading rank reads); one saved with "hash"
    buckets spreads a row range over every bucket, so every bucket is read. A row outside [0, N) is
    refused with the table's name. A process holding several column ranges (`ColumnPieces`) fills each
    in turn where each reads only its own columns; else it reads whole rows once for all of them. The rows
    count once."""
    pieces = pieces_of(table)
    if len(pieces) > 1:
        split, names = set(column_split_slots(table.sparse_meta())), [s for s, _, _ in slots]
        if reader.manifest.tables[name].column_blocks is None and all(
                column_window(reader.manifest, name, p.row_layout(), split, names) is None for p in pieces):
            return _load_pieces_once(reader, name, target, pieces, slots)
        return max(load_fixed(reader, name, target, p, slots) for p in pieces)
    layout = table.row_layout()
    if not layout.owned_rows:
        return 0   # this process holds no rows of the table (table-wise, another rank's)
    if reader.manifest.tables[name].column_blocks is not None:
        return _load_fixed_blocks(reader, name, target, table, slots, layout)
    rows = 0
    for lo, hi in fixed_bucket_ranges(reader.manifest, name, layout):
        rows += _load_fixed_range(reader, name, target, table, slots, layout, lo, hi)
    return rows


def _load_pieces_once(reader: CheckpointReader, name: str, target: str, pieces, slots) -> int:
    """A checkpoint that only gives whole rows (hash buckets, no column groups) into several column
    ranges of one process: each row read once, every range keeping its rows and columns (`EveryPiece`)."""
    sink = OwnedRows.of_pieces(pieces, target, reader.describe())
    names, rbs = [s for s, _, _ in slots], [si.row_bytes for _, si, _ in slots]
    for lo, hi in _merged(r for p in pieces for r in fixed_bucket_ranges(reader.manifest, name, p.row_layout())):
        for ids, cols in reader.segments.iter_table(name, names, rbs, lo, hi):
            sink.import_rows(torch.from_numpy(np.ascontiguousarray(ids)), slot_tensors(slots, cols, len(ids), target))
    return sink.rows


def _merged(ranges) -> list[tuple[int, int]]:
    """Ranges [lo, hi) sorted, those that overlap or touch joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def fixed_bucket_ranges(m: Manifest, name: str, layout) -> list[tuple[int, int]]:
    """The bucket ranges that hold a fixed-size table's owned rows: by row range when the checkpoint
    bucketed the table "row_range" over the same N, else every bucket."""
    info, nb = m.tables[name], m.num_buckets
    if layout.replicated or info.bucket_fn != "row_range" or info.num_rows != layout.num_rows:
        return [(0, nb)]
    n = layout.num_rows
    return _merged((a * nb // n, (b - 1) * nb // n + 1) for a, b in layout.owned_rows)


def _load_fixed_range(reader: CheckpointReader, name: str, target: str, table, slots, layout, bucket_lo: int,
                      bucket_hi: int) -> int:
    """The owned rows of one bucket range of a fixed-size table (see `load_fixed`): read straight into
    the storage the table lends (`DirectRows`) where it can, else read and imported row by row range."""
    starts = np.array([a for a, _ in layout.owned_rows], dtype=np.int64)
    ends = np.array([b for _, b in layout.owned_rows], dtype=np.int64)
    split = set(column_split_slots(table.sparse_meta()))
    c0, c1 = layout.columns or (0, None)
    names, rbs = [s for s, _, _ in slots], [si.row_bytes for _, si, _ in slots]
    window = column_window(reader.manifest, name, layout, split, names)
    if window is not None:   # the columns this process holds of the split slots, read alone
        geo = reader.manifest.tables[name].geometry(reader.manifest.format_version)
        rbs = [geo.place(s).row_bytes(window) for s in names]
    segments, where = reader.segments, reader.describe()
    direct = DirectRows.of(table, slots, lambda si: dtypes.torch_dtype(si.dtype))
    rows = 0
    for batch in segments.batches(name, names, rbs, bucket_lo, bucket_hi, columns=window):
        if direct is not None and window is None:
            n = direct.load_batch(segments, batch, name, target, where)
            if n is not None:
                rows += n
                continue
        for ids, cols, _ in batch.split(segments.read_batch(batch)):
            rows += _import_owned(where, name, target, table, slots, layout, ids, cols, starts, ends, split, c0, c1,
                                       window is not None)
    return rows


def column_window(m: Manifest, name: str, layout, split: set, names: list[str]) -> "tuple[int, int] | None":
    """The columns [c0, c1) to read of a table saved with column groups (format version 5) when this
    process holds only those of its split slots: then a read takes only the groups holding them
    (docs/FORMAT.md, what a loading rank reads). None: read whole rows (and keep the columns held)."""
    groups = m.tables[name].column_groups
    if layout.columns is None or groups is None:
        return None
    grouped = [s for s in names if s in groups.slots]
    if not grouped or any(s not in split for s in grouped):
        return None   # the model splits other slots than the checkpoint grouped: whole rows, cut below
    return layout.columns


def _import_owned(where: str, name, target, table, slots, layout, ids, cols, starts, ends, split, c0, c1,
                  narrowed: bool = False) -> int:
    """One segment's rows (`ids`, raw slot columns) into a fixed-size table: the owned rows only.
    `narrowed`: the split slots were read in this process's columns only."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_rows):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise IncompatibleCheckpointError(
            f"checkpoint {where}: table {name!r} holds row id {bad}, outside model "
            f"table {target!r}'s {layout.num_rows} rows", table=target)
    if not layout.replicated:
        k = np.searchsorted(starts, ids, side="right") - 1
        mask = (k >= 0) & (ids < ends[np.maximum(k, 0)])
        if not mask.all():   # (a fancy-indexed copy of every column only where rows are dropped)
            keep = np.nonzero(mask)[0]
            ids, cols = ids[keep], [c[keep] for c in cols]
    n = len(ids)
    if n == 0:
        return 0
    tensors = {}
    for (slot, si, spec), raw in zip(slots, cols):
        t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype))
        if narrowed and slot in split:
            t = t.reshape(n, -1)
        else:
            t = t.reshape(n, *si.shape)
            if slot in split and layout.columns is not None:
                t = t[:, c0:c1]
        tensors[slot] = cast_to(t, spec.dtype, slot_where(slot, target)).contiguous()
    table.import_rows(torch.from_numpy(np.ascontiguousarray(ids)), tensors)
    return n


def _load_fixed_blocks(reader: CheckpointReader, name: str, target: str, table, slots, layout) -> int:
    """A fixed-size table saved column-split (a column-wise plan): this process reads its owned rows of
    the column blocks that overlap its columns only (`column_join`). A per-row (unsplit) slot is each
    block's own value (RowWiseAdagrad's per-column-shard state): this process gets the width-weighted
    mean over the blocks it reads, weighted by the columns of its own each holds, so an unchanged split
    gets each shard's own value back and a whole-row process the row-wise value (docs/TORCHREC.md)."""
    return load_blocks(reader, name, table, slots, list(layout.owned_rows), layout.columns)


def load_blocks(reader: CheckpointReader, name: str, table, slots, row_ranges, columns, keep=None) -> int:
    """Rows `row_ranges` of a table saved column-split, columns `columns` (None: all) of its split slots, into
    `table.import_rows`; per-row slots as `_load_fixed_blocks` says. `keep`: ids -> bool mask of the rows to
    import (a hash-keyed table of several processes keeps its own ids), None: all. Memory: one chunk."""
    info = reader.manifest.tables[name]
    names = [s for s, _, _ in slots]
    spec_of = {s: (si, spec) for s, si, spec in slots}
    row_bytes = sum(si.row_bytes for _, si, _ in slots) + 8
    chunk = max(1, reader.segments.options.batch_bytes // row_bytes)
    rows = 0
    for ids, split, unsplit in iter_joined(reader.segments, name, info, names, row_ranges, columns, chunk,
                                           FROM_OVERLAP):
        if keep is not None:
            sel = np.nonzero(keep(ids))[0]
            ids = ids[sel]
            split = {s: v[sel] for s, v in split.items()}
            unsplit = {s: [(w, v[sel]) for w, v in parts] for s, parts in unsplit.items()}
        n = len(ids)
        if n == 0:
            continue
        tensors = {}
        for s, raw in split.items():
            si, spec = spec_of[s]
            t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape[:-1], -1)
            tensors[s] = cast_to(t, spec.dtype, slot_where(s, name)).contiguous()
        for s, parts in unsplit.items():
            si, spec = spec_of[s]
            ts = [(w, torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape))
                  for w, raw in parts]
            if len(ts) == 1 or not ts[0][1].is_floating_point():
                t = ts[0][1]
            else:
                t = (sum(x.to(torch.float64) * w for w, x in ts) / sum(w for w, _ in ts)).to(ts[0][1].dtype)
            tensors[s] = cast_to(t, spec.dtype, slot_where(s, name)).contiguous()
        table.import_rows(torch.from_numpy(ids), tensors)
        rows += n
    return rows


def load_routed(reader: CheckpointReader, name: str, table, slots) -> int:
    """Rows of a `RoutedRows` table: the buckets that can hold this process's ids (`routed_bucket_ranges`)
    are read, and the table keeps the ids it planned to (`prepare` called `plan_rows`; `clear_rows`
    installed them)."""
    names, rbs = [s for s, _, _ in slots], [si.row_bytes for _, si, _ in slots]
    rows = 0
    for ids, cols in (part for lo, hi in routed_bucket_ranges(reader.manifest, name, table)
                      for part in reader.segments.iter_table(name, names, rbs, lo, hi)):
        t_ids = torch.from_numpy(ids)
        keep = table.keep(t_ids)
        n = int(keep.sum())
        if n == 0:
            continue
        tensors = {}
        for (slot, si, spec), raw in zip(slots, cols):
            t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(len(ids), *si.shape)[keep]
            tensors[slot] = cast_to(t, spec.dtype, slot_where(slot, name)).contiguous()
        table.import_rows(t_ids[keep].contiguous(), tensors)
        rows += n
    return rows


def routed_bucket_ranges(m: Manifest, name: str, table) -> list[tuple[int, int]]:
    """The bucket ranges that can hold a `RoutedRows` table's ids of this process: those of its id range
    (`owned_ids`) when the checkpoint bucketed the table "id_range", plus the reserved bucket; else (a
    "hash" table: every checkpoint before the id_range function, or an unsharded target) every bucket."""
    info, nb = m.tables[name], m.num_buckets
    owned = table.owned_ids()
    if info.bucket_fn != "id_range" or owned is None:
        return [(0, nb)]
    return id_range_buckets(owned[0], owned[1], info.input_size, nb)
