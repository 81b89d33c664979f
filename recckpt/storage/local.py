"""Local disk: the fast path. The C++ engine writes and reads these files directly.

Commit protocol: a save writes into a staging directory, fsyncs it, and renames it to the checkpoint's
name (one atomic step); a delete renames the checkpoint away first. A writer holds an flock on its
owner file for as long as its staging directory exists, so recovery in another process can tell a live
writer's staging directory from a crashed one's (flock is per host: a directory shared by several
hosts over NFS needs one writer per directory).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time

from ..errors import ConcurrentCommitError, StorageError
from .base import Claim, Storage, fill_from
from .regular import open_regular, read_regular, regular_size


class _FlockClaim(Claim):
    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)   # removed while still locked: recovery never sees it free and present
        os.close(self.fd)
        self.fd = -1


class LocalStorage(Storage):
    def __init__(self, root: str):
        super().__init__(os.path.abspath(os.fspath(root)))

    def local_path(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    # ---------------------------------------------------------------------------------- files
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

    def rename(self, src, dst):
        """Move a file or directory in one atomic step; fails if `dst` exists."""
        d = self.local_path(dst)
        if os.path.exists(d):
            raise FileExistsError(errno.EEXIST, "destination exists", d)
        os.rename(self.local_path(src), d)

    def replace_file(self, src, dst):
        """Move a file over an existing one in one atomic step."""
        os.replace(self.local_path(src), self.local_path(dst))

    def write_atomic(self, path, data, tmp, fsync=True):
        try:
            self.write_bytes(tmp, data, fsync=fsync)
            self.replace_file(tmp, path)
        except BaseException:
            self.remove_file(tmp)
            raise
        if fsync:
            self.fsync_dir(os.path.dirname(path))

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

    # --------------------------------------------------------------------------- engine access
    def engine_path(self, path):
        return self.local_path(path)

    @contextlib.contextmanager
    def engine_outputs(self, directory, rels):
        yield [self.local_path(f"{directory}/{r}") for r in rels]

    # ------------------------------------------------------------------------- commit protocol
    def prepare_for_save(self):
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create the output directory {self.root}: {e.strerror}; "
                                        f"check the path and its permissions", self.root) from e

    def save_target(self, ckpt_id, staging):
        return staging

    def may_hold_uncommitted(self):
        return False   # a checkpoint-named directory appears only by the commit's rename

    def fsync_tree(self, path):
        """fsync every directory under `path` (their entries become durable)."""
        for dirpath, _, _ in os.walk(self.local_path(path)):
            self.fsync_dir(os.path.relpath(dirpath, self.root))

    def commit(self, target, ckpt_id, marker, data, fsync=True):
        self.write_bytes(f"{target}/{marker}", data, fsync=fsync)
        if fsync:
            self.fsync_tree(target)
        dst = self.local_path(ckpt_id)
        try:
            self.rename(target, ckpt_id)  # os.rename fails on a non-empty dst too: a racing commit wins once
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise ConcurrentCommitError(f"checkpoint {dst} was committed by another writer while this save "
                                            f"was writing it; this save's staging directory is discarded, and "
                                            f"the committed checkpoint is the other writer's") from e
            raise
        if fsync:
            self.fsync_dir("")

    def discard(self, target, ckpt_id, marker):
        if os.path.isdir(self.local_path(target)):
            self.remove_tree(target)

    def delete_checkpoint(self, ckpt_id, marker, trash):
        self.rename(ckpt_id, trash)
        self.fsync_dir("")
        self.remove_tree(trash)

    def claim(self, target, owner):
        path = self.local_path(owner)
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # Recovery may have removed the file between our open and flock (it only removes files
                # it holds the lock of); then the lock is on a dead inode: start again.
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                           "target": target}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        return _FlockClaim(fd, path)

    def remove_if_unowned(self, owners, paths):
        fds = []
        try:
            for owner in owners:
                try:
                    fd = os.open(self.local_path(owner), os.O_RDWR)
                except FileNotFoundError:
                    continue  # released meanwhile
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            # No owner file at all: its writer released it or crashed before claiming (a writer claims
            # before it creates anything), so nobody is writing.
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    if os.path.isdir(self.local_path(p)) and not os.path.islink(self.local_path(p)):
                        self.remove_tree(p)
                    else:
                        self.remove_file(p)
            for owner in owners:   # still locked by us: a writer racing to claim sees a dead inode
                self.remove_file(owner)
            return True
        finally:
            for fd in fds:
                os.close(fd)
