"""Opening a local file to read it, only if it is a regular file.

A checkpoint or output directory may come from someone else. Checking a path first (`stat`) and then
opening it trusts a name twice; a FIFO named like a checkpoint file would block the open, a link to
/dev/zero reports size 0 and never ends. So the file is opened without following a link at its last
component and without blocking, and the *opened* file is checked; its size is the opened file's.
"""
from __future__ import annotations

import errno
import os
import stat

from ..errors import CorruptCheckpointError

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW | os.O_NONBLOCK


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def refuse(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path} is {what}, not a regular file; recckpt reads only regular files "
                                  f"(a checkpoint or output directory from elsewhere may be hostile)", path)


def open_regular(path: str):
    """A binary file object (unbuffered) for the regular file at `path`, and its size from the opened
    file. FileNotFoundError when it does not exist; CorruptCheckpointError naming it when it is a link,
    FIFO, device, socket or directory."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:   # O_NOFOLLOW on a symbolic link
            raise refuse(path, "a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):   # a socket; a directory on some systems
            raise refuse(path, "a socket" if e.errno == errno.ENXIO else "a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(path, _kind(st.st_mode))
        os.set_blocking(fd, True)   # no effect on a regular file's reads; plain semantics from here on
        return os.fdopen(fd, "rb", buffering=0), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, offset: int = 0, length: int | None = None) -> bytes:
    """Bytes [offset, offset+length) of the regular file at `path` (to the end of the file as opened:
    never more than its size at open time, whatever happens to it meanwhile)."""
    f, size = open_regular(path)
    with f:
        n = max(0, size - offset) if length is None else max(0, min(length, size - offset))
        if offset:
            f.seek(offset)
        # FileIO.read(k) reads into the bytes object it returns: no zeroed buffer and no copies after
        # (a 300 MB index read otherwise costs three passes over its memory).
        chunks, remaining = [], n
        while remaining:
            piece = f.read(remaining)
            if not piece:
                break
            chunks.append(piece)
            remaining -= len(piece)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def regular_size(path: str) -> int:
    """The size of the regular file at `path`, from the opened file (refuses what `open_regular` does)."""
    f, size = open_regular(path)
    f.close()
    return size
