"""Per table, on one loading rank: which of the rows streamed from the checkpoint this rank keeps.

Two questions, answered with vectorised work per segment chunk (never per row in Python):
- ownership: with `recckpt.partition` the reader already fetched only this rank's bucket range, so
  every row is kept; with a user ownership function every row was read and the function picks.
- duplicates: every kept id goes into one engine IdMap (memory ~ the rank's share of the table); an
  id seen a second time came from two workers. The LoadConfig `duplicates` rule decides.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .. import _C

# DuplicateIdsError lives in recckpt.errors; imported here also for the old import path.
from ..errors import CorruptCheckpointError, DuplicateIdsError, LoadConfigError
from ..format.names import shard_file_worker


def owners_of(ownership: Callable, ids: np.ndarray, world: int, table: str, where: str) -> np.ndarray:
    """The ranks a user ownership function gives `ids` (int64), checked: one integer rank in [0, world)
    per id. Anything else, or an exception from the function, is a LoadConfigError naming the table."""
    def bad(why: str) -> LoadConfigError:
        return LoadConfigError(f"checkpoint {where}: table {table!r}: LoadConfig.ownership {why}; it must "
                               f"return one integer rank in [0, {world}) per id (ids: int64 tensor, world: int)")
    try:
        owners = torch.as_tensor(ownership(torch.from_numpy(ids), world)).reshape(-1)
    except Exception as e:  # noqa: BLE001 - the user's function: any failure is reported as its own
        raise bad(f"raised {type(e).__name__}: {e}") from e
    if owners.numel() != ids.shape[0]:
        raise bad(f"returned {owners.numel()} ranks for {ids.shape[0]} ids")
    if owners.dtype.is_floating_point or owners.dtype.is_complex or owners.dtype == torch.bool:
        raise bad(f"returned {owners.dtype} values")
    arr = owners.cpu().numpy()
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= world):
        raise bad(f"returned ranks in [{int(arr.min())}, {int(arr.max())}]")
    return arr


class RowFilter:
    def __init__(self, table: str, where: str, *, rank: int, world: int, ownership: Callable | None,
                 rule: str, files: list[tuple[str, int]], worker_steps: dict[int, int]):
        self.table, self.where, self.rank, self.world = table, where, rank, world
        self.ownership, self.rule, self.steps = ownership, rule, worker_steps
        self.file_worker = [shard_file_worker(rel) for rel, _ in files]
        self.seen = _C.IdMap()
        self.row_worker = np.empty(0, dtype=np.int64)   # IdMap row → worker whose copy is loaded
        self.duplicates = 0        # ids met more than once
        self.undecided = 0         # duplicates the rule could not resolve
        self.example: tuple[int, int, int] | None = None   # (id, worker a, worker b)
        self.replaced = 0          # rows loaded and later replaced by a newer copy
        self.within_worker = 0     # duplicates whose copies one worker's own files hold
        self.within_example: tuple[int, int] | None = None   # (id, worker) of the first of them

    def keep(self, ids: np.ndarray, file_idx: int) -> np.ndarray | None:
        """Row indices of this chunk to import (None: all of them)."""
        sel = None
        if self.ownership is not None:
            owners = owners_of(self.ownership, ids, self.world, self.table, self.where)
            sel = np.nonzero(owners == self.rank)[0]
            ids = ids[sel]
        rows, is_new = self.seen.insert(np.ascontiguousarray(ids))
        rows, is_new = np.asarray(rows), np.asarray(is_new, dtype=bool)
        if len(self.row_worker) < len(self.seen):
            grown = np.full(max(len(self.seen), 2 * len(self.row_worker)), -1, dtype=np.int64)
            grown[:len(self.row_worker)] = self.row_worker
            self.row_worker = grown
        worker = self.file_worker[file_idx]
        w = -1 if worker is None else worker
        self.row_worker[rows[is_new]] = w
        if is_new.all():
            return sel
        dup = np.nonzero(~is_new)[0]
        self.duplicates += dup.size
        prev = self.row_worker[rows[dup]]
        if self.example is None:
            self.example = (int(ids[dup[0]]), int(prev[0]), w)
        same = (prev == w) if w >= 0 else np.zeros(len(dup), dtype=bool)
        if same.any():
            self.within_worker += int(same.sum())
            if self.within_example is None:
                self.within_example = (int(ids[dup[np.argmax(same)]]), w)
        keep_mask = is_new.copy()
        if self.rule == "newest":
            mine = self.steps.get(w) if w >= 0 else None
            uniq, inv = np.unique(prev, return_inverse=True)      # a few workers, not rows
            known = np.array([p >= 0 and int(p) in self.steps for p in uniq])[inv]
            ps = np.array([self.steps.get(int(p), 0) for p in uniq], dtype=np.int64)[inv]
            if mine is None:
                decidable = np.zeros(dup.size, dtype=bool)
            else:
                decidable = known & (prev != w) & (ps != mine)
            newer = decidable & (ps < (mine if mine is not None else 0))
            self.undecided += int((~decidable).sum())
            keep_mask[dup[newer]] = True
            self.row_worker[rows[dup[newer]]] = w
            self.replaced += int(newer.sum())
        else:
            self.undecided += dup.size
        if self.undecided:   # an error is coming: stop importing, keep counting
            return np.empty(0, dtype=np.int64)
        idx = np.nonzero(keep_mask)[0]
        return idx if sel is None else sel[idx]

    def check(self) -> None:
        """Raise if any duplicate was left undecided (call after the table's last chunk)."""
        if not self.undecided:
            return
        if self.within_worker:
            # No writer does this (a worker stores each id of a table once), and no load option can pick
            # one copy: the checkpoint is damaged, and restore() takes an older one.
            n, (i, w) = self.within_worker, self.within_example
            raise CorruptCheckpointError(
                f"checkpoint {self.where}: table {self.table!r}: worker {w}'s shard files store {n} id(s) twice "
                f"(e.g. id {i}), which no save writes: the checkpoint is damaged (`recckpt verify` checks it); "
                f"load an older one", path=self.where, table=self.table)
        i, a, b = self.example
        wa = f"worker {a}" if a >= 0 else "an unknown worker"
        wb = f"worker {b}" if b >= 0 else "an unknown worker"
        if self.rule == "newest":
            why = (f"{self.undecided} of them cannot be resolved by load_conf duplicates='newest' because "
                   f"the workers' steps are equal or were not recorded (steps: {self.steps or 'none'}; "
                   f"save with Saver.save(..., step=...))")
        else:
            why = ("load_conf {'duplicates': 'newest'} keeps the copy of the worker that saved at the "
                   "highest step, if the workers recorded different steps")
        raise DuplicateIdsError(
            f"checkpoint {self.where}: table {self.table!r} stores {self.duplicates} id(s) more than once "
            f"(e.g. id {i} in {wa} and in {wb}; among the ids loading rank {self.rank} of "
            f"{self.world} owns); the job that saved it probably routed ids inconsistently. {why}",
            path=self.where, table=self.table, rank=self.rank)
