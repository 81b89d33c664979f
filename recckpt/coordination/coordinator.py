"""How the workers of one save agree on a staging directory and hand their parts to the committer.

A save runs: `begin` (all workers learn one staging nonce) → each worker writes its part → `submit`
(the committer receives every part) → the committer finalizes → `end` (every worker learns whether
the commit happened). Implementations differ only in how the parts travel.

- SingleCoordinator: one worker, nothing travels.
- InProcessCoordinator: all shards of a save are written from one process, one `save(shard_id=i)` call
  after another (offline conversion, tests); the last shard to arrive commits.
- TorchCoordinator (torch_coordinator.py): one shard per rank of an initialised torch.distributed job.
"""
from __future__ import annotations

import threading
import uuid
from typing import Any


class Coordinator:
    rank: int
    world: int
    #: Whether a part handed over by `submit` waits for later calls in this process (all shards saved
    #: from one process): the save that handed it over returns before anything is committed.
    defers_commit: bool = False

    def begin(self, key: tuple) -> str:
        """A nonce shared by every worker of this save."""
        raise NotImplementedError

    def submit(self, key: tuple, part: dict) -> list[dict] | None:
        """Hand over this worker's part; returns all parts to the worker that must commit, else None."""
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

    def begin(self, key):
        return uuid.uuid4().hex[:12]

    def submit(self, key, part):
        return [part]


class InProcessCoordinator(Coordinator):
    """Shards saved one after another from one process. Shared state lives on the class, keyed by
    (output_dir, ckpt_id), so separate Saver objects (one per simulated worker) cooperate."""
    _lock = threading.Lock()
    _saves: dict[tuple, dict[str, Any]] = {}
    defers_commit = True

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def begin(self, key):
        with self._lock:
            s = self._saves.setdefault(key, {"nonce": uuid.uuid4().hex[:12], "parts": {}})
            return s["nonce"]

    def submit(self, key, part):
        with self._lock:
            s = self._saves[key]
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
            return {k[1]: s["nonce"] for k, s in self._saves.items() if k[0] == root}
