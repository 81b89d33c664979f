"""Loading one sparse table from a chain of checkpoints (a full base and increments on it).

The chain rule (newest event wins, removed ids stay removed) lives in `recckpt.format.fold`; this
module applies its result to a live table, in two passes:
1. `plan_chain`, before the model is touched: a `FoldPlan` per bucket group of this rank's range
   (ids of every link read and verified, where each winning row goes decided by the engine).
   Memory kept until the load: 16 bytes per winning row of an increment, plus holes.
2. `load_chain_rows`: per group, the folded rows are written once into their final place. When the
   table was emptied for this load and lends its storage (`BulkAppend`), that place is the table's
   own memory: the base is read there straight from the shard files, as in a full load, and the
   increments' winning rows are copied over it from a reused read buffer. Other tables (a dtype cast,
   an ownership function, a table without `BulkAppend`, a device table) get the folded rows of each
   group through `import_rows`. Rows whose id ends removed are dropped (`remove_ids` at the end for
   the first kind).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..format.checkpoint import CheckpointReader
from ..format.fold import FoldPlan, Scratch, bucket_groups, fill_fold, folded_arrays, plan_fold
from .row_filter import owners_of
from .sparse_load import duplicate_ids_error, slot_tensors

#: Bytes of chain rows planned per bucket group of a load: bounds the transient memory of planning
#: (the ids of a group, about 60 bytes each while the engine folds them).
LOAD_GROUP_BYTES = 1 << 30


@dataclass(frozen=True)
class ChainPlan:
    groups: tuple[FoldPlan, ...]

    @property
    def out_rows(self) -> int:
        return sum(g.out_rows for g in self.groups)


def plan_chain(links: list[CheckpointReader], table: str, lo: int, hi: int, *, rank: int, world: int,
               ownership: Callable | None, duplicates: str,
               keep: Callable[[np.ndarray], np.ndarray] | None = None) -> ChainPlan:
    """The fold plans of `table` over `links` (base first) for buckets [lo, hi), one per bucket group.
    With a foreign `ownership` function every bucket was read and only this rank's ids are kept; `keep`
    (ids -> bool mask) says which ids to keep instead, where the model table decides (`RoutedRows`)."""
    if ownership is not None:
        where = links[-1].describe()

        def keep(ids: np.ndarray) -> np.ndarray:
            return owners_of(ownership, ids, world, table, where) == rank
    return ChainPlan(tuple(plan_fold(links, table, g_lo, g_hi, duplicates=duplicates, keep=keep)
                           for g_lo, g_hi in bucket_groups(links, table, lo, hi, LOAD_GROUP_BYTES)))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def load_chain_rows(plan: ChainPlan, table: str, target: str, target_table, slots, direct: bool) -> int:
    """Write the folded rows of `plan` into `target_table` (a SparseState); returns the rows it holds
    from the chain. `direct`: the table was emptied for this load and supports `BulkAppend`."""
    names = [s for s, _, _ in slots]
    rbs = [si.row_bytes for _, si, _ in slots]
    remove = getattr(target_table, "remove_ids", None)
    total = 0
    gone = []
    scratch = Scratch()
    for g in plan.groups:
        if g.out_rows == 0:
            continue
        # the base is read in place only if no base row was left out before folding (such a row's id
        # may live on in another copy, which a removal of its id would take too)
        if direct and g.base_skipped == 0 and (len(g.holes) == 0 or callable(remove)):
            ids_t, cols_t = target_table.append_views(g.out_rows, names)
            views = [ids_t] + [cols_t[s] for s in names]
            if all(v.device.type == "cpu" and v.is_contiguous() for v in views):
                fill_fold(g, names, rbs, _bytes_of(ids_t), [_bytes_of(v) for v in views[1:]], scratch)
                try:
                    target_table.commit_append()
                except ValueError as e:
                    raise duplicate_ids_error(g.links[-1].describe(), table, e) from e
                if len(g.holes):
                    gone.append(g.hole_ids)
                total += g.rows
                continue
            # device storage: never committed, so the next call discards the views; fold on the host
        total += _import_folded(g, table, target_table, slots, names, rbs, scratch)
    if gone:
        remove(torch.from_numpy(np.concatenate(gone)))
    return total


def _import_folded(g: FoldPlan, table: str, target_table, slots, names, rbs, scratch: Scratch) -> int:
    ids, cols = folded_arrays(g, names, rbs, scratch)
    k = len(ids)
    if k == 0:
        return 0
    target_table.import_rows(torch.from_numpy(ids), slot_tensors(slots, cols, k, table))
    return k
