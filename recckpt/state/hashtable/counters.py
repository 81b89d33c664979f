"""Per-row counters of a HashTable and the eviction that reads them.

Owns whether a table counts (:class:`Counting`), what a lookup and a write do to the ``freq`` and
``last_step`` slots, and removing rows: by an :class:`~recckpt.state.eviction.EvictionPolicy` over
the counters, or by id (:meth:`CountersAndEviction.remove_ids`, which chain loads also use). The
counter slots themselves are ordinary slots of the table's store (:mod:`.storage`).
"""
from __future__ import annotations

from typing import Optional

import torch

from recckpt.state.eviction import FREQ, LAST_STEP

from ...errors import InvalidArgumentError
from .changes import ChangeLog
from .storage import RowStore, flat_ids, unique_inverse


class Counting:
    """Whether the table keeps its counters up to date (``counters=True`` or ``enable_counters()``).

    Attributes:
        enabled: counting is on; the ``freq`` and ``last_step`` slots exist.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled

    def looked_up(self, store: RowStore, change_log: ChangeLog, rows: torch.Tensor, old: int, step: int) -> None:
        """``rows`` were looked up in training at ``step``, rows ``>= old`` inserted by that lookup:
        freq += lookups per row, and new rows start their last_step at the step."""
        if not self.enabled or not rows.numel():
            return
        uniq, inv = unique_inverse(rows)
        store.columns[FREQ].index_add_(0, uniq, torch.bincount(inv, minlength=uniq.numel()))
        store.columns[LAST_STEP][old:store.size] = step
        change_log.stamp(uniq)  # the counters are part of the row: a looked-up row changed

    def inserted(self, store: RowStore, old: int, new: int, given, step: int) -> None:
        """Rows ``[old, new)`` were inserted other than by a lookup (a load, ``import_rows``) with the slots
        ``given``: without their own ``last_step`` they start at ``step``, as a lookup's new rows do (the
        slot's fixed initial value, 0, would make an idle-based eviction remove a whole warm start at the
        next save)."""
        if self.enabled and LAST_STEP not in given and new > old:
            store.columns[LAST_STEP][old:new] = step

    def written(self, store: RowStore, rows: torch.Tensor, step: int) -> None:
        """The embeddings of ``rows`` were written (an optimizer step) at ``step``."""
        if self.enabled:
            last = store.columns[LAST_STEP]
            last.index_fill_(0, rows.to(last.device), step)


class CountersAndEviction:
    """The table's counter and removal methods (a mixin of :class:`~recckpt.state.hashtable.HashTable`,
    over its ``store``, ``counting``, ``grads`` and ``change_log``)."""

    def enable_counters(self) -> None:
        """Add the ``freq`` and ``last_step`` counter slots (kept if present) and start counting; see
        the ``counters`` constructor argument. Existing rows start at ``freq = 0`` and
        ``last_step = step``."""
        self.add_slot(FREQ, torch.int64, (), 0, "sparse", exist_ok=True)
        self.add_slot(LAST_STEP, torch.int64, (), 0, "sparse", exist_ok=True)
        if not self.counting.enabled:
            self.store.columns[LAST_STEP][: self.store.size] = self.step
        self.counting.enabled = True

    def evict(self, policy, step: Optional[int] = None) -> int:
        """Remove the rows `policy` (an :class:`recckpt.state.eviction.EvictionPolicy`) selects at
        ``step`` (default :attr:`step`); returns how many. Needs the counters (``counters=True``)."""
        if not self.counting.enabled:
            raise InvalidArgumentError(f"table {self.name!r}: eviction needs the freq/last_step counters: create it "
                             f"with HashTable(..., counters=True) or call enable_counters()")
        step = self.step if step is None else step
        n = self.store.size
        doomed = policy.select(self.store.columns[FREQ][:n], self.store.columns[LAST_STEP][:n], step)
        if not bool(doomed.any()):
            return 0
        return self.remove_ids(self.store.ids[:n][doomed])

    def remove_ids(self, ids: torch.Tensor) -> int:
        """Remove ``ids`` (int64, any shape; absent ids are ignored) from the table; returns how many
        were removed. The remaining rows move down to stay dense (vectorised, O(len(self))), so row
        numbers change: pending gradients are dropped. Removed ids are recorded for the next
        incremental checkpoint."""
        flat = flat_ids(ids, "ids", self.name)
        if flat.numel() == 0 or self.store.size == 0:
            return 0
        rows = self.store.lookup(flat)
        rows = torch.unique(rows[rows >= 0])
        if rows.numel() == 0:
            return 0
        keep = torch.ones(self.store.size, dtype=torch.bool)
        keep[rows] = False
        gone_ids = self.store.ids.index_select(0, rows)
        self.store.keep_rows(torch.nonzero(keep).reshape(-1))
        self.grads.invalidate()  # gradients of earlier forwards point at old row numbers
        self.change_log.removed(gone_ids)
        return int(rows.numel())
