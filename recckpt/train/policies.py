"""When the CheckpointManager saves, and which checkpoints retention keeps.

Save decisions are an open protocol: any object with `should_save(step, context) -> bool` is a save
policy. The built-ins (`EveryNSteps`, `EveryNSeconds`, `AtSteps`, `EphemeralEveryNSteps`) are small
frozen dataclasses implementing it, and `AnySavePolicy` composes several. A policy whose answer can
differ between workers (a clock) sets `rank0_decides = True`: the manager then takes rank 0's answer on
every rank, through recckpt's coordination group. A policy with `ephemeral = True` asks for checkpoints
that live only until a newer one commits. `SaveSchedule` validates a combination and decides per step.

`KeepPolicy` is the one implementation of retention (`Saver(max_keep=...)` is a KeepPolicy too). It lives
in `recckpt.format.retention`, below both the training side and the offline tools (prune), and is
re-exported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, runtime_checkable

from ..errors import InvalidArgumentError
from ..format.retention import (  # noqa: F401  (public here too)
    META_EPHEMERAL,
    META_STEP,
    CkptEntry,
    KeepPolicy,
    parse_step,
    positive_int,
)

EPHEMERAL = "ephemeral"
PERMANENT = "permanent"

@dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at besides the step."""
    seconds_since_save: float
    """Wall-clock seconds since the previous save started (or since the manager started/restored)."""
    last_saved_step: int | None = None
    """Global step of the previous save of this run, None before the first."""
    world: int = 1
    """Number of workers saving together."""


@runtime_checkable
class SaveDecisionPolicy(Protocol):
    """A save policy. Optional attributes: `rank0_decides` (bool, default False) and `ephemeral`
    (bool, default False); see the module docstring."""

    def should_save(self, step: int, context: SaveContext) -> bool:
        """Whether global step `step` (just completed) is saved."""


@dataclass(frozen=True)
class EveryNSteps:
    """Save when the global step is a multiple of `n`."""
    n: int
    """Steps between saves (>= 1)."""

    def __post_init__(self):
        positive_int("EveryNSteps", "n", self.n)

    def should_save(self, step: int, context: SaveContext) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds:
    """Save at the first step boundary at least `seconds` after the previous save (or the start).
    With torch.distributed initialised rank 0 decides and broadcasts, so workers never disagree."""
    seconds: float
    """Wall-clock seconds between saves (> 0)."""

    rank0_decides = True  # clocks differ between workers

    def __post_init__(self):
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or not math.isfinite(self.seconds) or self.seconds <= 0:
            raise InvalidArgumentError(f"EveryNSeconds.seconds must be a finite number > 0, got {self.seconds!r}")

    def should_save(self, step: int, context: SaveContext) -> bool:
        return context.seconds_since_save >= self.seconds


@dataclass(frozen=True)
class AtSteps:
    """Save at each of the given global steps."""
    steps: frozenset
    """Global steps (integers >= 1) to save at; any iterable is accepted and frozen."""

    def __post_init__(self):
        try:
            steps = frozenset(self.steps)
        except TypeError:
            raise InvalidArgumentError(f"AtSteps.steps must be an iterable of integers >= 1, got {self.steps!r}") from None
        for s in steps:
            positive_int("AtSteps", "steps[...]", s)
        object.__setattr__(self, "steps", steps)

    def should_save(self, step: int, context: SaveContext) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class EphemeralEveryNSteps:
    """Extra saves every `n` steps, between the regular ones, of which only the newest is kept: once a
    newer checkpoint (ephemeral or not) commits, older ephemeral checkpoints are deleted. Bounds the
    work lost to a crash without paying disk for many checkpoints."""
    n: int
    """Steps between ephemeral saves; must be below every EveryNSteps interval it is combined with."""

    ephemeral = True

    def __post_init__(self):
        positive_int("EphemeralEveryNSteps", "n", self.n)

    def should_save(self, step: int, context: SaveContext) -> bool:
        return step % self.n == 0


def _check_policy(p) -> None:
    if not callable(getattr(p, "should_save", None)):
        raise InvalidArgumentError(f"save policy must have a should_save(step, context) method (EveryNSteps, "
                        f"EveryNSeconds, AtSteps, EphemeralEveryNSteps, AnySavePolicy or your own), got {p!r}")


def rank0_decides(p) -> bool:
    """Whether `p`'s answer must be rank 0's on every worker."""
    return bool(getattr(p, "rank0_decides", False))


def is_ephemeral(p) -> bool:
    return bool(getattr(p, "ephemeral", False))


@dataclass(frozen=True)
class AnySavePolicy:
    """Save when any of `policies` says so."""
    policies: tuple
    """The composed policies (any iterable is accepted and frozen)."""

    def __post_init__(self):
        if isinstance(self.policies, (str, bytes)) or not isinstance(self.policies, Iterable):
            raise InvalidArgumentError(f"AnySavePolicy takes a list of save policies, e.g. AnySavePolicy([EveryNSteps(100), "
                                       f"EveryNSeconds(600)]); got {self.policies!r}")
        pols = tuple(self.policies)
        for p in pols:
            _check_policy(p)
        object.__setattr__(self, "policies", pols)

    @property
    def rank0_decides(self) -> bool:
        return any(rank0_decides(p) for p in self.policies)

    def should_save(self, step: int, context: SaveContext) -> bool:
        return any(p.should_save(step, context) for p in self.policies)


SavePolicy = SaveDecisionPolicy  # the name the manager's signature uses


def _flatten(policies: Iterable) -> Iterator:
    for p in policies:
        if isinstance(p, AnySavePolicy):
            yield from _flatten(p.policies)
        else:
            yield p


class SaveSchedule:
    """The composition of save policies: validates the combination, then decides per step."""

    def __init__(self, policies: Iterable[SaveDecisionPolicy], keep: KeepPolicy, async_save: bool = False):
        # Nested AnySavePolicy lists are the same "any of" as the top-level list: flattened, so that an
        # ephemeral policy inside one stays ephemeral and the combination rules below see every policy.
        self.policies = tuple(_flatten(policies))
        for p in self.policies:
            _check_policy(p)
        if not isinstance(keep, KeepPolicy):
            raise InvalidArgumentError(f"keep must be a KeepPolicy, got {keep!r}")
        if async_save and keep.max_keep is not None and keep.max_keep < 1:  # KeepPolicy refuses it too
            raise InvalidArgumentError("async_save=True needs KeepPolicy.max_keep >= 1: the last committed checkpoint "
                             "is the fallback while the next one is written in the background")
        eph = [p for p in self.policies if is_ephemeral(p)]
        if len(eph) > 1:
            raise InvalidArgumentError(f"at most one ephemeral save policy (EphemeralEveryNSteps), got {eph}")
        regular_n = [p.n for p in self.policies if isinstance(p, EveryNSteps)]
        eph_n = getattr(eph[0], "n", None) if eph else None
        if eph_n is not None and regular_n and eph_n >= min(regular_n):
            raise InvalidArgumentError(
                f"EphemeralEveryNSteps(n={eph_n}) must save more often than EveryNSteps(n={min(regular_n)}): "
                f"ephemeral saves fill the gaps between regular ones; a larger or equal interval would never "
                f"add a checkpoint")
        self.keep = keep
        regular = [p for p in self.policies if not is_ephemeral(p)]
        self._local = AnySavePolicy([p for p in regular if not rank0_decides(p)])
        self._rank0 = AnySavePolicy([p for p in regular if rank0_decides(p)])
        self._ephemeral = AnySavePolicy(eph)

    @property
    def needs_agreement(self) -> bool:
        """Whether a decision needs rank 0's answer (a collective) at every step."""
        return bool(self._rank0.policies)

    def rank0_part(self, step: int, context: SaveContext) -> bool:
        """This worker's answer of the policies whose answer must be rank 0's."""
        return self._rank0.should_save(step, context)

    def decide(self, step: int, context: SaveContext, agree=None) -> str | None:
        """PERMANENT, EPHEMERAL or None for this step. `agree(bool) -> bool` turns this worker's
        answer of the rank-0 policies into rank 0's (a collective); the other policies give the same
        answer on every worker, so they need none."""
        regular = self._local.should_save(step, context)
        if self.needs_agreement:
            mine = self.rank0_part(step, context)
            regular = (agree(mine) if agree is not None else mine) or regular
        if regular:
            return PERMANENT
        if self._ephemeral.should_save(step, context):
            return EPHEMERAL
        return None


__all__ = ["SaveDecisionPolicy", "SaveContext", "AnySavePolicy", "EveryNSteps", "EveryNSeconds", "AtSteps",
           "EphemeralEveryNSteps", "KeepPolicy", "CkptEntry", "SaveSchedule", "SavePolicy", "EPHEMERAL",
           "PERMANENT", "META_STEP", "META_EPHEMERAL", "parse_step"]
