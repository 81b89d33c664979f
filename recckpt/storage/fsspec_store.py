"""Any fsspec filesystem (object stores, memory://, ...). Slower than local: the engine writes shard
files to a local temporary directory first and reads go through ranged requests."""
from __future__ import annotations

import contextlib
import errno

from .base import Storage, fill_from


class FsspecStorage(Storage):
    is_local = False
    atomic_rename = False  # object stores copy-then-delete; the manifest written last is the commit

    def __init__(self, url: str):
        import fsspec
        self.fs, root = fsspec.core.url_to_fs(url)
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        super().__init__(root.rstrip("/") or "/")
        from fsspec.implementations.local import LocalFileSystem
        #: True for fsspec's local filesystem under any protocol name (open_storage uses LocalStorage then).
        self.reaches_local_disk = isinstance(self.fs, LocalFileSystem)

    def describe(self, path=""):
        return f"{self.protocol}://{self._p(path)}"

    def _p(self, path):
        return f"{self.root.rstrip('/')}/{path}" if path else self.root

    def exists(self, path):
        return self.fs.exists(self._p(path))

    def isdir(self, path):
        return self.fs.isdir(self._p(path))

    def listdir(self, path):
        try:
            entries = self.fs.ls(self._p(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = self._p(path).rstrip("/") + "/"
        names = []
        for e in entries:
            e = e.rstrip("/")
            # some filesystems return paths without the leading '/' of the root
            name = e[len(prefix):] if e.startswith(prefix) else e.rsplit("/", 1)[-1]
            if name:
                names.append(name)
        return sorted(set(names))

    def makedirs(self, path):
        self.fs.makedirs(self._p(path), exist_ok=True)

    def size(self, path):
        return self.fs.size(self._p(path))

    def read_bytes(self, path, offset=0, length=None):
        with self.fs.open(self._p(path), "rb") as f:
            if offset:
                f.seek(offset)
            return f.read() if length is None else f.read(length)

    def read_into(self, path, buf):
        with self.fs.open(self._p(path), "rb") as f:
            return fill_from(f, buf)

    @contextlib.contextmanager
    def open_write(self, path, fsync=True):
        with self.fs.open(self._p(path), "wb") as f:
            yield f

    def put_file(self, local_src, path):
        self.fs.put_file(local_src, self._p(path))

    def rename(self, src, dst):
        if self.fs.exists(self._p(dst)):
            raise FileExistsError(errno.EEXIST, "destination exists", self.describe(dst))
        self.fs.mv(self._p(src), self._p(dst), recursive=True)

    def replace_file(self, src, dst):
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(dst))
        self.fs.mv(self._p(src), self._p(dst))

    def remove_file(self, path):
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(path))

    def remove_tree(self, path):
        self.fs.rm(self._p(path), recursive=True)
