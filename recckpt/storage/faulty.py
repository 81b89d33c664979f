"""A storage wrapper that fails chosen operations, to prove that saves survive a full disk or a failing
device: `FaultyStorage(inner).arm("rename", 1, errno.EIO)` makes the next rename raise OSError(EIO).

Every mutating operation is counted by kind, so a test can first run a save unarmed (`counts()` says
how many operations of each kind it does) and then fail each one of them in turn. The C++ engine writes
shard files itself, not through this class; the kinds `engine_write`/`engine_fsync` arm the engine's
own hook (`recckpt._C._inject_fault`) so those writes are covered too. Test-only: nothing in recckpt
creates a FaultyStorage by itself.
"""
from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import types
from typing import BinaryIO, Iterator

from .base import Storage

#: Operation kinds this wrapper can fail. `write` is one `write()` call on a file opened for writing
#: (half of its bytes reach the file first, as with a disk that fills up mid-write); `fsync` is the
#: fsync of a file or of a directory.
PYTHON_OPS = ("write", "fsync", "rename", "replace", "makedirs", "put", "remove")
ENGINE_OPS = ("engine_write", "engine_fsync")
OPS = PYTHON_OPS + ENGINE_OPS


class InjectedFault(OSError):
    """The OSError an armed operation raises (an OSError subclass, so code under test cannot tell)."""


class _FaultyFile:
    def __init__(self, f: BinaryIO, storage: "FaultyStorage", path: str):
        self._f, self._s, self._path = f, storage, path

    def write(self, data) -> int:
        err = self._s._tick("write", self._path)
        if err:
            view = memoryview(data).cast("B")
            self._f.write(view[:len(view) // 2])
            raise InjectedFault(err, f"{os.strerror(err)} (injected on write)", self._s.describe(self._path))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


class FaultyStorage:
    """Wraps a store so that its own commit protocol runs with this wrapper as `self`: every primitive
    operation it performs (write, fsync, rename, replace, makedirs, upload, remove) passes through the
    fault counters below, while everything else is the wrapped store's (see __getattr__)."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self._armed: dict[str, tuple[int, int]] = {}
        self._engine_armed: tuple[str, int] | None = None
        self._seen: dict[str, int] = dict.fromkeys(PYTHON_OPS, 0)
        self.fired: list[tuple[str, int, str]] = []   # (op, errno, path) of every fault raised

    def __getattr__(self, name):
        # Methods of the wrapped store run bound to this wrapper, so the primitives they call are the
        # faulty ones below; data attributes (root, fs, ...) are the wrapped store's.
        attr = getattr(type(self.inner), name, None)
        if callable(attr) and not isinstance(attr, (staticmethod, classmethod, type)):
            return types.MethodType(attr, self)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------------------ control
    def arm(self, op: str, at: int, err: int = errno_mod.EIO) -> "FaultyStorage":
        """Fail the `at`-th operation of kind `op` from now (1-based) with errno `err`; resets counts."""
        if op not in OPS:
            raise ValueError(f"unknown fault op {op!r}; expected one of {OPS}")
        if not isinstance(at, int) or at < 1:
            raise ValueError(f"fault position must be an integer >= 1, got {at!r}")
        self.disarm()
        if op in ENGINE_OPS:
            from .. import _C
            _C._inject_fault(op[len("engine_"):], at, err)
            self._engine_armed = (op, at)
        else:
            self._armed[op] = (at, err)
        return self

    def disarm(self) -> None:
        """Turn every fault off and reset the operation counts."""
        from .. import _C
        self._armed.clear()
        self._engine_armed = None
        self._seen = dict.fromkeys(PYTHON_OPS, 0)
        for op in ENGINE_OPS:
            _C._inject_fault(op[len("engine_"):], 0)

    def counts(self) -> dict[str, int]:
        """Operations of each kind since the last arm()/disarm()."""
        from .. import _C
        out = dict(self._seen)
        for op in ENGINE_OPS:
            out[op] = _C._fault_seen(op[len("engine_"):])
        return out

    @property
    def triggered(self) -> bool:
        """Whether the armed fault has fired (Python operations, or the engine reached its position)."""
        if self._engine_armed is not None:
            op, at = self._engine_armed
            return self.counts()[op] >= at
        return bool(self.fired)

    def _tick(self, op: str, path: str = "") -> int:
        self._seen[op] += 1
        at, err = self._armed.get(op, (0, 0))
        if at and self._seen[op] == at:
            self.fired.append((op, err, path))
            return err
        return 0

    def _maybe_fail(self, op: str, path: str) -> None:
        err = self._tick(op, path)
        if err:
            raise InjectedFault(err, f"{os.strerror(err)} (injected on {op})", self.describe(path))

    # ----------------------------------------------------------------------- faulty primitives
    @contextlib.contextmanager
    def open_write(self, path: str, fsync: bool = True) -> Iterator[BinaryIO]:
        with self.inner.open_write(path, fsync=fsync) as f:
            yield _FaultyFile(f, self, path)
            # Raising here, inside the inner context, skips the inner fsync: a failed fsync.
            if fsync:
                self._maybe_fail("fsync", path)

    def write_bytes(self, path, data, fsync=True):
        with self.open_write(path, fsync=fsync) as f:
            f.write(data)

    def put_bytes(self, path, data, exclusive=False):
        self._maybe_fail("write", path)
        self.inner.put_bytes(path, data, exclusive)

    def upload(self, pairs):
        for _, p in pairs:
            self._maybe_fail("put", p)
        self.inner.upload(pairs)

    def makedirs(self, path):
        self._maybe_fail("makedirs", path)
        self.inner.makedirs(path)

    def rename(self, src, dst):
        self._maybe_fail("rename", src)
        self.inner.rename(src, dst)

    def replace_file(self, src, dst):
        self._maybe_fail("replace", src)
        self.inner.replace_file(src, dst)

    def remove_file(self, path):
        self._maybe_fail("remove", path)
        self.inner.remove_file(path)

    def remove_tree(self, path):
        self._maybe_fail("remove", path)
        self.inner.remove_tree(path)

    def fsync_dir(self, path):
        self._maybe_fail("fsync", path)
        self.inner.fsync_dir(path)
