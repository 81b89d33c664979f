"""Loading one sparse table's rows straight into the memory of a live `SparseState`.

Used when the table implements the optional `BulkAppend` extension, was emptied for this load, needs
no dtype cast, and no ownership function or duplicate rule has to look at rows first. Each batch of
rows is read by the engine straight into the memory the table lends (`append_views`), then committed.
No staging buffer and no second copy: on machines where touching memory is as slow as the disk, the
copy is most of a load's time. Every other load goes through `RowFilter` + `import_rows` (saver.py).

A mapped load (`LoadConfig.mmap`) goes one step further for tables that implement `AdoptStorage`: the
slot columns are mapped copy-on-write from the shard files and handed to the table as its storage, so
the load copies nothing but the ids (docs/LOADING.md, "Mapped loads").

A table whose storage is on a device (`HashTable(device="cuda")`) lends device views: each batch is read
into reusable host buffers (pinned for CUDA) and copied over on a side stream while the next batch is
read (`recckpt.state.staging.HostToDevice`).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .. import _C
from ..errors import DuplicateIdsError, InvalidArgumentError
from ..format import dtypes
from ..format.schema import SlotInfo
from ..format.segment_groups import TableRows
from ..format.sparse_io import SegmentReader
from ..state.protocol import AdoptStorage, BulkAppend, SlotSpec, SparseState, implements
from ..state.staging import HostToDevice, needs_staging
from .casting import cast_to


def _bytes_of(t: torch.Tensor, what: str):
    """Writable uint8 numpy view of a C-contiguous tensor's storage (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise InvalidArgumentError(f"{what}: staged views must be C-contiguous host tensors")
    return t.reshape(-1).view(torch.uint8).numpy()


def direct_load_possible(table: SparseState, slots: Sequence[tuple[str, SlotInfo, SlotSpec]],
                         cleared: bool) -> bool:
    return cleared and implements(table, BulkAppend) and _same_dtypes(slots)


def _same_dtypes(slots: Sequence[tuple[str, SlotInfo, SlotSpec]]) -> bool:
    return all(dtypes.torch_dtype(si.dtype) == spec.dtype for _, si, spec in slots)


def mapped_load_possible(table: SparseState, slots: Sequence[tuple[str, SlotInfo, SlotSpec]],
                         cleared: bool, local: bool) -> bool:
    return cleared and local and implements(table, AdoptStorage) and _same_dtypes(slots)


def refused_append(where: str, name: str, e: ValueError, ids: np.ndarray, first_batch: bool) -> Exception:
    """What a table's `commit_append` refusing `ids` (a batch of one load, into a table the load emptied)
    means: ids repeated within the batch are the checkpoint's (DuplicateIdsError, `proven`); in the first
    batch without a repeat, the table refused for its own reason (a capacity, say) and `e` stands; in a later
    batch an id may repeat one of an earlier batch, which is not checked here."""
    if _C.IdMap(len(ids)).insert_new(np.ascontiguousarray(ids)) != len(ids):
        return duplicate_ids_error(where, name, e, proven=True)
    return e if first_batch else duplicate_ids_error(where, name, e)


def duplicate_ids_error(where: str, name: str, e: Exception, proven: bool = False) -> DuplicateIdsError:
    """`proven`: the checkpoint's own rows were seen to repeat an id (load_apply: damage, on one worker);
    the caller raises it `from e`, which holds what repeated without the advice."""
    err = DuplicateIdsError(
        f"checkpoint {where}: table {name!r} stores an id more than once ({e}); the job that saved it "
        f"probably routed ids inconsistently. load_conf {{'duplicates': 'newest'}} keeps the copy of "
        f"the worker that saved at the highest step, if the workers recorded different steps (and says so if "
        f"one worker's own files repeat an id: a damaged checkpoint, which `recckpt verify` checks)",
        path=where, table=name)
    err.proven = proven
    return err


def map_table_rows(segments: SegmentReader, name: str, target: str, table: SparseState,
                   slots: Sequence[tuple[str, SlotInfo, SlotSpec]], bucket_lo: int, bucket_hi: int,
                   expected_rows: int, where: str) -> tuple[int, int]:
    """Map buckets [lo, hi) of checkpoint table `name` into `table` (model name `target`), which
    `mapped_load_possible` accepted; returns (rows, bytes mapped rather than copied). The storage gets
    room for half as many rows again (of `expected_rows`), the growth a table would allocate anyway,
    so that the first new ids of training do not copy the whole table out of the mapping."""
    names = [s for s, _, _ in slots]
    got = segments.map_table(name, names, [si.row_bytes for _, si, _ in slots], bucket_lo, bucket_hi,
                             spare_rows=expected_rows // 2)
    cap = len(got.ids)
    with torch.inference_mode(False):  # the table writes this storage in training, outside any such mode
        ids = torch.from_numpy(got.ids)
        cols = {s: torch.from_numpy(got.columns[s]).view(spec.dtype).view(cap, *spec.shape) for s, _, spec in slots}
    try:
        table.adopt_storage(got.rows, ids, cols)
    except ValueError as e:
        if _C.IdMap(got.rows).insert_new(got.ids[:got.rows]) == got.rows:
            raise  # not the checkpoint's ids: the table refused for its own reason
        raise duplicate_ids_error(where, name, e) from e
    return got.rows, got.bytes_mapped


def lends_host_memory(table: BulkAppend, names: Sequence[str]) -> bool:
    """Whether `table.append_views` hands out host memory for these slots. Asked with an empty append,
    which the next `append_views` discards (the protocol allows n == 0)."""
    ids_t, cols = table.append_views(0, names)
    return not any(needs_staging(t) for t in [ids_t, *cols.values()])


def load_table_rows(segments: SegmentReader, name: str, target: str, table: SparseState,
                    slots: Sequence[tuple[str, SlotInfo, SlotSpec]], bucket_lo: int, bucket_hi: int,
                    where: str) -> int:
    """Read buckets [lo, hi) of checkpoint table `name` into `table` (model name `target`), which
    `direct_load_possible` accepted; returns the number of rows loaded. The table was emptied, so an
    id it refuses as already present is an id stored twice in the checkpoint."""
    names = [s for s, _, _ in slots]
    rbs = [si.row_bytes for _, si, _ in slots]
    rows = 0
    # A table that lends host memory is read in one batch: no staging buffer bounds it (the rows go
    # straight into storage the table needs anyway), and one parallel read keeps the engine's threads and
    # its read-ahead going across what would be batch boundaries (benchmarks/README.md, "What was
    # tried" 11). Device tables are staged through host buffers, one batch of options.batch_bytes each.
    one_batch = lends_host_memory(table, names)
    upload = HostToDevice()  # host views stand in for device ones; CPU storage is read into directly
    try:
        for batch in segments.batches(name, names, rbs, bucket_lo, bucket_hi,
                                      batch_bytes=math.inf if one_batch else None, dirs_with_rows=True):
            n = batch.rows
            ids_t, cols_t = table.append_views(n, names)
            for what, t in [("ids", ids_t)] + [(f"slot {s!r}", cols_t[s]) for s in names]:
                if not t.is_contiguous():
                    raise InvalidArgumentError(f"table {target!r} {what}: append_views must return C-contiguous tensors")
            targets = [ids_t] + [cols_t[s] for s in names]
            views = upload.host_views(targets)
            segments.read_batch(batch, [_bytes_of(v, f"table {target!r}") for v in views])
            upload.upload(views, targets)  # runs while the next batch is read
            try:
                table.commit_append()
            except ValueError as e:
                ids = _bytes_of(views[0], f"table {target!r}").view(np.int64)[:n]   # (read into, not yet uploaded)
                raise refused_append(where, name, e, ids, rows == 0) from e
            rows += n
    finally:
        upload.finish()
    return rows


def put_rows(table: SparseState, got: TableRows, names: Sequence[str], target: str, where: str, name: str) -> int:
    """Append the rows of checkpoint table `name` that `segment_groups.read_rows` read for slots `names`
    (a group of small tables read in one pass) to `table` (model name `target`), which
    `direct_load_possible` accepted and which lends host memory; returns the rows loaded. One
    `append_views`, a copy per column (from the group's buffer), `commit_append`."""
    ids_t, cols_t = table.append_views(got.rows, names)
    for t, src in zip([ids_t] + [cols_t[s] for s in names], got.columns):
        try:   # (numpy's view of a host tensor: fewer tensor calls than _bytes_of, per slot of each table)
            dst = t.numpy()
        except (TypeError, RuntimeError):   # not host memory, or a dtype numpy lacks (bfloat16)
            dst = None
        if dst is None or not dst.flags.c_contiguous:
            dst = _bytes_of(t, f"table {target!r}")
        np.copyto(dst.reshape(-1).view(np.uint8), src)
    try:
        table.commit_append()
    except ValueError as e:
        raise refused_append(where, name, e, got.columns[0].view(np.int64)[:got.rows], True) from e
    return got.rows


def slot_tensors(slots, cols, n: int, table: str) -> dict[str, torch.Tensor]:
    """`cols` (uint8 rows of n rows, one per entry of `slots`: (slot, checkpoint SlotInfo, model SlotSpec))
    as tensors `import_rows` takes: the checkpoint's dtype and row shape, cast where the model's differs
    (`table`: the model table's name, for what a cast says)."""
    tensors = {}
    for (slot, si, spec), raw in zip(slots, cols):
        t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape)
        tensors[slot] = cast_to(t, spec.dtype, slot_where(slot, table))
    return tensors


def slot_where(slot: str, table: str) -> str:
    return f"slot {slot!r} of table {table!r}"
