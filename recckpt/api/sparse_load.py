"""Loading one sparse table's rows from a checkpoint into a live `SparseState`.

Two paths, same result:
- direct: the table implements the optional `BulkAppend` extension, was emptied for this load and
  needs no dtype cast. Each batch of rows is read by the engine straight into the memory the table
  lends (`append_views`), then committed. No staging buffer and no second copy: on machines where
  touching memory is as slow as the disk, the copy is most of a load's time.
- general: rows are read into a reused scratch buffer, cast where needed, and upserted with
  `import_rows` (merge loads, casts, tables without the extension).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import CorruptCheckpointError
from ..format import dtypes
from ..format.schema import SlotInfo
from ..format.sparse_io import SegmentReader
from ..state.protocol import BulkAppend, SlotSpec, SparseState


def _bytes_of(t: torch.Tensor, what: str):
    """Writable uint8 numpy view of a C-contiguous tensor's storage (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{what}: append_views must return C-contiguous CPU tensors")
    return t.reshape(-1).view(torch.uint8).numpy()


def load_table_rows(segments: SegmentReader, name: str, target: str, table: SparseState,
                    slots: Sequence[tuple[str, SlotInfo, SlotSpec]], bucket_lo: int, bucket_hi: int,
                    cleared: bool) -> int:
    """Read buckets [lo, hi) of checkpoint table `name` into `table` (model name `target`); returns
    the number of rows loaded. `cleared`: the table was emptied for this load (replace semantics)."""
    names = [s for s, _, _ in slots]
    rbs = [si.row_bytes for _, si, _ in slots]
    no_cast = all(dtypes.torch_dtype(si.dtype) == spec.dtype for _, si, spec in slots)
    direct = cleared and no_cast and isinstance(table, BulkAppend)
    rows = 0
    for batch in segments.batches(name, names, rbs, bucket_lo, bucket_hi):
        n = batch.rows
        if direct:
            ids_t, cols_t = table.append_views(n, names)
            dst = [_bytes_of(ids_t, f"table {target!r} ids")]
            dst += [_bytes_of(cols_t[s], f"table {target!r} slot {s!r}") for s in names]
            segments.read_batch(batch, dst)
            try:
                table.commit_append()
            except ValueError as e:
                # Ids are unique within a checkpoint (docs/FORMAT.md): a repeat means a bad writer.
                raise CorruptCheckpointError(f"{segments.storage.describe(segments.ckpt_dir)}: table {name!r}: "
                                             f"{e}; a checkpoint never repeats an id") from e
        else:
            cols = segments.read_batch(batch)
            tensors = {}
            for (slot, si, spec), raw in zip(slots, cols[1:]):
                t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape)
                tensors[slot] = t.to(spec.dtype) if t.dtype != spec.dtype else t
            table.import_rows(torch.from_numpy(cols[0].view("<i8")), tensors)
        rows += n
    return rows
