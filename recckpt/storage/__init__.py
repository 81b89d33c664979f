"""Where bytes go: a fast local path, or any fsspec filesystem (object stores, memory://).

`open_storage(url, storage_options)` looks the backend up by the URL's scheme. Each backend owns its
commit protocol (see base.Storage); the format layer never asks which kind of store it has.
"""
from __future__ import annotations

import os

from .base import Claim, Storage
from .fsspec_store import FsspecStorage
from .local import LocalStorage


def _local(url: str, storage_options: dict | None, **kw) -> Storage:
    # storage_options configure fsspec clients; a Saver on S3 may still load a local model-bank path.
    return LocalStorage(url[len("file://"):] if url.startswith("file://") else url)


def _fsspec(url: str, storage_options: dict | None, **kw) -> Storage:
    return FsspecStorage(url, storage_options, **kw)


#: Backends by URL scheme; any other scheme goes to fsspec, which knows many more.
BACKENDS = {"": _local, "file": _local}


def open_storage(url, storage_options: dict | None = None, **kw) -> Storage:
    """The store for a local path or an fsspec URL. `storage_options` go to fsspec (endpoint,
    credentials, profile, ...); `kw` (timeout_s, lease_s) to object-store backends."""
    url = os.fspath(url)
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return BACKENDS.get(scheme, _fsspec)(url, storage_options, **kw)


__all__ = ["Storage", "Claim", "LocalStorage", "FsspecStorage", "open_storage", "BACKENDS"]
