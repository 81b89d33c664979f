"""The storage interface. Paths are '/'-separated and relative to the storage root."""
from __future__ import annotations

import abc
import contextlib
from typing import BinaryIO, Iterator


def fill_from(f: BinaryIO, buf) -> int:
    """readinto() until `buf` is full or the file ends (one call may return less); the bytes read."""
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


class Storage(abc.ABC):
    #: True when `local_path()` gives an OS path the C++ engine can open directly.
    is_local: bool = False
    #: True when `rename` of a directory is one atomic step on this store.
    atomic_rename: bool = False

    def __init__(self, root: str):
        self.root = root

    def describe(self, path: str = "") -> str:
        """A human-readable location for error messages."""
        return f"{self.root.rstrip('/')}/{path}" if path else self.root

    def local_path(self, path: str) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no local paths")

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of a directory; [] when it does not exist."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def size(self, path: str) -> int: ...

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of a file (to its end when length is None)."""

    def read_into(self, path: str, buf) -> int:
        """Read the start of a file into the writable buffer `buf` (up to its length); returns the bytes
        read. Stores that can read into caller memory override this to skip the copy."""
        data = self.read_bytes(path, 0, len(memoryview(buf).cast("B")))
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    @abc.abstractmethod
    @contextlib.contextmanager
    def open_write(self, path: str, fsync: bool = True) -> Iterator[BinaryIO]:
        """A binary file opened for writing; durable when the context exits normally and fsync is set."""

    def write_bytes(self, path: str, data: bytes, fsync: bool = True) -> None:
        with self.open_write(path, fsync=fsync) as f:
            f.write(data)

    @abc.abstractmethod
    def put_file(self, local_src: str, path: str) -> None:
        """Copy a local file into the store (used for files the C++ engine wrote locally)."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Move a file or directory; atomic where `atomic_rename` is set. Fails if dst exists."""

    @abc.abstractmethod
    def replace_file(self, src: str, dst: str) -> None:
        """Move a file over an existing one (atomic on local disks)."""

    @abc.abstractmethod
    def remove_file(self, path: str) -> None: ...

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...

    def is_link(self, path: str) -> bool:
        """True when `path` is a symbolic link (stores without links: never)."""
        return False

    def why_not_inside(self, path: str, root: str) -> str | None:
        """None when `path` is a regular file whose real location is inside directory `root`; otherwise
        why not. Stores without links (object stores) have nothing to check."""
        return None

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries durable (no-op where the store has no such notion)."""
