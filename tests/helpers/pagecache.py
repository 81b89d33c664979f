"""Files out of the page cache, for tests of cold reads (the engine's direct reads, docs/ENGINE.md)."""
from __future__ import annotations

import os


def drop_cache(path) -> None:
    """Write back and drop `path`'s pages from the page cache (what a cold load finds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
