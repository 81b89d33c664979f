"""Per-row counters of a HashTable and the eviction that reads them.

Owns whether a table counts (:class:`Counting`), what a lookup and a write do to the ``freq`` and
``last_step`` slots, and removing rows: by an :class:`~recckpt.state.eviction.EvictionPolicy` over
the counters, or by id (:meth:`CountersAndEviction.remove_ids`, which chain loads also use). The
counter slots themselves are ordinary slots of the table's store (:mod:`.storage`).
"""
from __future__ import annotations

import torch

from recckpt.state.eviction import FREQ, LAST_STEP

from .changes import ChangeLog
from .storage import RowStore, unique_inverse


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

    def written(self, store: RowStore, rows: torch.Tensor, step: int) -> None:
        """The embeddings of ``rows`` were written (an optimizer step) at ``step``."""
        if self.enabled:
            last = store.columns[LAST_STEP]
            last.index_fill_(0, rows.to(last.device), step)
