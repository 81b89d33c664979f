"""Opt-in preemption handling: a signal asks for a checkpoint at the next step boundary.

The signal handler only records the request (a handler cannot safely save in the middle of a step).
The manager's next `step()` saves, waits until the checkpoint is durable, then calls `finish()`,
which puts back the previous handlers and re-delivers the signal, so the process exits as it would
have without recckpt (or, with `exit_after_save=False`, returns and leaves the exit to the caller).
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError


@dataclass
class PreemptionHandler:
    signals: tuple = (signal.SIGTERM,)
    """Signals that request a final checkpoint (e.g. (SIGTERM, SIGUSR1))."""

    exit_after_save: bool = True
    """After the checkpoint is durable, re-deliver the signal to the previous handler (default: the
    process exits). False: only set `manager.preempted` and let the training loop stop itself."""

    requested: int | None = field(default=None, init=False)
    """The signal received, None while none was."""

    def __post_init__(self):
        sigs = tuple(self.signals)
        if not sigs:
            raise InvalidArgumentError("PreemptionHandler.signals must name at least one signal")
        for s in sigs:
            if not isinstance(s, int) or s in (signal.SIGKILL, signal.SIGSTOP):
                raise InvalidArgumentError(f"PreemptionHandler.signals: {s!r} cannot be handled (SIGKILL/SIGSTOP "
                                 f"cannot be caught; give signal numbers such as signal.SIGTERM)")
        valid = signal.valid_signals()
        bad = [s for s in sigs if s not in valid]
        if bad:
            raise InvalidArgumentError(f"PreemptionHandler.signals: {bad} are not signals of this platform; give "
                                       f"signal numbers such as signal.SIGTERM")
        self.signals = tuple(signal.Signals(s) for s in sigs)
        if not isinstance(self.exit_after_save, bool):
            raise InvalidArgumentError(f"PreemptionHandler.exit_after_save must be a bool, got {self.exit_after_save!r}")
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run on the main thread (Python delivers "
                               "signals only there); create the CheckpointManager on the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.requested = signum

    def finish(self) -> None:
        """Called once the preemption checkpoint is durable."""
        signum = self.requested
        prev = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if not self.exit_after_save or signum is None:
            return
        if callable(prev):
            prev(signum, None)
        elif prev != signal.SIG_IGN:
            os.kill(os.getpid(), signum)  # default disposition, now restored: the process ends as signalled


__all__ = ["PreemptionHandler"]
