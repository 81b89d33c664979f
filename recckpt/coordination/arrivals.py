"""Where each rank last got to in recckpt's collective protocols, so that a failed collective names the
ranks that never reached it (killed, crashed, or stuck before it) instead of "another rank".

Each rank writes one key per purpose ("save", "step") into the job's c10d store, overwritten at every
step of the protocol, so nothing accumulates there. recckpt talks to that store through a client of its
own, with a short timeout: a store that lived in a rank that died, or stopped answering, costs a
collective at most `STORE_TIMEOUT_S` more and only makes the error say less. Best effort throughout: no
failure here ever fails a save or a restore.
"""
from __future__ import annotations

import logging
from datetime import timedelta

log = logging.getLogger("recckpt")

#: The longest one store operation of this module may wait.
STORE_TIMEOUT_S = 5.0
_PREFIX = "recckpt/arrivals"


def _tcp_store_of_default_group():
    """(host, port) of the TCPStore under the default process group's store, or None (another store)."""
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):   # PrefixStore wrappers
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return (host, port) if host and port else None


class Arrivals:
    """Marks of one purpose's protocol steps, on every rank of the default process group."""

    def __init__(self, purpose: str, rank: int, world: int):
        self.purpose, self.rank, self.world = purpose, rank, world
        self._store = None
        self._broken = False

    def _client(self):
        if self._store is None and not self._broken:
            try:
                import torch.distributed as dist
                where = _tcp_store_of_default_group()
                if where is None:
                    self._broken = True
                    return None
                self._store = dist.TCPStore(where[0], where[1], is_master=False, wait_for_workers=False,
                                            timeout=timedelta(seconds=STORE_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - best effort: errors then name no rank
                log.debug("recckpt: no store for arrivals: %s", e)
                self._broken = True
        return self._store

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{self.purpose}/{rank}"

    def mark(self, where: str) -> None:
        """This rank is about to enter step `where` (the same text on every rank)."""
        store = self._client()
        if store is None:
            return
        try:
            store.set(self._key(self.rank), where)
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("recckpt: could not mark arrival at %s: %s", where, e)
            self._store, self._broken = None, True

    def missing(self, where: str) -> str:
        """A clause ('; ...') naming the ranks whose last mark is not `where` (with the step they last
        reached), or saying that every rank reached it; '' when the store cannot tell."""
        store = self._client()
        if store is None:
            return ""
        behind = []
        try:
            for r in range(self.world):
                k = self._key(r)
                last = store.get(k).decode("utf-8", "replace") if store.check([k]) else None
                if last != where:
                    behind.append(f"rank {r} (last reached: {last})" if last else f"rank {r} (reached none yet)")
        except Exception as e:  # noqa: BLE001 - the store went with a dead rank: say nothing
            log.debug("recckpt: could not read arrivals: %s", e)
            return ""
        if not behind:
            return f"; every rank reached {where}"
        return f"; ranks that did not reach {where}: {', '.join(behind)}"
