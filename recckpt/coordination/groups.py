"""recckpt's own gloo process groups, one per purpose, beside whatever the job trains with.

Every collective recckpt issues runs on one of these, never on the default group: a job whose default
group is NCCL (which refuses CPU tensors) works, and recckpt's messages never queue behind training
collectives. Two purposes exist because they run on different threads at once (an async save's commit
protocol on the writer thread, the per-step agreement on the training thread), and one group must never
carry collectives from two threads: their order would differ between ranks.

Building a group is itself collective: `ensure_groups` builds them in one fixed order, on the calling
thread of every rank (the CheckpointManager does so at construction).
"""
from __future__ import annotations

import atexit
from datetime import timedelta

import torch.distributed as dist

SAVE = "save"
STEP = "step"

# Building a group is a rendezvous of every rank; ranks reach it at quite different times (model
# construction, data loading), so it gets at least this long. Each operation on a group is bounded by
# the coordination timeout itself (Work.wait), not by the group's timeout.
RENDEZVOUS_MIN_S = 120.0

# (purpose, timeout_s) -> (the default group it was built under, the gloo group). Tied to the default
# group so a job that destroys and re-creates its process group never reuses a destroyed group.
_groups: dict[tuple[str, float], tuple[object, object]] = {}


@atexit.register
def _release_groups() -> None:
    # Drop our references while the interpreter is intact: if a user's destroy_process_group() left us
    # the last one, the group's C++ destructor would otherwise run during interpreter teardown, where
    # gloo's threads have been seen to abort the process ("terminate called without an active exception").
    _groups.clear()


# Groups dropped after a collective failed because a peer's connection closed (its process is gone):
# rebuilt within the coordination timeout alone. The rebuild could only wait for the dead rank, and would
# hold every survivor for RENDEZVOUS_MIN_S, a process unable to exit while its writer thread waited there.
# After a timeout (a slow rank, which may still come) the rebuild keeps the longer bound.
_peer_gone: set[tuple[str, float]] = set()

#: How gloo and c10d say that the other end of a connection went away (its process was killed or exited).
_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def peer_gone(e: BaseException) -> bool:
    """Whether collective failure `e` says a peer's process is gone, not merely late."""
    return any(s in str(e) for s in _GONE)


def rendezvous_s(timeout_s: float, purpose: str | None = None) -> float:
    """How long building the group for `purpose` waits for every rank, under coordination timeout
    `timeout_s`: at least RENDEZVOUS_MIN_S, but `timeout_s` alone for a rebuild after a peer was gone."""
    if purpose is not None and (purpose, timeout_s) in _peer_gone:
        return timeout_s
    return max(timeout_s, RENDEZVOUS_MIN_S)


def is_built(purpose: str, timeout_s: float) -> bool:
    """Whether `group(purpose, timeout_s)` would return a group without the rendezvous of building it."""
    world_then, g = _groups.get((purpose, timeout_s), (None, None))
    return g is not None and world_then is dist.group.WORLD


def group(purpose: str, timeout_s: float):
    """The gloo group for `purpose`, built on first use (a collective: all ranks, same order)."""
    world = dist.group.WORLD
    world_then, g = _groups.get((purpose, timeout_s), (None, None))
    if g is None or world_then is not world:
        g = dist.new_group(backend="gloo", timeout=timedelta(seconds=rendezvous_s(timeout_s, purpose)))
        _groups[(purpose, timeout_s)] = (world, g)
    return g


def ensure_groups(timeout_s: float) -> None:
    """Build both groups now, in a fixed order, on this thread (every rank must call it)."""
    group(SAVE, timeout_s)
    group(STEP, timeout_s)


def drop_group(purpose: str, timeout_s: float, cause: BaseException | None = None) -> None:
    """Forget a group after a failed or timed-out collective (`cause`): it may hold half-finished messages
    that the next operation would read. Not destroyed: that would wait for the rank that stopped
    responding; its threads end at the group's own timeout."""
    _groups.pop((purpose, timeout_s), None)
    if cause is not None and peer_gone(cause):
        _peer_gone.add((purpose, timeout_s))


def built() -> dict[str, object]:
    """purpose -> group, for the groups built so far (diagnostics and tests)."""
    return {purpose: g for (purpose, _), (_, g) in _groups.items()}


__all__ = ["SAVE", "STEP", "group", "ensure_groups", "drop_group", "built", "is_built", "rendezvous_s",
           "RENDEZVOUS_MIN_S"]
