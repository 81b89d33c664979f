"""Per-step agreement between the workers of a training job, for the CheckpointManager.

Two things must be the same on every rank at a step boundary: a save decision that only rank 0 can
make (a clock), and a preemption request that reached any one rank. `Agreement.exchange` settles both
in one small all_reduce on recckpt's step group (groups.py), and only when asked: the manager calls it
only when a policy or the preemption handler needs it. `restore` uses `broadcast0` and `worst` to make
every rank load the same checkpoint.

`LocalAgreement` is the one-worker case: nothing travels.
"""
from __future__ import annotations

import json
from datetime import timedelta

from ..errors import CoordinationError
from .arrivals import Arrivals


class LocalAgreement:
    rank, world = 0, 1

    def exchange(self, rank0_flag: bool, signal: int) -> tuple[bool, int]:
        return bool(rank0_flag), int(signal)

    def broadcast0(self, obj):
        return obj

    def worst(self, code: int) -> int:
        return int(code)


class Agreement(LocalAgreement):
    """The collectives of the step group of an initialised torch.distributed job. Each is bounded by
    `timeout_s`; a failure raises CoordinationError naming the rank and the step of the protocol."""

    _built = 0   # Agreements built in this process

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        from . import groups
        self._dist, self._groups = dist, groups
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._arrivals = Arrivals(groups.STEP, self.rank, self.world)
        # Every rank builds its managers, and makes their calls, in the same order: the counts tell steps apart.
        Agreement._built += 1
        self._nth, self._calls = Agreement._built, 0
        try:   # both groups, in a fixed order, on the training thread
            groups.ensure_groups(timeout_s)
        except Exception as e:
            raise CoordinationError(
                f"rank {self.rank} of {self.world}: building recckpt's gloo groups failed (timeout "
                f"{groups.rendezvous_s(timeout_s):g}s; every rank must construct its CheckpointManager "
                f"together, and another rank failed, exited or did not): {type(e).__name__}: {e}",
                rank=self.rank) from e

    def _run(self, what: str, fn, mark: bool = True):
        self._calls += 1
        where = f"{what} (manager {self._nth}, call {self._calls})"
        if mark:   # (not the per-step exchange: a request to the store every training step)
            self._arrivals.mark(where)
        try:
            return fn(self._groups.group(self._groups.STEP, self.timeout_s))
        except CoordinationError:
            raise
        except Exception as e:
            self._groups.drop_group(self._groups.STEP, self.timeout_s, e)
            raise CoordinationError(
                f"rank {self.rank} of {self.world}: {what} on recckpt's coordination group failed "
                f"(timeout {self.timeout_s:g}s; another rank failed, exited or stopped responding): "
                f"{type(e).__name__}: {e}{self._arrivals.missing(where) if mark else ''}", rank=self.rank) from e

    def _all_reduce(self, t, op, g):
        self._dist.all_reduce(t, op=op, group=g, async_op=True).wait(timeout=timedelta(seconds=self.timeout_s))
        return t

    def exchange(self, rank0_flag: bool, signal: int) -> tuple[bool, int]:
        """(rank 0's `rank0_flag`, the largest `signal` of any rank), on every rank."""
        import torch
        t = torch.tensor([int(bool(rank0_flag)) if self.rank == 0 else 0, int(signal)], dtype=torch.int64)
        t = self._run("the per-step agreement", lambda g: self._all_reduce(t, self._dist.ReduceOp.MAX, g), mark=False)
        return bool(t[0]), int(t[1])

    def worst(self, code: int) -> int:
        """The largest `code` of any rank (e.g. 0 ok, 1 recoverable, 2 fatal), on every rank."""
        import torch
        t = torch.tensor([int(code)], dtype=torch.int64)
        t = self._run("comparing outcomes", lambda g: self._all_reduce(t, self._dist.ReduceOp.MAX, g))
        return int(t[0])

    def broadcast0(self, obj):
        """Rank 0's JSON-able `obj` on every rank."""
        import torch

        def run(g):
            wait = timedelta(seconds=self.timeout_s)
            data = json.dumps(obj).encode() if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            self._dist.broadcast(size, src=0, group=g, async_op=True).wait(timeout=wait)
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data
                   else torch.zeros(int(size[0]), dtype=torch.uint8))
            if int(size[0]):
                self._dist.broadcast(buf, src=0, group=g, async_op=True).wait(timeout=wait)
            return json.loads(bytes(buf.numpy().tobytes()).decode()) if int(size[0]) else None
        return self._run("sharing rank 0's choice", run)


def agreement_for(world: int, timeout_s: float) -> LocalAgreement:
    """The agreement of a job of `world` workers (the process group must be initialised if > 1)."""
    return Agreement(timeout_s) if world > 1 else LocalAgreement()


__all__ = ["Agreement", "LocalAgreement", "agreement_for"]
