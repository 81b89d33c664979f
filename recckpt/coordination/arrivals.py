"""Where each rank last got to in recckpt's collective protocols, so that a failed collective names the
ranks that never reached it (killed, crashed, or stuck before it) instead of "another rank".

Each rank writes one key per purpose ("save", "step") into the job's c10d store, overwritten at every
marked step (a save's protocol steps, a restore's agreement; not the per-step agreement of training, which
would cost a request a step), so nothing accumulates there. recckpt talks to that store through one client
of its own per process, connected once, on a thread given `STORE_TIMEOUT_S` (a store whose host is frozen
accepts a connection and never answers it), with that timeout on every request: a store that lived in a
rank that died, or stopped answering, costs at most `STORE_TIMEOUT_S` and only makes the error say less.
Best effort throughout: no failure here ever fails a save or a restore.
"""
from __future__ import annotations

import logging
import threading
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


#: (purpose, rank) -> how many steps this process has marked: the k-th mark of every rank is the same step
#: when the ranks make the same calls, so a rank whose count is past the one waited on has passed it.
_marked: dict[tuple[str, int], int] = {}

#: (host, port) of a store -> this process's client of it (None: it could not connect in time).
_clients: dict = {}
_clients_lock = threading.Lock()


def _client_of(where):
    """This process's client of the store at `where`, connecting once, within `STORE_TIMEOUT_S`."""
    with _clients_lock:
        if where in _clients:
            return _clients[where]
        box = {}

        def connect():
            try:
                import torch.distributed as dist
                box["client"] = dist.TCPStore(where[0], where[1], is_master=False, wait_for_workers=False,
                                              timeout=timedelta(seconds=STORE_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - best effort: errors then name no rank
                log.debug("recckpt: no store for arrivals: %s", e)
        t = threading.Thread(target=connect, name="recckpt-arrivals-connect", daemon=True)
        t.start()
        t.join(STORE_TIMEOUT_S)
        _clients[where] = box.get("client")   # (still connecting: given up, this process names no rank)
        return _clients[where]


def _forget_client(where) -> None:
    """After a failed request: the next mark connects again (the job may have a new store)."""
    with _clients_lock:
        _clients.pop(where, None)


class Arrivals:
    """Marks of one purpose's protocol steps, on every rank of the default process group."""

    def __init__(self, purpose: str, rank: int, world: int):
        self.purpose, self.rank, self.world = purpose, rank, world
        self._last: tuple[int, str] | None = None   # this rank's last mark: (its count, the step)

    def _where_and_client(self):
        try:
            where = _tcp_store_of_default_group()
        except Exception:  # noqa: BLE001 - no process group, or a store of another kind
            return None, None
        return (where, _client_of(where)) if where is not None else (None, None)

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{self.purpose}/{rank}"

    def mark(self, where: str) -> None:
        """This rank is about to enter step `where` (the same text on every rank)."""
        n = _marked[self.purpose, self.rank] = _marked.get((self.purpose, self.rank), 0) + 1
        self._last = (n, where)
        at, store = self._where_and_client()
        if store is None:
            return
        try:
            store.set(self._key(self.rank), f"{n}|{where}")
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("recckpt: could not mark arrival at %s: %s", where, e)
            _forget_client(at)

    def missing(self, where: str) -> str:
        """A clause ('; ...') naming the ranks that have not reached `where` (with the step they last
        reached), or saying that every rank reached it; '' when the store cannot tell. A rank whose marks
        count past this rank's mark of `where` went through it and on (to the next save, say): it is not
        behind."""
        at, store = self._where_and_client()
        if store is None:
            return ""
        keys = [self._key(r) for r in range(self.world)]
        behind = []
        try:
            mine = self._last[0] if self._last is not None and self._last[1] == where else None
            for r, k in enumerate(keys):
                value = store.get(k).decode("utf-8", "replace") if store.check([k]) else None
                if value is None:
                    behind.append(f"rank {r} (reached none yet)")
                    continue
                count, _, last = value.partition("|")
                count = int(count) if count.isdigit() else None
                if last == where or (mine is not None and count is not None and count > mine):
                    continue
                behind.append(f"rank {r} (last reached: {last})")
        except Exception as e:  # noqa: BLE001 - the store went with a dead rank: say nothing
            log.debug("recckpt: could not read arrivals: %s", e)
            _forget_client(at)
            return ""
        if not behind:
            return f"; every rank reached {where}"
        return f"; ranks that did not reach {where}: {', '.join(behind)}"
