"""Local disk: the fast path. The C++ engine writes and reads these files directly.

Commit protocol: a save writes into a staging directory, fsyncs it, and renames it to the checkpoint's
name (one atomic step); a delete renames the checkpoint away first. A writer holds an flock on its
owner file for as long as its staging directory (or temporary version file) exists, and the file holds
its claim (claims.py: host, boot id, heartbeat, expiry), rewritten every lease / 3. Recovery in another
process removes a target only when it can take every owner's lock AND the claim is provably abandoned
(its process exited on this machine, or its lease expired): a lock alone proves nothing where locks are
not shared between hosts (some NFS mounts), a dead pid proves nothing about another host's process.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat

from ..errors import ConcurrentCommitError, StorageError
from . import claims
from .base import Claim, Storage, fill_from
from .regular import open_regular, read_regular, regular_size

log = logging.getLogger("recckpt")

_BODY_BYTES = 1024          # claim bodies are padded to this: a rewrite never leaves a shorter file
_MAX_BODY_BYTES = 1 << 16   # what recovery reads of an owner file


def _write_body(fd: int, body: dict) -> None:
    data = claims.encode(body).ljust(_BODY_BYTES)
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class _FlockClaim(Claim):
    def __init__(self, fd: int, path: str, body: dict, lease_s: float):
        self.fd, self.path = fd, path
        self._beat = claims.Heartbeat(lambda b: _write_body(fd, b), body, lease_s, os.path.basename(path))

    def release(self) -> None:
        if self.fd < 0:
            return
        self._beat.stop()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)   # removed while still locked: recovery never sees it free and present
        os.close(self.fd)
        self.fd = -1


_no_lock_warned: set = set()


def _warn_no_links_lock(root: str, e: OSError) -> None:
    if root not in _no_lock_warned:
        _no_lock_warned.add(root)
        log.warning("recckpt: %s cannot be locked (%s); increments and deletes by other processes in it are "
                    "checked against each other without a lock", root, e)


class LocalStorage(Storage):
    def __init__(self, root: str, lease_s: float = claims.LEASE_S):
        super().__init__(os.path.abspath(os.fspath(root)))
        self.lease_s = lease_s

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
            if not path:
                self._check_root()
            return []

    def _check_root(self) -> None:
        """A root that exists as something else than a directory is an error, not an empty output
        directory: a restore would start training over beside it, and a save fail with 'File exists'."""
        root = self.root
        if os.path.isdir(root):
            return
        # the nearest part of the path that exists: a file on the way ("afile/run") blocks it as surely
        there = root
        while not os.path.lexists(there) and os.path.dirname(there) != there:
            there = os.path.dirname(there)
        if os.path.isdir(there):
            return   # missing below a directory: a save creates it
        if os.path.islink(there):
            target = os.readlink(there)
            what = f"a link to {target!r}, which " + ("is not a directory" if os.path.exists(there) else "does not exist")
        else:
            what = "a file, not a directory"
        at = "" if there == root else f" ({there}, on its path)"
        raise StorageError(errno.ENOTDIR, f"the output directory {root} cannot be one{at}: "
                                          f"{there if there != root else 'it'} is {what}; pass a directory (or a "
                                          f"path that does not exist yet below one, which a save creates)", root)

    def makedirs(self, path):
        p = self.local_path(path)
        try:
            os.makedirs(p, exist_ok=True)
        except OSError as e:
            # e.g. a link loop or a file on the way: name the path, not a raw OSError
            at = "" if e.filename in (None, p) else f" (at {e.filename})"
            raise StorageError(e.errno, f"cannot create directory {p}: {e.strerror}{at}; check that every part "
                                        f"of the path is a directory you can write", path=p) from e

    def entry_kind(self, path):
        try:
            mode = os.lstat(self.local_path(path)).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else
                "file" if stat.S_ISREG(mode) else "other")

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

    def write_atomic(self, path, data, tmp, fsync=True, owner=None):
        if os.path.isdir(self.local_path(path)) and not os.path.islink(self.local_path(path)):
            # os.replace cannot put a file over a directory, and a directory here is not ours to remove
            raise StorageError(errno.EISDIR, f"{self.local_path(path)} is a directory, where recckpt keeps a "
                                             f"file; nothing removes it for you: move it away (mv or rm -r), and "
                                             f"the next save writes the file", path=self.local_path(path))
        claim = self.claim(tmp, owner) if owner is not None else None
        try:
            try:
                self.write_bytes(tmp, data, fsync=fsync)
                self.replace_file(tmp, path)
            except BaseException:
                self.remove_file(tmp)
                raise
        finally:
            if claim is not None:
                claim.release()
        if fsync:
            self.fsync_dir(os.path.dirname(path))

    def remove_file(self, path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.local_path(path))

    def remove_tree(self, path):
        def gone_meanwhile(func, p, exc_info):
            # Another process removing the same tree (a delete's trash, finished by recovery elsewhere)
            # is no error: both want it gone.
            if not isinstance(exc_info[1], FileNotFoundError):
                raise exc_info[1]
        shutil.rmtree(self.local_path(path), onerror=gone_meanwhile)

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
        if self._plain_below(path, root):
            return None
        real_root = os.path.realpath(self.local_path(root))
        real = os.path.realpath(p)
        if os.path.commonpath([real, real_root]) != real_root:
            return f"resolves to {real}, outside the checkpoint"
        return None

    def _plain_below(self, path: str, root: str) -> bool:
        """True when `path` is `root` followed by plain names (no '.', '..' or empty part) none of whose
        directories is a link: then it is inside `root` without resolving either (two realpaths per file
        were a tenth of opening a long chain's links). Anything else takes the full check."""
        prefix = f"{root}/" if root else ""
        if not path.startswith(prefix):
            return False
        parts = path[len(prefix):].split("/")
        if any(c in ("", ".", "..") for c in parts):
            return False
        d = self.local_path(root)
        for c in parts[:-1]:
            d = os.path.join(d, c)
            if not stat.S_ISDIR(os.lstat(d).st_mode):   # a link (or anything odd) on the way
                return False
        return True

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
        self._check_root()
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

    @contextlib.contextmanager
    def links_lock(self):
        # flock on the output directory itself (no file of its own to leave behind); the kernel releases
        # it when the holder dies, so a killed process never leaves it held.
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise StorageError(e.errno, f"cannot open the output directory {self.root} to lock it: "
                                        f"{e.strerror}", self.root) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                # Some network file systems emulate flock with record locks, which a directory opened
                # read-only cannot take (EBADF), or offer none: then this store has no lock, like an
                # object store, and the checks around it still narrow the race (docs/SAFETY.md).
                _warn_no_links_lock(self.root, e)
            yield
        finally:
            os.close(fd)

    def claim(self, target, owner):
        path = self.local_path(owner)
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # Recovery may have removed the file between our open and flock (it only removes files
                # it holds the lock of); then the lock is on a dead inode: start again.
                locked = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                locked = False
            except BaseException:
                os.close(fd)
                raise
            if not locked:
                os.close(fd)
                continue
            body = claims.body(target, self.lease_s)
            try:
                _write_body(fd, body)
                # Recovery on a host that does not share our locks may have taken an empty claim for a
                # dead writer's and removed it before the body was written: then claim again.
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return _FlockClaim(fd, path, body, self.lease_s)
            except FileNotFoundError:
                pass
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(path)
                os.close(fd)
                raise
            os.close(fd)

    def _why_abandoned(self, fd: int) -> str | None:
        """With the owner file's lock held: why its claim is abandoned, or None if it may be alive."""
        body = claims.decode(os.pread(fd, _MAX_BODY_BYTES, 0))
        if body is None:
            # A writer writes its claim right after locking it, before it creates anything: with the lock
            # free and no claim written, it stopped while claiming.
            return "its claim was never written (its writer stopped while claiming)"
        return claims.abandoned(body, self.lease_s, written_at=os.fstat(fd).st_mtime)

    def remove_if_unowned(self, owners, paths):
        fds = []
        try:
            for owner in owners:
                try:
                    fd = os.open(self.local_path(owner), os.O_RDWR | os.O_NOFOLLOW)
                except FileNotFoundError:
                    continue  # released meanwhile
                except OSError:
                    return False   # a link or something unreadable where a claim should be: keep
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                # Lock taken: its holder is gone if it shared our locks, but a process on another host
                # whose locks we do not see may still be writing; its claim decides.
                if self._why_abandoned(fd) is None:
                    return False
            # No owner file at all: its writer released it or crashed before claiming (a writer claims
            # before it creates anything), so nobody is writing.
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    if self.entry_kind(p) == "dir":
                        self.remove_tree(p)
                    else:
                        self.remove_file(p)
            for owner in owners:   # still locked by us: a writer racing to claim sees a dead inode
                self.remove_file(owner)
            return True
        finally:
            for fd in fds:
                os.close(fd)
