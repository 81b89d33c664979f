"""Where bytes go: a fast local path, or any fsspec filesystem.

`open_storage(url)` picks the implementation. Both expose the same small set of operations the format
layer needs, and `is_local` tells the format layer whether the C++ engine may read and write the files
directly (local) or must go through temporary local files and ranged reads (fsspec).
"""
from .base import Storage
from .local import LocalStorage
from .fsspec_store import FsspecStorage


def open_storage(url: str) -> Storage:
    import os
    url = os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return FsspecStorage(url)
    return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)


__all__ = ["Storage", "LocalStorage", "FsspecStorage", "open_storage"]
