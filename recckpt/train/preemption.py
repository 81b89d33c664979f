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
        self._retired = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run on the main thread (Python delivers "
                               "signals only there); create the CheckpointManager on the main thread")
        self._retired = False
        for s in self.signals:
            prev = signal.signal(s, self._on_signal)
            if prev != self._on_signal:   # (installed again over itself: keep what it passes signals on to)
                self._previous[s] = prev

    def uninstall(self) -> None:
        """Stop handling the signals (the manager is closed, or gone). Where this handler is still the one
        installed, the previous one is put back; where another was installed over it (a later manager's,
        which will pass the signal on to this one), or off the main thread (a manager collected by the
        garbage collector), this handler stays installed but passes every signal on to its previous one:
        a dropped manager must not swallow the SIGTERM that should end the process."""
        self._retired = True
        if threading.current_thread() is not threading.main_thread():
            return
        for s in list(self._previous):
            if signal.getsignal(s) == self._on_signal:
                prev = self._previous.pop(s)
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        if self._retired:
            self._pass_on(signum, self._previous.get(signum, signal.SIG_DFL))
        else:
            self.requested = signum

    @staticmethod
    def _pass_on(signum: int, prev) -> None:
        if callable(prev):
            prev(signum, None)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the default disposition: the process ends as signalled

    def finish(self) -> None:
        """Called once the preemption checkpoint is durable: the request is served (a loop that goes on
        after it, with exit_after_save=False, does not save at every later step)."""
        signum, self.requested = self.requested, None
        prev = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if self.exit_after_save and signum is not None:
            self._pass_on(signum, prev)


__all__ = ["PreemptionHandler"]
