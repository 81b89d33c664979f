"""Local disk: the fast path. The C++ engine writes and reads these files directly."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

from .base import Storage, fill_from
from .regular import open_regular, read_regular, regular_size


class LocalStorage(Storage):
    is_local = True
    atomic_rename = True

    def __init__(self, root: str):
        super().__init__(os.path.abspath(os.fspath(root)))

    def local_path(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def exists(self, path):
        return os.path.exists(self.local_path(path))

    def is_link(self, path):
        return os.path.islink(self.local_path(path))

    def isdir(self, path):
        return os.path.isdir(self.local_path(path))

    def listdir(self, path):
        try:
            return sorted(os.listdir(self.local_path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path):
        os.makedirs(self.local_path(path), exist_ok=True)

    # Reads open regular files only, checked on the opened file (regular.py): a FIFO, a device or a
    # link where a checkpoint file should be is refused, never read.
    def size(self, path):
        return regular_size(self.local_path(path))

    def read_bytes(self, path, offset=0, length=None):
        return read_regular(self.local_path(path), offset, length)

    def read_into(self, path, buf):
        f, _ = open_regular(self.local_path(path))
        with f:
            return fill_from(f, buf)

    @contextlib.contextmanager
    def open_write(self, path, fsync=True):
        with open(self.local_path(path), "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def put_file(self, local_src, path):
        shutil.copyfile(local_src, self.local_path(path))

    def rename(self, src, dst):
        d = self.local_path(dst)
        if os.path.exists(d):
            raise FileExistsError(errno.EEXIST, "destination exists", d)
        os.rename(self.local_path(src), d)

    def replace_file(self, src, dst):
        os.replace(self.local_path(src), self.local_path(dst))

    def remove_file(self, path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.local_path(path))

    def remove_tree(self, path):
        shutil.rmtree(self.local_path(path), ignore_errors=False)

    def why_not_inside(self, path, root):
        # A checkpoint from a stranger must not make us read other local files through links: the file
        # itself may not be a link, and nothing on its way (a linked sub-directory) may lead outside.
        # The checkpoint directory itself may be a link (e.g. latest -> ckpt_100).
        p = self.local_path(path)
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            return "is a symbolic link"
        if not stat.S_ISREG(mode):
            return "is not a regular file"
        real_root = os.path.realpath(self.local_path(root))
        real = os.path.realpath(p)
        if os.path.commonpath([real, real_root]) != real_root:
            return f"resolves to {real}, outside the checkpoint"
        return None

    def fsync_dir(self, path):
        fd = os.open(self.local_path(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
