"""Where bytes go: a fast local path, or any fsspec filesystem.

`open_storage(url)` picks the implementation. Both expose the same small set of operations the format
layer needs, and `is_local` tells the format layer whether the C++ engine may read and write the files
directly (local) or must go through temporary local files and ranged reads (fsspec).
"""
from ..errors import StorageURLError
from .base import Storage
from .local import LocalStorage
from .fsspec_store import FsspecStorage


def open_storage(url: str) -> Storage:
    import os
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise StorageURLError(f"a storage location must be a non-empty path or URL, got {url!r}")
    if "://" in url and not url.startswith("file://"):
        try:
            fs = FsspecStorage(url)
        except (ValueError, ImportError) as e:   # fsspec: "Protocol not known", a missing driver
            raise StorageURLError(
                f"{url}: cannot open this URL ({type(e).__name__}: {e}). Use a local path, a file:// URL, or "
                f"the URL of a filesystem fsspec knows (e.g. s3://, gs://, memory://) with its package "
                f"installed") from None
        # Every protocol that reaches the local disk (local://, and fsspec's other names for it) gets the
        # local store: its regular-file and link checks, and the engine's direct reads.
        return LocalStorage(fs.root) if fs.reaches_local_disk else fs
    path = url[len("file://"):] if url.startswith("file://") else url
    if not path:   # "file://" alone would silently mean the current directory
        raise StorageURLError(f"{url!r} names no directory; give a path, e.g. file:///data/run1")
    return LocalStorage(path)


__all__ = ["Storage", "LocalStorage", "FsspecStorage", "open_storage"]
