"""Eviction: which rows of a table with counters (``freq``, ``last_step``) leave it, or are left out.

Two uses of one rule (:class:`EvictionPolicy`), as Saver options:
- ``Saver(eviction=...)``: applied when a checkpoint is captured, it removes the selected rows from the
  live table (``HashTable.evict``); the removed ids are recorded in the next incremental checkpoint.
- ``Saver(write_filter=...)``: only shapes what is written; the live table keeps every row.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

__all__ = ["EvictionPolicy", "FREQ", "LAST_STEP"]

#: Counter slots an eviction rule reads (int64, one per row): lookups in training, and the training
#: step of the row's last update. ``HashTable(counters=True)`` keeps them; any table may.
FREQ = "freq"
LAST_STEP = "last_step"


def _opt_int(v, name: str, lo: int):
    if v is None:
        return None
    if isinstance(v, bool):
        raise InvalidArgumentError(f"EvictionPolicy.{name} must be an int or None, got {v!r}")
    try:
        v = operator.index(v)
    except TypeError:
        raise InvalidArgumentError(f"EvictionPolicy.{name} must be an int or None, got {v!r}") from None
    if not lo <= v < 1 << 63:   # compared with int64 counters
        raise InvalidArgumentError(f"EvictionPolicy.{name} must be in [{lo}, 2**63 - 1], got {v}")
    return v


@dataclass(frozen=True)
class EvictionPolicy:
    """Select rows not updated for more than ``max_idle_steps`` steps (``last_step < step -
    max_idle_steps``) or looked up fewer than ``min_freq`` times in training. A row meeting either
    condition is selected. At least one of the two must be given."""

    max_idle_steps: int | None = None
    min_freq: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "max_idle_steps", _opt_int(self.max_idle_steps, "max_idle_steps", 0))
        object.__setattr__(self, "min_freq", _opt_int(self.min_freq, "min_freq", 1))
        if self.max_idle_steps is None and self.min_freq is None:
            raise InvalidArgumentError("EvictionPolicy needs max_idle_steps or min_freq (or both)")

    def select(self, freq: torch.Tensor, last_step: torch.Tensor, step: int) -> torch.Tensor:
        """Bool mask of the rows this policy selects (vectorised over the counter columns)."""
        out = torch.zeros(freq.shape[0], dtype=torch.bool)
        if self.max_idle_steps is not None:
            out |= last_step < step - self.max_idle_steps
        if self.min_freq is not None:
            out |= freq < self.min_freq
        return out
