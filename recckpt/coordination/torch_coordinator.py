"""Coordinating one save across the ranks of a torch.distributed job.

Everything travels on recckpt's gloo group for saves (groups.py: it works beside NCCL training and
never queues behind training collectives), as JSON in uint8 tensors (no pickle):

    begin  : all-gather (ckpt id, candidate nonce, plan) → every rank checks the ids agree, takes rank
             0's nonce and sees every rank's plan (its increment's parent, its layout options)
    submit : gather of each rank's part *or its error* to rank 0
    end    : rank 0 broadcasts the outcome ("committed" or why not)

A rank that fails while writing still joins `submit` (with its error) and `end`, so the others learn
of the failure at once and the group stays in step for the next save. A rank that stops responding
makes every collective time out after `timeout_s`: the ranks that time out raise (after the hand-over
to rank 0 the saver first looks whether rank 0 committed: docs/DISTRIBUTED.md), mark the group
broken, and the next save builds a fresh group (a timed-out gloo group may hold half-finished
messages that would otherwise be read by the next save).
"""
from __future__ import annotations

import json
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CheckpointSaveError, CommitOutcomeUnknownError
from . import groups
from .arrivals import Arrivals
from .coordinator import Coordinator


def _encode(obj) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(t: torch.Tensor):
    return json.loads(bytes(t.numpy().tobytes()).decode())


class TorchCoordinator(Coordinator):
    """One save on all ranks of the default process group (see the module docstring)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = None
        self._wait = timedelta(seconds=timeout_s)
        self._phase: dict[tuple, str] = {}    # key → "writing" | "submitted" | "done"
        self._arrivals = Arrivals(groups.SAVE, self.rank, self.world)

    # ---------------------------------------------------------------------------- collectives
    def _collective(self, key, what: str, fn, error=CheckpointSaveError, limit_s: float | None = None,
                    step: str | None = None):
        """`fn()`, a collective bounded by `limit_s` (default: the coordination timeout); its failure
        becomes `error`, naming the step (and the ranks that never reached it, when the store can tell).
        `step`: the collective's name on every rank, where `what` differs between ranks."""
        where = f"{step or what} of checkpoint {key[1]!r} in {key[0]}"
        self._arrivals.mark(where)
        try:
            return fn()
        except CheckpointSaveError:
            raise
        except Exception as e:
            self._phase[key] = "done"
            groups.drop_group(groups.SAVE, self.timeout_s, e)
            raise error(
                f"rank {self.rank}: coordination of checkpoint {key[1]!r} failed during {what} "
                f"(timeout {self.timeout_s if limit_s is None else limit_s:g}s; another rank failed, stopped "
                f"responding or did not call save; every rank must call save() together): "
                f"{type(e).__name__}: {e}{self._arrivals.missing(where)}") from e

    def _run(self, op, *args, **kw):
        """One collective on the coordination group, bounded by the coordination timeout."""
        op(*args, group=self.group, async_op=True, **kw).wait(timeout=self._wait)

    def _padded(self, obj) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """This rank's encoded `obj` padded to the longest of all ranks (collectives need equal sizes),
        every rank's true size, and the padded length."""
        t = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._run(dist.all_gather, sizes, torch.tensor([t.numel()], dtype=torch.int64))
        n = max(int(s) for s in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[:t.numel()] = t
        return buf, sizes, n

    def _all_gather(self, obj) -> list:
        buf, sizes, n = self._padded(obj)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world)]
        self._run(dist.all_gather, out, buf)
        return [_decode(o[:int(s)]) for o, s in zip(out, sizes)]

    def _gather0(self, obj) -> list | None:
        buf, sizes, n = self._padded(obj)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world)] if self.rank == 0 else None
        self._run(dist.gather, buf, out, dst=0)
        return None if out is None else [_decode(o[:int(s)]) for o, s in zip(out, sizes)]

    def _broadcast0(self, obj):
        t = _encode(obj) if self.rank == 0 else None
        size = torch.tensor([t.numel() if t is not None else 0], dtype=torch.int64)
        self._run(dist.broadcast, size, src=0)
        buf = t.clone() if t is not None else torch.empty(int(size), dtype=torch.uint8)
        self._run(dist.broadcast, buf, src=0)
        return _decode(buf)

    # ------------------------------------------------------------------------------- protocol
    def begin(self, key, plan=None):
        mine = {"ckpt_id": key[1], "nonce": uuid.uuid4().hex[:12], "plan": plan}

        if not groups.is_built(groups.SAVE, self.timeout_s):
            # Building the group is a rendezvous of every rank with its own, longer bound.
            self._collective(key, "begin (building recckpt's gloo group)",
                             lambda: groups.group(groups.SAVE, self.timeout_s),
                             limit_s=groups.rendezvous_s(self.timeout_s, groups.SAVE))
        self.group = groups.group(groups.SAVE, self.timeout_s)
        got = self._collective(key, "begin", lambda: self._all_gather(mine))
        ids = {g["ckpt_id"] for g in got}
        if len(ids) != 1:
            self._phase[key] = "done"
            which = ", ".join(f"rank {r}: {g['ckpt_id']!r}" for r, g in enumerate(got))
            raise CheckpointSaveError(
                f"rank {self.rank}: the ranks are saving different checkpoints at once ({which}); every "
                f"rank must call save() with the same ckpt_id", rank=self.rank)
        self._phase[key] = "writing"
        return got[0]["nonce"], [g["plan"] for g in got]

    def _submit(self, key, msg):
        got = self._collective(key, "gathering worker parts", lambda: self._gather0(msg))
        self._phase[key] = "submitted"
        return got

    def submit(self, key, part):
        got = self._submit(key, {"part": part, "error": None})
        if got is None:
            return None
        failed = [(r, g["error"]) for r, g in enumerate(got) if g["error"] is not None]
        if failed:
            raise CheckpointSaveError(
                f"checkpoint {key[1]!r} was not committed because " + "; ".join(
                    f"rank {r} failed: {err}" for r, err in failed), rank=failed[0][0])
        return [g["part"] for g in got]

    def end(self, key, error):
        """Rank 0 announces the outcome; the other ranks raise if the commit did not happen."""
        if self._phase.get(key) != "submitted":
            return
        if self.rank == 0:
            try:
                self._collective(key, "announcing the outcome", lambda: self._broadcast0({"error": error}),
                                 step="sharing the outcome")
            except CheckpointSaveError:
                if error is None:   # committed: the checkpoint is valid whatever the others heard
                    return
                raise
            finally:
                self._phase[key] = "done"
            return
        # This rank's part is handed over: if the announcement is lost, rank 0 may have committed.
        outcome = self._collective(key, "waiting for the outcome", lambda: self._broadcast0(None),
                                   CommitOutcomeUnknownError, step="sharing the outcome")
        self._phase[key] = "done"
        if outcome["error"] is not None:
            raise CheckpointSaveError(f"rank {self.rank}: checkpoint {key[1]!r} was not committed: "
                                      f"{outcome['error']}", rank=self.rank)

    def abort(self, key, error: str | None = None):
        """This rank failed: take part in the steps the other ranks are waiting in, carrying the error."""
        error = error or "failed"
        phase = self._phase.get(key)
        try:
            if phase == "writing":
                got = self._submit(key, {"part": None, "error": error})
                if got is not None:
                    error = "; ".join(f"rank {r} failed: {g['error']}" for r, g in enumerate(got)
                                      if g["error"] is not None)
                phase = "submitted"
            if phase == "submitted":
                if self.rank == 0:
                    self.end(key, error)
                else:
                    self.end(key, None)   # hears rank 0's failure announcement and raises; swallowed below
        except CheckpointSaveError:
            pass
        finally:
            self._phase.pop(key, None)
