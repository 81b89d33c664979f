"""Retention and step metadata: rules the training side and the offline tools both apply.

Which committed checkpoints retention keeps (`KeepPolicy`, a pure function of the committed list, so it
behaves the same after a restart and in `recckpt prune`), and the manifest metadata keys that record a
checkpoint's global step and whether it is ephemeral. The save side (`recckpt.train`) writes them; the
tools (`recckpt.tools`) read them; neither imports the other, so the rules live here, below both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import InvalidArgumentError

#: Manifest metadata keys that retention and restore read: the global step a checkpoint holds, and
#: whether it is ephemeral ("1") or regular ("0").
META_STEP = "recckpt.global_step"
META_EPHEMERAL = "recckpt.ephemeral"
#: The checkpoint a compaction folded (`recckpt.compact` copies the source's global step as well).
META_COMPACTED_FROM = "recckpt.compacted_from"


def parse_step(text) -> int | None:
    """A global step as written in manifest metadata or an id: ASCII digits only (str.isdigit also
    accepts '²'), at most 18 of them; anything else is no step."""
    if isinstance(text, str) and 0 < len(text) <= 18 and text.isascii() and text.isdigit():
        return int(text)
    return None


def recorded_step(metadata: Mapping[str, str], worker_steps: Mapping[int, int]) -> int | None:
    """The global step the CheckpointManager recorded, else the newest step a worker saved at."""
    step = parse_step(metadata.get(META_STEP))
    if step is not None:
        return step
    return max(worker_steps.values()) if worker_steps else None


def restore_order(entries: Sequence[tuple[str, int | None]]) -> list[str]:
    """The ids of `entries` ((ckpt_id, step), committed order, oldest first) newest first, as a restart
    picks them: the highest global step first, so that a checkpoint committed late but holding an older
    step (a compaction of an older link, a copy from elsewhere) never rewinds a run. Ties go to the one
    committed last. A checkpoint without a step (`saver.save("final")`) counts as holding the highest
    step committed before it: it is newer than everything before it, and anything committed after it
    with at least that step is newer still."""
    keyed, high = [], -1
    for pos, (cid, step) in enumerate(entries):
        eff = step if step is not None else high
        high = max(high, eff)
        keyed.append(((eff, pos), cid))
    return [cid for _, cid in sorted(keyed, reverse=True)]


def positive_int(owner: str, field: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InvalidArgumentError(f"{owner}.{field} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class KeepPolicy:
    """Which committed checkpoints retention keeps. Retention runs only after a new checkpoint commits,
    so the newest committed checkpoint is never deleted, and the one a run restored from survives
    until a newer one exists."""
    max_keep: int | None = 1
    """Keep the newest `max_keep` regular (non-ephemeral) checkpoints; None keeps all. At least 1: the
    newest committed checkpoint is what a restart (or a failed async save) falls back to."""

    keep_every_n_steps: int | None = None
    """Also keep, forever, every regular checkpoint whose global step is a multiple of this."""

    def __post_init__(self):
        if self.max_keep is not None and (not isinstance(self.max_keep, int) or isinstance(self.max_keep, bool)
                                          or self.max_keep < 1):
            raise InvalidArgumentError(
                f"KeepPolicy.max_keep must be an integer >= 1 or None (keep all), got {self.max_keep!r}: the "
                f"newest committed checkpoint must survive until a newer one commits, which matters most "
                f"with async saves where the next one is still being written")
        if self.keep_every_n_steps is not None:
            positive_int("KeepPolicy", "keep_every_n_steps", self.keep_every_n_steps)

    @classmethod
    def coerce(cls, keep) -> "KeepPolicy":
        if isinstance(keep, cls):
            return keep
        if keep is None or isinstance(keep, int):
            return cls(max_keep=keep)
        raise InvalidArgumentError(f"keep must be a KeepPolicy, an int (max_keep) or None (keep all), got {keep!r}")

    def doomed(self, entries: Sequence["CkptEntry"], restored_from: str | None = None) -> list[str]:
        """Ids among `entries` (committed, oldest first) that may be deleted. "Newest" is what a restart
        picks (`restore_order`: the highest step, ties to the one committed last), so a checkpoint
        committed late with an older step (a compaction of an older link) never pushes the restore point
        out; the one committed last is kept too, whatever its step. `restored_from`, the checkpoint a
        run restored from, is kept while it is the newest."""
        if not entries:
            return []
        ids = [e.ckpt_id for e in entries]
        newest_first = restore_order([(e.ckpt_id, e.step) for e in entries])
        ephemeral = {e.ckpt_id for e in entries if e.ephemeral}
        # A step a manager saved again (restore() took the run past a damaged checkpoint of it, and the run
        # saved the step as <id>.1, <id>.2, ...) is the last of those commits: the earlier ones count for
        # no kept place, or a damaged copy would push an intact older restore point out. Other checkpoints
        # of one step (a Saver's saves with one step=, a compaction) are distinct and each counts.
        last_of = {(e.step, _resaved_base(e.ckpt_id)): e.ckpt_id for e in entries if e.step is not None}
        superseded = {e.ckpt_id for e in entries
                      if e.step is not None and last_of[(e.step, _resaved_base(e.ckpt_id))] != e.ckpt_id}
        keep = {ids[-1], newest_first[0]}
        regular = [i for i in newest_first if i not in ephemeral and (self.max_keep is None or i not in superseded)]
        keep.update(regular if self.max_keep is None else regular[:self.max_keep])
        if self.keep_every_n_steps is not None:
            keep.update(e.ckpt_id for e in entries if not e.ephemeral and e.ckpt_id not in superseded
                        and e.step is not None and e.step % self.keep_every_n_steps == 0)
        # Ephemeral checkpoints survive only while they are the newest (kept above).
        if restored_from == newest_first[0]:
            keep.add(restored_from)  # explicit: never delete the restore point before a newer one exists
        return [i for i in ids if i not in keep]


_RESAVED = re.compile(r"(.+)\.[1-9][0-9]*")


def _resaved_base(ckpt_id: str) -> str:
    """The id a re-save's id `<id>.<n>` (CheckpointManager.ckpt_id) was made from; an id itself otherwise."""
    m = _RESAVED.fullmatch(ckpt_id)
    return m.group(1) if m else ckpt_id


@dataclass(frozen=True)
class CkptEntry:
    """A committed checkpoint as retention sees it."""
    ckpt_id: str
    step: int | None
    ephemeral: bool

    @classmethod
    def from_metadata(cls, ckpt_id: str, metadata: Mapping[str, str],
                      worker_steps: Mapping[int, int] | None = None) -> "CkptEntry":
        """From a manifest's metadata and worker steps: its step as a restart ranks it (`recorded_step`:
        the manager's global step, else the newest `Saver.save(step=...)`; neither: none), regular unless
        a manager saved it as ephemeral."""
        return cls(ckpt_id, recorded_step(metadata, worker_steps or {}), metadata.get(META_EPHEMERAL) == "1")


__all__ = ["META_STEP", "META_EPHEMERAL", "parse_step", "recorded_step", "positive_int", "KeepPolicy", "CkptEntry"]
