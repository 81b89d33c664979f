"""How the workers of one save agree on a staging directory and hand their parts to the committer.

A save runs: `begin` (all workers learn one staging nonce, and every worker's plan) → each worker
writes its part → `submit`
(the committer receives every part) → the committer finalizes → `end` (every worker learns whether
the commit happened). Implementations differ only in how the parts travel.

- SingleCoordinator: one worker, nothing travels.
- InProcessCoordinator: all shards of a save are written from one process, one `save(shard_id=i)` call
  after another (offline conversion, tests); the last shard to arrive commits.
- TorchCoordinator (torch_coordinator.py): one shard per rank of an initialised torch.distributed job.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

log = logging.getLogger("recckpt")


class Coordinator:
    rank: int
    world: int
    #: Whether a part handed over by `submit` waits for later calls in this process (all shards saved
    #: from one process): the save that handed it over returns before anything is committed.
    defers_commit: bool = False

    def begin(self, key: tuple, plan: dict | None = None) -> tuple[str, list | None]:
        """A nonce shared by every worker of this save, and every worker's `plan` (JSON: what it means to
        write, e.g. its increment's parent and the options every part must share) in rank order, so
        that all workers can check they agree before writing. None instead of the list where the
        workers cannot learn it before writing (shards saved one after another from one process)."""
        raise NotImplementedError

    def submit(self, key: tuple, part: dict) -> list[dict] | None:
        """Hand over this worker's part; returns all parts to the worker that must commit, else None. In a
        world of one the Saver hands over only ``{"worker": 0}`` (it commits the part it built)."""
        raise NotImplementedError

    def end(self, key: tuple, error: str | None) -> None:
        """Called by every worker after the commit attempt (error: None when this worker succeeded)."""

    def abort(self, key: tuple, error: str | None = None) -> None:
        """Forget a save that failed on this worker (`error` says why, for the other workers)."""

    def active_nonces(self, root: str) -> dict[str, str]:
        """ckpt_id -> nonce of saves into `root` that this process has begun and not finished; their
        staging directories must survive start-up cleanup."""
        return {}


class SingleCoordinator(Coordinator):
    rank, world = 0, 1

    def begin(self, key, plan=None):
        return uuid.uuid4().hex[:12], [plan]

    def submit(self, key, part):
        return [part]

    def active_nonces(self, root):
        # parts of multi-shard saves this process parked in the same output directory stay protected
        return InProcessCoordinator(0, 1).active_nonces(root)


class InProcessCoordinator(Coordinator):
    """Shards saved one after another from one process. Shared state lives on the class, keyed by
    (output_dir, ckpt_id), so separate Saver objects (one per simulated worker) cooperate.

    A part waits for the other shards of its checkpoint. If none of them arrives within `timeout_s` of
    the last activity on that checkpoint (a shard's save beginning or handing over its part), the
    parked parts are dropped with a warning the next time any in-process save runs: nothing was
    committed, and the staging directory is no longer protected from start-up recovery."""
    _lock = threading.Lock()
    _saves: dict[tuple, dict[str, Any]] = {}
    defers_commit = True

    def __init__(self, rank: int, world: int, timeout_s: float = 1800.0):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s

    def _expire(self) -> None:
        """Drop saves idle for longer than their timeout (under the lock)."""
        now = time.monotonic()
        for key, s in list(self._saves.items()):
            if now - s["touched"] > s["timeout_s"]:
                del self._saves[key]
                missing = sorted(set(range(s["world"])) - set(s["parts"]))
                log.warning("recckpt: dropped the parts of checkpoint %r in %s that shard(s) %s saved: shard(s) %s "
                            "of %d were not saved within %g s, so it was never committed; save every shard "
                            "again (start-up recovery removes its staging directory)", key[1], key[0],
                            sorted(s["parts"]), missing, s["world"], s["timeout_s"])

    def begin(self, key, plan=None):
        with self._lock:
            self._expire()
            s = self._saves.setdefault(key, {"nonce": uuid.uuid4().hex[:12], "parts": {}, "world": self.world,
                                             "timeout_s": self.timeout_s})
            s["touched"] = time.monotonic()
            return s["nonce"], None   # the later shards' plans are not known yet: finalize compares the parts

    def submit(self, key, part):
        with self._lock:
            s = self._saves[key]
            s["touched"] = time.monotonic()
            if self.rank in s["parts"]:
                raise RuntimeError(f"shard {self.rank} of {key[1]!r} was submitted twice")
            s["parts"][self.rank] = part
            if len(s["parts"]) < self.world:
                return None
            del self._saves[key]
            return [s["parts"][r] for r in sorted(s["parts"])]

    def abort(self, key, error=None):
        with self._lock:
            self._saves.pop(key, None)

    def active_nonces(self, root):
        with self._lock:
            self._expire()
            return {k[1]: s["nonce"] for k, s in self._saves.items() if k[0] == root}
