"""Loading one sparse table from a chain of checkpoints (a full base and increments on it).

Two passes, both vectorised (no per-row Python):
1. `plan_chain_rows`, before the model is touched: read the ids of this rank's buckets in every link
   (verifying their checksums) and each increment's removed ids; for every id the newest event wins,
   a row or a removal. The result is one keep-mask per link over its rows in read order, and the ids
   whose newest event is a removal. Memory: about 25 bytes per id the rank reads, across the links
   (the ids, not the rows).
2. `load_chain_rows`: stream each link's rows (base first) and import the kept ones. Every id is
   imported once, so no row is written twice and removed ids never reach the table. When the table
   was emptied for this load, can take rows straight into its storage (`BulkAppend`) and can remove
   ids (`remove_ids`), the base is instead read whole the fast way, the increments' winning rows are
   upserted over it and the removed ids removed at the end: the same result, at the speed of a full
   load for the base.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..format import dtypes
from ..format.checkpoint import CheckpointReader
from .row_filter import DuplicateIdsError
from .sparse_load import load_table_rows


def _read_ids(link: CheckpointReader, table: str, lo: int, hi: int) -> np.ndarray:
    parts = [ids.copy() for ids, _ in link.segments.iter_table(table, [], [], lo, hi)]
    return np.concatenate(parts) if parts else np.empty(0, dtype="<i8")


@dataclass
class ChainPlan:
    links: list[CheckpointReader]
    masks: list[np.ndarray]      # per link (base first): its rows, in read order, that hold the newest value
    removed: np.ndarray          # ids whose newest event is a removal (int64)


def plan_chain_rows(links: list[CheckpointReader], table: str, lo: int, hi: int, *, rank: int, world: int,
                    ownership: Callable | None, duplicates: str) -> ChainPlan:
    """What `load_chain_rows` keeps of each link's rows for buckets [lo, hi)."""
    ids_l, link_l, row_l, counts = [], [], [], []
    for j, link in enumerate(links):
        ids = _read_ids(link, table, lo, hi)
        counts.append(len(ids))
        gone = link.segments.removed_ids(table, lo, hi) if j else np.empty(0, dtype="<i8")
        ids_l += [ids, gone]
        link_l += [np.full(len(ids) + len(gone), j, dtype=np.int32)]
        row_l += [np.ones(len(ids), dtype=bool), np.zeros(len(gone), dtype=bool)]
    all_ids = np.concatenate(ids_l)
    link_of = np.concatenate(link_l)
    is_row = np.concatenate(row_l)
    row_pos = np.cumsum(is_row) - 1  # position of each row event among all rows (base first)
    keep_event = np.ones(len(all_ids), dtype=bool)
    if ownership is not None:  # a foreign ownership function: every row was read, keep this rank's
        owners = torch.as_tensor(ownership(torch.from_numpy(all_ids), world)).reshape(-1)
        if owners.numel() != len(all_ids):
            raise ValueError(f"LoadConfig.ownership returned {owners.numel()} ranks for {len(all_ids)} ids")
        keep_event = (owners == rank).cpu().numpy()
    idx = np.nonzero(keep_event)[0]
    order = idx[np.lexsort((link_of[idx], all_ids[idx]))]   # by id, then link (stable within a link)
    sid, slink = all_ids[order], link_of[order]
    same_next = np.zeros(len(order), dtype=bool)
    if len(order) > 1:
        same_next[:-1] = sid[1:] == sid[:-1]
    same_link_next = np.zeros(len(order), dtype=bool)
    if len(order) > 1:
        same_link_next[:-1] = slink[1:] == slink[:-1]
    dup = np.nonzero(same_next & same_link_next)[0]
    if len(dup) and duplicates == "error":
        d = order[dup[0]]
        raise DuplicateIdsError(
            f"{links[link_of[d]].describe()}: table {table!r}: id {int(all_ids[d])} is stored more than once "
            f"in this link of the chain (by two workers); load_conf duplicates='newest' or 'any' keeps one copy")
    winners = order[~same_next]  # the newest event of every id (the last in id, link order)
    keep = np.zeros(int(is_row.sum()), dtype=bool)
    won_rows = winners[is_row[winners]]
    keep[row_pos[won_rows]] = True
    removed = all_ids[winners[~is_row[winners]]]
    return ChainPlan(list(links), list(np.split(keep, np.cumsum(counts)[:-1])), removed)


def load_chain_rows(plan: ChainPlan, table: str, target: str, target_table, slots, lo: int, hi: int,
                    direct: bool) -> int:
    """Import the kept rows of every link into `target_table` (a SparseState); returns the rows it holds
    from the chain. `direct`: the table was emptied for this load and takes the base whole through
    `BulkAppend` (see the module docstring)."""
    remove = getattr(target_table, "remove_ids", None)
    direct = direct and (len(plan.removed) == 0 or callable(remove))
    total = 0
    first = 0
    if direct:
        base = plan.links[0]
        total += load_table_rows(base.segments, table, target, target_table, slots, lo, hi, base.describe())
        total -= int((~plan.masks[0]).sum())   # base rows replaced or removed by later links
        first = 1
    for link, mask in list(zip(plan.links, plan.masks))[first:]:
        total += _import_kept(link, mask, table, target_table, slots, lo, hi, upsert=direct)
    if direct and len(plan.removed):
        remove(torch.from_numpy(plan.removed))
    return total


def _import_kept(link, mask, table, target_table, slots, lo, hi, upsert: bool) -> int:
    names = [s for s, _, _ in slots]
    rbs = [si.row_bytes for _, si, _ in slots]
    pos = total = 0
    for ids, cols in link.segments.iter_table(table, names, rbs, lo, hi):
        n = len(ids)
        keep = mask[pos:pos + n]
        pos += n
        if not keep.any():
            continue
        if not keep.all():  # else the views of the read buffer go in as they are (import_rows copies)
            ids, cols = ids[keep], [raw[keep] for raw in cols]
        k = len(ids)
        tensors = {}
        for (slot, si, spec), raw in zip(slots, cols):
            t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(k, *si.shape)
            tensors[slot] = t.to(spec.dtype) if t.dtype != spec.dtype else t
        target_table.import_rows(torch.from_numpy(ids), tensors)
        # an upserted id the base also held replaced its row: counted once, in the base's correction
        total += k
    if pos != len(mask):
        raise RuntimeError(f"{link.describe()}: table {table!r}: the rows read changed between the two "
                           f"passes of a chain load ({pos} vs {len(mask)})")
    return total
