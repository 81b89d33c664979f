"""Where bytes go: a fast local path, or any fsspec filesystem (object stores, memory://).

`open_storage(url, storage_options)` looks the backend up by the URL's scheme. Each backend owns its
commit protocol (see base.Storage); the format layer never asks which kind of store it has.
"""
from __future__ import annotations

import os

from ..errors import InvalidArgumentError, StorageURLError
from .base import Claim, Storage
from .fsspec_store import FsspecStorage
from .local import LocalStorage


def _local(url: str, storage_options: dict | None, **kw) -> Storage:
    # storage_options configure fsspec clients; a Saver on S3 may still load a local model-bank path.
    path = url[len("file://"):] if url.startswith("file://") else url
    if not path:   # "file://" alone would silently mean the current directory
        raise StorageURLError(f"{url!r} names no directory; give a path, e.g. file:///data/run1")
    # "~/ckpts" and "file://~/ckpts" mean the home directory, as in a shell and in fsspec: not "./~"
    return LocalStorage(os.path.expanduser(path))


#: Schemes whose first path segment is a bucket (or container): a URL without one names no store.
BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def _check_object_url(url: str) -> None:
    """Refuse an object-store URL that names no bucket, or whose key has an empty segment ("s3://b//run"
    names keys under "b//run", which s3fs's listings do not return, so every save found its own files gone
    and failed, blaming another process). Each part of a chained URL ("simplecache::s3://b/run") is
    checked; other filesystems (ftp://host//abs, zip://c::file:///a.zip) keep their own rules."""
    for part in url.split("::"):
        scheme, sep, rest = part.partition("://")
        if not sep or scheme not in BUCKET_SCHEMES:
            continue
        key = rest.split("?", 1)[0]
        if not key.strip("/") or key.startswith("/"):
            raise StorageURLError(f"{url!r} names no bucket; give one, e.g. {scheme}://my-bucket/run1")
        if "//" in key.rstrip("/"):
            raise StorageURLError(f"{url!r} has an empty path segment ('//'); remove it, e.g. "
                                  f"{scheme}://{'/'.join(p for p in key.split('/') if p)}")


def _fsspec(url: str, storage_options: dict | None, **kw) -> Storage:
    _check_object_url(url)
    try:
        fs = FsspecStorage(url, storage_options, **kw)
    except (ValueError, ImportError) as e:   # fsspec: "Protocol not known", a missing driver
        raise StorageURLError(
            f"{url}: cannot open this URL ({type(e).__name__}: {e}). Use a local path, a file:// URL, or "
            f"the URL of a filesystem fsspec knows (e.g. s3://, gs://, memory://) with its package "
            f"installed") from None
    # Every protocol that reaches the local disk (local://, and fsspec's other names for it) gets the
    # local store: its regular-file and link checks, and the engine's direct reads.
    return LocalStorage(fs.root) if fs.reaches_local_disk else fs


#: Backends by URL scheme; any other scheme goes to fsspec, which knows many more.
BACKENDS = {"": _local, "file": _local}


def location(url) -> str:
    """`url` (a path, os.PathLike or URL) as the string recckpt keeps; anything else is refused here, where
    every public entry point turns its location into a string."""
    if not isinstance(url, (str, os.PathLike)):
        raise StorageURLError(
            f"a storage location must be a path or URL string, got a {type(url).__module__}.{type(url).__qualname__}"
            + ("; pass the filesystem's URL (e.g. 's3://bucket/run') and its settings as storage_options"
               if hasattr(url, "protocol") else ""))
    url = os.fspath(url)
    if not isinstance(url, str):
        raise StorageURLError(f"a storage location must be a str path or URL, got {url!r}")
    return url


def open_storage(url, storage_options: dict | None = None, **kw) -> Storage:
    """The store for a local path or an fsspec URL. `storage_options` go to fsspec (endpoint,
    credentials, profile, ...); `kw` (timeout_s, lease_s) to object-store backends."""
    url = location(url)
    if not url:
        raise StorageURLError(f"a storage location must be a non-empty path or URL, got {url!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidArgumentError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return BACKENDS.get(scheme, _fsspec)(url, storage_options, **kw)


__all__ = ["Storage", "Claim", "LocalStorage", "FsspecStorage", "open_storage", "location", "BACKENDS"]
