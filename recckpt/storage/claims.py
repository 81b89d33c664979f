"""Claims: how a live writer says "mine" about what it writes, and when a claim is provably abandoned.

One rule for every kind of store. A claim's body names its holder and its lease:

    {"host", "boot_id", "pid_ns", "pid", "start", "target", "beat", "expires"}

`host` is the host name, `boot_id` the kernel's boot id (/proc/sys/kernel/random/boot_id: it changes at
every boot, and two machines never share one), `pid_ns` the holder's pid namespace (containers on one
kernel share a boot id but not their process ids), `pid` and `start` the holder process and its start
time (a pid reused by a later process is not the holder). `beat` is the holder's clock at its last
heartbeat and `expires` = beat + its lease: the holder rewrites the claim every lease / 3 while it
works.

A claim is abandoned (`abandoned` says why) only when that can be proved:
- on the holder's own machine (same host, boot id and pid namespace): its process has exited; and
- anywhere else: its lease expired (`expires` has passed on this host's clock; clocks of hosts sharing an
  output directory must agree to well within a lease).
A process id alone proves nothing across hosts or containers, so a claim written elsewhere lives until it
expires, however dead its pid looks here. Stores add what they can prove besides (a local flock).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable

#: Seconds a claim lives without a heartbeat (rewritten every LEASE_S / 3).
LEASE_S = 60.0


@functools.lru_cache(maxsize=None)
def _read_proc(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read_proc("/proc/sys/kernel/random/boot_id")


def _pid_ns() -> str:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def process_start(pid: int) -> int | None:
    """Start time of process `pid` (clock ticks since boot), None when there is no such process or it has
    exited (a zombie, not yet reaped by its parent); -1 where /proc cannot tell (only existence is known)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # the fields after "(comm)", from field 3 on
        if fields[0] in ("Z", "X"):
            return None
        return int(fields[19])   # field 22: start time
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return -1
    return -1


def holder() -> dict:
    """Who this process is, as a claim records it."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid_ns": _pid_ns(), "pid": pid,
            "start": process_start(pid)}


def body(target: str, lease_s: float = LEASE_S, now: float | None = None) -> dict:
    """A fresh claim body for `target`, held by this process for `lease_s` from now."""
    now = time.time() if now is None else now
    return {**holder(), "target": target, "beat": now, "expires": now + lease_s}


def renewed(b: dict, lease_s: float, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    return {**b, "beat": now, "expires": now + lease_s}


def encode(b: dict) -> bytes:
    return json.dumps(b, sort_keys=True).encode()


def decode(data: bytes) -> dict | None:
    """The body, or None when `data` is not one (empty, cut short, garbled)."""
    try:
        b = json.loads(data.decode("utf-8").strip() or "null")
    except (UnicodeDecodeError, ValueError):
        return None
    return b if isinstance(b, dict) else None


def _same_machine(b: dict) -> bool:
    me = holder()
    return all(isinstance(b.get(k), str) and b.get(k) and b.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def abandoned(b: dict | None, lease_s: float = LEASE_S, now: float | None = None,
              written_at: float | None = None) -> str | None:
    """Why the claim with body `b` is provably abandoned, or None while its holder may be alive.

    `lease_s` is this reader's lease, used only for claims that do not record their expiry (written by
    older versions); `written_at` is when the store last saw the claim written (a file's mtime), used for
    a body that cannot be read (None: the store writes claims in one step, so such a body is not one)."""
    now = time.time() if now is None else now
    if b is None:
        if written_at is None:
            return "its claim is not one a writer wrote"
        if now - written_at > lease_s:
            return f"its claim is unreadable and was last written {now - written_at:.0f} s ago"
        return None   # possibly being written right now
    pid = b.get("pid")
    if _same_machine(b) and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        start = process_start(pid)
        if start is None:
            return f"its process {pid} on this machine has exited"
        recorded = b.get("start")
        if isinstance(recorded, int) and recorded >= 0 and start >= 0 and start != recorded:
            return f"its process {pid} on this machine has exited (the pid now belongs to another process)"
        return None   # alive here, however late its heartbeat
    expires = _number(b.get("expires"))
    if expires is None:   # an older writer's claim: its last beat (or write) plus our lease
        beat = _number(b.get("beat"))
        beat = beat if beat is not None else written_at
        expires = None if beat is None else beat + lease_s
    if expires is None:
        return "its claim records no lease"
    if now > expires:
        return f"its lease (held by {b.get('host')!s:.100} pid {pid!s:.20}) expired {now - expires:.0f} s ago"
    return None


class Heartbeat:
    """Rewrites a claim (`write(body)`) every lease / 3 until stopped; a failed beat is retried at the next."""

    def __init__(self, write: Callable[[dict], None], b: dict, lease_s: float, name: str):
        self._write, self.body, self.lease_s = write, b, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"recckpt-claim-{name}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with contextlib.suppress(Exception):   # a missed beat only shortens the lease; the next renews
                self.body = renewed(self.body, self.lease_s)
                self._write(self.body)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
