"""The background writer of async saves: one save in flight at a time, failures kept until reported.

A save goes through two states: *staged* (a consistent snapshot is in host buffers; the training step
has returned) and *durable* (written, fsynced and committed). A failure in the background is stored
and raised by the next call into the manager (`step()`, `save()`, `wait()`), so it is never lost (several
failures before one is reported: the first, naming the others); it
is also logged at once, in case the process ends before that call.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

# AsyncSaveError and AsyncCommitOutcomeUnknownError live in recckpt.errors; imported here also so that
# the old import path (recckpt.train.async_save) keeps working.
from ..errors import AsyncCommitOutcomeUnknownError, AsyncSaveError, CommitOutcomeUnknownError, InvalidArgumentError

log = logging.getLogger("recckpt")

STAGED, DURABLE, FAILED = "staged", "durable", "failed"


class SaveHandle:
    """One save. `state` is 'staged' until the background write ends, then 'durable' or 'failed';
    a sync save's handle is durable when returned."""

    def __init__(self, ckpt_id: str, step: int, ephemeral: bool):
        self.ckpt_id, self.step, self.ephemeral = ckpt_id, step, ephemeral
        self.state = STAGED
        self.path: str | None = None
        self.error: BaseException | None = None
        self.stall_seconds = 0.0
        """Time the training step spent in this save (the snapshot, or the whole save when sync)."""
        self.write_seconds = 0.0
        """Time the write took (in the background when async)."""
        self.bytes_written = 0
        self._done = threading.Event()

    @property
    def durable(self) -> bool:
        return self.state == DURABLE

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until durable; returns the checkpoint's location, raises if the write failed. `timeout`:
        seconds (a number >= 0) or None (no limit); TimeoutError when it passes first."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):   # (NaN fails `>= 0`)
            raise InvalidArgumentError(f"SaveHandle.wait: timeout must be a number of seconds >= 0 or None, "
                                       f"got {timeout!r}")
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.ckpt_id!r} is not durable after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.path

    def finish(self, path: str | None, error: BaseException | None) -> None:
        """Record the outcome: durable at `path`, or failed with `error` (by the manager or its writer)."""
        self.path, self.error = path, error
        self.state = DURABLE if error is None else FAILED
        self._done.set()

    def __repr__(self):
        return f"SaveHandle({self.ckpt_id!r}, step={self.step}, state={self.state!r})"


class AsyncWriter:
    """Runs one write at a time on a background thread."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._current: SaveHandle | None = None
        self._unreported: list[SaveHandle] = []   # failed saves not yet reported, oldest first
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> SaveHandle | None:
        h = self._current
        return h if h is not None and not h.done() else None

    def submit(self, handle: SaveHandle, write: Callable[[], tuple[str, int]],
               on_durable: Callable[[SaveHandle], None] | None = None) -> None:
        """Start `write()` (returning (path, bytes)) in the background. The caller has drained the
        previous save (`drain()`) before taking the snapshot the write reads. `on_durable(handle)` runs
        on the writer thread once the save is durable; what it raises is logged, never the save's."""
        if self.in_flight is not None:
            raise RuntimeError("AsyncWriter.submit while a save is in flight; call drain() first")

        def run():
            t0 = time.perf_counter()
            try:
                path, nbytes = write()
            except BaseException as e:  # noqa: BLE001 - stored and re-raised on the caller's thread
                handle.write_seconds = time.perf_counter() - t0
                log.error("recckpt: background save of %r failed: %s", handle.ckpt_id, e)
                if isinstance(e, CommitOutcomeUnknownError):  # "nothing was committed" would be wrong
                    err = AsyncCommitOutcomeUnknownError(
                        f"the async save of checkpoint {handle.ckpt_id!r} (step {handle.step}) did not learn "
                        f"its outcome in the background: {e}", rank=getattr(e, "rank", None))
                else:
                    err = AsyncSaveError(
                        f"the async save of checkpoint {handle.ckpt_id!r} (step {handle.step}) failed in the "
                        f"background: {type(e).__name__}: {str(e).rstrip('.')}. Nothing of it was committed and earlier "
                        f"checkpoints are intact.", path=getattr(e, "path", None), table=getattr(e, "table", None),
                        rank=getattr(e, "rank", None))
                err.__cause__ = e
                with self._lock:
                    self._unreported.append(handle)
                handle.finish(None, err)
                return
            handle.write_seconds = time.perf_counter() - t0
            handle.bytes_written = nbytes
            handle.finish(path, None)
            if on_durable is not None:
                try:
                    on_durable(handle)
                except Exception:  # noqa: BLE001 - a user callback must not turn a durable save into a failure
                    log.exception("recckpt: the on_save callback for checkpoint %r raised", handle.ckpt_id)

        self._current = handle
        # Not a daemon: an interpreter that exits normally finishes the write instead of cutting it.
        self._thread = threading.Thread(target=run, name=f"recckpt-save-{handle.ckpt_id}")
        self._thread.start()

    def drain(self) -> None:
        """Wait for the save in flight, if any (its failure is reported by `raise_failure`)."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None

    def take_failure(self) -> BaseException | None:
        """The background failure not yet reported to the caller, now reported (once); None if none. Where
        several saves failed before the caller heard of the first (a step drains a failure without raising
        it, docs/DISTRIBUTED.md), the first is returned, its message naming the later ones."""
        with self._lock:
            failed, self._unreported = self._unreported, []
        if not failed:
            return None
        first = failed[0].error
        if len(failed) == 1 or not hasattr(first, "retold"):
            return first
        later = "; ".join(f"{h.ckpt_id!r} (step {h.step}): {type(h.error.__cause__ or h.error).__name__}: "
                          f"{h.error.__cause__ or h.error}" for h in failed[1:])
        err = first.retold(f"{first} Later async saves failed as well before this was reported: {later}")
        err.__cause__ = first.__cause__
        return err

    def raise_failure(self) -> None:
        """Raise a background failure not yet reported to the caller (once)."""
        err = self.take_failure()
        if err is not None:
            raise err


__all__ = ["AsyncSaveError", "AsyncCommitOutcomeUnknownError", "AsyncWriter", "SaveHandle", "STAGED", "DURABLE", "FAILED"]
