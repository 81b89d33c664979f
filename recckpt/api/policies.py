"""When the CheckpointManager saves, and which checkpoints it keeps.

Save policies are small frozen dataclasses; a manager saves at a step when any of them says so.
`SaveSchedule` composes them, rejects combinations that cannot work, and decides per step.
`KeepPolicy` chooses what retention may delete after a new checkpoint commits; it is a pure function
of the committed list, so it behaves the same after a restart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

EPHEMERAL = "ephemeral"
PERMANENT = "permanent"


def _positive_int(owner: str, field: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{owner}.{field} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class EveryNSteps:
    """Save when the global step is a multiple of `n`."""
    n: int
    """Steps between saves (>= 1)."""

    def __post_init__(self):
        _positive_int("EveryNSteps", "n", self.n)

    def wants(self, step: int, seconds_since_save: float) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds:
    """Save at the first step boundary at least `seconds` after the previous save (or the start).
    With torch.distributed initialised rank 0 decides and broadcasts, so workers never disagree."""
    seconds: float
    """Wall-clock seconds between saves (> 0)."""

    def __post_init__(self):
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ValueError(f"EveryNSeconds.seconds must be a finite number > 0, got {self.seconds!r}")

    def wants(self, step: int, seconds_since_save: float) -> bool:
        return seconds_since_save >= self.seconds


@dataclass(frozen=True)
class AtSteps:
    """Save at each of the given global steps."""
    steps: frozenset
    """Global steps (integers >= 1) to save at; any iterable is accepted and frozen."""

    def __post_init__(self):
        try:
            steps = frozenset(self.steps)
        except TypeError:
            raise ValueError(f"AtSteps.steps must be an iterable of integers >= 1, got {self.steps!r}") from None
        for s in steps:
            _positive_int("AtSteps", "steps[...]", s)
        object.__setattr__(self, "steps", steps)

    def wants(self, step: int, seconds_since_save: float) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class EphemeralEveryNSteps:
    """Extra saves every `n` steps, between the regular ones, of which only the newest is kept: once a
    newer checkpoint (ephemeral or not) commits, older ephemeral checkpoints are deleted. Bounds the
    work lost to a crash without paying disk for many checkpoints."""
    n: int
    """Steps between ephemeral saves; must be below every EveryNSteps interval it is combined with."""

    def __post_init__(self):
        _positive_int("EphemeralEveryNSteps", "n", self.n)

    def wants(self, step: int, seconds_since_save: float) -> bool:
        return step % self.n == 0


SavePolicy = EveryNSteps | EveryNSeconds | AtSteps | EphemeralEveryNSteps


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
            raise ValueError(
                f"KeepPolicy.max_keep must be an integer >= 1 or None (keep all), got {self.max_keep!r}: the "
                f"newest committed checkpoint must survive until a newer one commits, which matters most "
                f"with async saves where the next one is still being written")
        if self.keep_every_n_steps is not None:
            _positive_int("KeepPolicy", "keep_every_n_steps", self.keep_every_n_steps)

    @classmethod
    def coerce(cls, keep) -> "KeepPolicy":
        if isinstance(keep, cls):
            return keep
        if keep is None or isinstance(keep, int):
            return cls(max_keep=keep)
        raise TypeError(f"keep must be a KeepPolicy, an int (max_keep) or None (keep all), got {keep!r}")

    def doomed(self, entries: Sequence["CkptEntry"], restored_from: str | None = None) -> list[str]:
        """Ids among `entries` (committed, oldest first; the last is the newest) that may be deleted."""
        if not entries:
            return []
        keep = {entries[-1].ckpt_id}
        regular = [e for e in entries if not e.ephemeral]
        keep.update(e.ckpt_id for e in (regular if self.max_keep is None else regular[-self.max_keep:]))
        if self.keep_every_n_steps is not None:
            keep.update(e.ckpt_id for e in regular
                        if e.step is not None and e.step % self.keep_every_n_steps == 0)
        # Ephemeral checkpoints survive only while they are the newest (added above as entries[-1]).
        ids = [e.ckpt_id for e in entries]
        if restored_from in ids and ids.index(restored_from) == len(ids) - 1:
            keep.add(restored_from)  # explicit: never delete the restore point before a newer one exists
        return [i for i in ids if i not in keep]


@dataclass(frozen=True)
class CkptEntry:
    """A committed checkpoint as retention sees it."""
    ckpt_id: str
    step: int | None
    ephemeral: bool


class SaveSchedule:
    """The composition of save policies: validates the combination, then decides per step."""

    def __init__(self, policies: Iterable[SavePolicy], keep: KeepPolicy, async_save: bool = False):
        self.policies = tuple(policies)
        for p in self.policies:
            if not isinstance(p, (EveryNSteps, EveryNSeconds, AtSteps, EphemeralEveryNSteps)):
                raise TypeError(f"save policy must be EveryNSteps, EveryNSeconds, AtSteps or "
                                f"EphemeralEveryNSteps, got {p!r}")
        if not isinstance(keep, KeepPolicy):
            raise TypeError(f"keep must be a KeepPolicy, got {keep!r}")
        if async_save and keep.max_keep is not None and keep.max_keep < 1:  # KeepPolicy refuses it too
            raise ValueError("async_save=True needs KeepPolicy.max_keep >= 1: the last committed checkpoint "
                             "is the fallback while the next one is written in the background")
        eph = [p for p in self.policies if isinstance(p, EphemeralEveryNSteps)]
        if len(eph) > 1:
            raise ValueError(f"at most one EphemeralEveryNSteps policy, got {eph}")
        regular_n = [p.n for p in self.policies if isinstance(p, EveryNSteps)]
        if eph and regular_n and eph[0].n >= min(regular_n):
            raise ValueError(
                f"EphemeralEveryNSteps(n={eph[0].n}) must save more often than EveryNSteps(n={min(regular_n)}): "
                f"ephemeral saves fill the gaps between regular ones; a larger or equal interval would never "
                f"add a checkpoint")
        self.keep = keep
        self.timed = any(isinstance(p, EveryNSeconds) for p in self.policies)

    def decide(self, step: int, seconds_since_save: float, agree=None) -> str | None:
        """PERMANENT, EPHEMERAL or None for this step. `agree(bool) -> bool` makes a time-based
        decision collective (rank 0's answer wins); step-based ones agree by construction."""
        regular = any(p.wants(step, seconds_since_save) for p in self.policies
                      if isinstance(p, (EveryNSteps, AtSteps)))
        if self.timed:
            timed = any(p.wants(step, seconds_since_save) for p in self.policies if isinstance(p, EveryNSeconds))
            regular = regular or (agree(timed) if agree is not None else timed)
        if regular:
            return PERMANENT
        if any(p.wants(step, seconds_since_save) for p in self.policies if isinstance(p, EphemeralEveryNSteps)):
            return EPHEMERAL
        return None


__all__ = ["EveryNSteps", "EveryNSeconds", "AtSteps", "EphemeralEveryNSteps", "KeepPolicy", "CkptEntry",
           "SaveSchedule", "SavePolicy", "EPHEMERAL", "PERMANENT"]
