"""Change tracking of a HashTable: which rows were written after a mark, which ids left since it.

:class:`ChangeLog` owns one generation stamp per row (the generation in which the row was last
written), the current generation, the oldest mark that still describes the table, and the log of
removed ids; :class:`ChangeTracking` is the table's side of the optional
:class:`~recckpt.state.protocol.ChangeTracking` protocol on top of it. The storage
(:mod:`.storage`) tells the log when rows are allocated, created or moved; the table's writers stamp
the rows they write.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple

import torch

from recckpt.state.protocol import Changes

from ...errors import InvalidArgumentError

#: dtype of the change-tracking stamps: one generation number a row (a mark per save fits 2**31 saves);
#: 4 bytes rather than 8 keeps the stamps of a training step's random rows in fewer cache lines.
STAMP_DTYPE = torch.int32


class ChangeLog:
    """Row stamps and removed ids of one table; when disabled (``track_changes=False``, ``stamps``
    None) every update is a no-op and no mark describes the table.

    Attributes:
        stamps: host ``int32[capacity]``; row ``i`` was last written in generation ``stamps[i]``.
        gen: the current generation; :meth:`mark` closes it.
        valid_from: marks older than this cannot describe the changes (cleared, slot added, adopted).
        removed_log: ``(generation, ids)`` of the ids removed in each generation.
    """

    def __init__(self, stamps: Optional[torch.Tensor], gen: int = 1, valid_from: int = 0,
                 removed_log: Optional[List[Tuple[int, torch.Tensor]]] = None) -> None:
        if stamps is not None and stamps.dtype != STAMP_DTYPE:
            stamps = stamps.to(STAMP_DTYPE)   # pickled before the stamps were int32
        self.stamps = stamps
        self.gen = gen
        self.valid_from = valid_from
        self.removed_log = [] if removed_log is None else removed_log

    @classmethod
    def new(cls, enabled: bool, capacity: int) -> "ChangeLog":
        with torch.inference_mode(False):  # see RowStore.realloc
            return cls(torch.zeros(capacity, dtype=STAMP_DTYPE) if enabled else None)

    @property
    def enabled(self) -> bool:
        return self.stamps is not None

    # ------------------------------------------------------------------ what the storage tells it
    def resize(self, cap: int, n: int) -> None:
        """The storage now has ``cap`` rows, of which the first ``n`` are in use."""
        if self.stamps is not None:
            new_stamps = torch.zeros(cap, dtype=STAMP_DTYPE)
            if n:
                new_stamps[:n].copy_(self.stamps[:n])
            self.stamps = new_stamps

    def stamp_range(self, old: int, new: int) -> None:
        """Rows ``[old, new)`` were created now."""
        if self.stamps is not None:
            self.stamps[old:new] = self.gen

    def keep(self, kept: torch.Tensor) -> None:
        """Only rows ``kept`` remain, moved down to rows ``[0, len(kept))``."""
        if self.stamps is not None:
            self.stamps[: kept.numel()] = self.stamps.index_select(0, kept)

    def adopt(self, cap: int) -> None:
        """The storage was replaced by ``cap`` rows of unknown history: every row counts as changed."""
        if self.stamps is not None:
            with torch.inference_mode(False):
                self.stamps = torch.full((cap,), self.gen, dtype=STAMP_DTYPE)

    # ------------------------------------------------------------------ what the table's writers tell it
    def stamp(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` (int64, any device) were written now."""
        if self.stamps is not None:
            self.stamps.index_fill_(0, rows.to(self.stamps.device), self.gen)

    def removed(self, ids: torch.Tensor) -> None:
        """Ids ``ids`` left the table now."""
        if self.stamps is not None:
            self.removed_log.append((self.gen, ids))

    def forget(self) -> None:
        """Every earlier mark stops describing the table (it was cleared, replaced or got a slot)."""
        self.valid_from = self.gen
        self.removed_log = []

    # ------------------------------------------------------------------ marks
    def mark(self) -> int:
        mark = self.gen
        self.gen += 1
        return mark

    def describes(self, since: object) -> bool:
        """Whether mark ``since`` can still tell the changes made after it."""
        return self.stamps is not None and isinstance(since, int) and self.valid_from <= since < self.gen

    def changed_rows(self, since: int, size: int) -> torch.Tensor:
        """Rows of ``[0, size)`` written after mark ``since`` (``describes(since)`` must hold)."""
        return torch.nonzero(self.stamps[:size] > since).reshape(-1)

    def removed_since(self, since: int) -> torch.Tensor:
        """Unique ids removed after mark ``since`` (some may be in the table again)."""
        gone = [ids for gen, ids in self.removed_log if gen > since]
        return torch.unique(torch.cat(gone)) if gone else torch.empty(0, dtype=torch.int64)

    def forget_upto(self, upto: int) -> None:
        self.removed_log = [(g, ids) for g, ids in self.removed_log if g > upto]


class ChangeTracking:
    """The table's change-tracking methods (a mixin of :class:`~recckpt.state.hashtable.HashTable`,
    over its ``store`` and ``change_log``)."""

    @property
    def tracks_changes(self) -> bool:
        """Whether the table keeps change stamps (the ``track_changes`` constructor argument)."""
        return self.change_log.enabled

    def mark_changes(self) -> int:
        """Close the current generation of changes and return its mark; see
        :meth:`recckpt.state.protocol.ChangeTracking.mark_changes`."""
        return self.change_log.mark()

    def export_changes(self, since: int, slots: Sequence[str], max_rows: int) -> Optional[Changes]:
        """Rows inserted or written after mark ``since`` and ids removed since it; ``None`` if the
        table does not track changes or ``since`` no longer describes it. See
        :meth:`recckpt.state.protocol.ChangeTracking.export_changes`."""
        slots = list(slots)
        for s in slots:
            self.store.check_slot(s)
        if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
            raise InvalidArgumentError(f"table {self.name!r}: max_rows must be an int >= 1, got {max_rows!r}")
        if not self.change_log.describes(since):
            return None
        rows = self.change_log.changed_rows(since, self.store.size)
        removed = self.change_log.removed_since(since)
        if removed.numel():  # an id removed and inserted again since the mark is a changed row
            removed = removed[self.store.lookup(removed) < 0]
        return Changes(rows.numel(), self.store.chunks(slots, int(max_rows), self.store.version, rows), removed)

    def forget_changes(self, upto: int) -> None:
        """Drop the removal records of generations up to mark ``upto`` (a checkpoint holding them is
        committed); see :meth:`recckpt.state.protocol.ChangeTracking.forget_changes`."""
        self.change_log.forget_upto(upto)
