"""Opt-in preemption handling: a signal asks for a checkpoint at the next step boundary.

The signal handler only records the request (a handler cannot safely save in the middle of a step).
The manager's next `step()` saves, waits until the checkpoint is durable, then calls `finish()`, which
stops handling the signals and passes the signal on to the handler that was there before recckpt's, so
the process exits as it would have without recckpt (or, with `exit_after_save=False`, returns and leaves
the exit to the caller).

Each install is a `_Link` of its own, holding the handlers it replaced: a manager closed (or dropped)
retires its own link only. A retired link that another handler was installed over stays in the chain
and passes every signal on, so no signal is swallowed by a manager that is gone.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError


class _Link:
    """One install of a PreemptionHandler: the handlers it replaced, and whether it still records signals."""

    def __init__(self, handler: "PreemptionHandler"):
        self.handler = handler
        self.previous: dict = {}
        self.retired = False

    def on_signal(self, signum, frame) -> None:
        if self.retired:
            _pass_on(signum, self.previous.get(signum, signal.SIG_DFL), skip_recckpt=False)
            return
        # Every live install below this one hears it too: each manager of the process saves at its next step.
        for link in _links_below(self, signum):
            if not link.retired:
                link.handler.requested = signum
        self.handler.requested = signum

    def retire(self) -> None:
        """Stop recording signals; where this link is still the installed handler (and on the main thread,
        the only one that may change handlers), put back the first handler below it that is not retired."""
        self.retired = True
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self.previous.items():
            if signal.getsignal(s) == self.on_signal:
                signal.signal(s, _walk(prev, lambda link: link.retired, s))


def _link_of(h) -> "_Link | None":
    return h.__self__ if isinstance(getattr(h, "__self__", None), _Link) and h == h.__self__.on_signal else None


def _links_below(link: _Link, signum: int) -> list:
    """The installs of recckpt handlers this one replaced for `signum`, nearest first."""
    out, seen = [], {id(link)}
    h = link.previous.get(signum)
    while (below := _link_of(h)) is not None and id(below) not in seen:
        seen.add(id(below))
        out.append(below)
        h = below.previous.get(signum)
    return out


def _waiting(link: _Link, signum: int) -> bool:
    """Whether another live install of the chain `link` is in still has a request to serve (its manager
    saves at its next step): the process exits only after the last of them has saved."""
    top = _link_of(signal.getsignal(signum)) if threading.current_thread() is threading.main_thread() else None
    chain = ([top, *_links_below(top, signum)] if top is not None else []) + _links_below(link, signum)
    return any(x is not link and not x.retired and x.handler.requested is not None for x in chain)


def _walk(h, skip, signum: int):
    """From handler `h`, down the chain past the links `skip` says to pass over (None: SIG_DFL)."""
    seen = set()
    while (link := _link_of(h)) is not None and skip(link) and id(link) not in seen:
        seen.add(id(link))
        h = link.previous.get(signum, signal.SIG_DFL)
    return signal.SIG_DFL if h is None else h


def _pass_on(signum: int, prev, skip_recckpt: bool) -> None:
    """Deliver `signum` to handler `prev` (past recckpt's own links if `skip_recckpt`: the checkpoint a
    request asked for is written, and the signal goes to what was there before recckpt)."""
    prev = _walk(prev, (lambda link: True) if skip_recckpt else (lambda link: link.retired), signum)
    if callable(prev):
        prev(signum, None)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default disposition: the process ends as signalled


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
        sigs = (self.signals,) if isinstance(self.signals, int) else self.signals   # one signal: a tuple of one
        if isinstance(sigs, (str, bytes)) or not hasattr(sigs, "__iter__"):
            raise InvalidArgumentError(f"PreemptionHandler.signals must be signal numbers such as (signal.SIGTERM,), "
                                       f"got {self.signals!r}")
        sigs = tuple(sigs)
        if not sigs:
            raise InvalidArgumentError("PreemptionHandler.signals must name at least one signal")
        for s in sigs:
            if not isinstance(s, int) or isinstance(s, bool):
                raise InvalidArgumentError(f"PreemptionHandler.signals: {s!r} is not a signal number; give signal "
                                           f"numbers such as signal.SIGTERM")
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise InvalidArgumentError(f"PreemptionHandler.signals: {s!r} cannot be handled (SIGKILL/SIGSTOP "
                                           f"cannot be caught)")
        valid = signal.valid_signals()
        bad = [s for s in sigs if s not in valid]
        if bad:
            raise InvalidArgumentError(f"PreemptionHandler.signals: {bad} are not signals of this platform; give "
                                       f"signal numbers such as signal.SIGTERM")
        self.signals = tuple(signal.Signals(s) for s in sigs)
        if not isinstance(self.exit_after_save, bool):
            raise InvalidArgumentError(f"PreemptionHandler.exit_after_save must be a bool, got {self.exit_after_save!r}")
        self._link: _Link | None = None

    def install(self) -> "_Link":
        """Handle the signals (on the main thread: Python delivers signals only there); returns this
        install's link, which `uninstall` retires (or its owner, when it is gone: `_Link.retire`)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run on the main thread (Python delivers "
                               "signals only there); create the CheckpointManager on the main thread")
        if self._link is not None:
            self._link.retire()   # installed again (a new manager given the same handler): the newest owns it
        link = _Link(self)
        for s in self.signals:
            link.previous[s] = signal.signal(s, link.on_signal)
        self._link = link
        return link

    def uninstall(self) -> None:
        """Stop handling the signals (the manager is closed): see `_Link.retire`."""
        if self._link is not None:
            self._link.retire()

    def finish(self) -> None:
        """Called once the preemption checkpoint is durable: the request is served (a loop that goes on
        after it, with exit_after_save=False, does not save at every later step), the signals are no longer
        handled, and with exit_after_save the signal goes on to the handler that was there before recckpt's."""
        signum, self.requested = self.requested, None
        link = self._link
        self.uninstall()
        if self.exit_after_save and signum is not None and link is not None and not _waiting(link, signum):
            _pass_on(signum, link.previous.get(signum, signal.SIG_DFL), skip_recckpt=True)

    def close(self, link: "_Link") -> None:
        """The owner of install `link` is closed: retire it, and deliver again a request no checkpoint
        served (the signal came after the last step), to whatever handles the signal now (another
        manager, or the default: the process ends), so that it is not lost; with exit_after_save=False it
        is left in `requested` for the caller. Nothing where the handler was installed again since."""
        link.retire()
        if link is self._link and self.requested is not None and self.exit_after_save:
            signum, self.requested = self.requested, None
            os.kill(os.getpid(), signum)


__all__ = ["PreemptionHandler"]
