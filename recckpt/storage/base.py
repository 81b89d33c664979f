"""The storage interface. Paths are '/'-separated and relative to the storage root.

A store has three parts: files (read, write, list, remove), engine access (where the C++ engine writes
and reads shard files) and the commit protocol. The commit protocol is the store's own: each kind of
store decides where a save writes (`save_target`), how the write becomes visible in one step
(`commit`), how a checkpoint is invalidated and deleted (`delete_checkpoint`), and how a writer proves
it is alive so that start-up recovery never removes what a live process is writing (`claim`,
`remove_if_unowned`). The format layer names the files; the store decides how they are committed.
"""
from __future__ import annotations

import abc
import contextlib
from typing import BinaryIO, Iterator


def fill_from(f: BinaryIO, buf) -> int:
    """readinto() until `buf` is full or the file ends (one call may return less); the bytes read."""
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


class Claim(abc.ABC):
    """A live writer's hold on a save target; `release()` once the save is committed or cleaned up."""

    @abc.abstractmethod
    def release(self) -> None: ...


class Storage(abc.ABC):
    def __init__(self, root: str):
        self.root = root

    def describe(self, path: str = "") -> str:
        """A human-readable location for error messages."""
        return f"{self.root.rstrip('/')}/{path}" if path else self.root

    # ---------------------------------------------------------------------------------- files
    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of a directory; [] when it does not exist. Always what the
        store holds now (never a cached listing), so other processes' commits are seen."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def size(self, path: str) -> int: ...

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of a file (to its end when length is None)."""

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of each (path, start, end); stores that can read ranges concurrently
        override this. Reads exactly the ranges asked for."""
        return [self.read_bytes(p, s, e - s) for p, s, e in ranges]

    #: Whether asking a file's size costs a round trip of its own (object stores): readers then read
    #: a whole small file first and compare its length after, rather than asking for the size before.
    size_is_a_request: bool = False

    def sizes(self, paths: list[str]) -> list[int]:
        """The size of each file (FileNotFoundError for a missing one); stores that can ask
        concurrently override this."""
        return [self.size(p) for p in paths]

    def download(self, pairs: list[tuple[str, str]]) -> None:
        """Files to local files: (store path, local path) pairs, each read whole (one request per file
        where the store can), concurrently where the store can. Stores the engine reads directly
        (`engine_path`) never need this."""
        for p, lp in pairs:
            with open(lp, "wb") as f:
                f.write(self.read_bytes(p))

    def read_into(self, path: str, buf) -> int:
        """Read the start of a file into the writable buffer `buf` (up to its length); returns the bytes
        read. Stores that can read into caller memory override this to skip the copy."""
        data = self.read_bytes(path, 0, len(memoryview(buf).cast("B")))
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    @abc.abstractmethod
    @contextlib.contextmanager
    def open_write(self, path: str, fsync: bool = True) -> Iterator[BinaryIO]:
        """A binary file opened for writing; durable when the context exits normally and fsync is set."""

    def write_bytes(self, path: str, data: bytes, fsync: bool = True) -> None:
        with self.open_write(path, fsync=fsync) as f:
            f.write(data)

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes, tmp: str, fsync: bool = True, owner: str | None = None) -> None:
        """Replace the file `path` with `data` so that a reader sees the old or the new bytes, never a
        mix; `tmp` is a free name the store may use on the way. A store that uses it claims it through
        the claim file `owner` while it exists (see `claim`), so that start-up recovery in another process
        removes it only once abandoned. A directory at `path` is a StorageError naming it (never removed)."""

    @abc.abstractmethod
    def remove_file(self, path: str) -> None:
        """Remove a file; no error if it does not exist."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...

    def entry_kind(self, path: str) -> str | None:
        """What `path` is, links not followed: 'dir', 'file', 'link', 'other' (a FIFO, device, socket) or
        None when absent. Stores without links or special files answer 'dir' or 'file'."""
        if self.isdir(path):
            return "dir"
        return "file" if self.exists(path) else None

    def is_link(self, path: str) -> bool:
        """True when `path` is a symbolic link (stores without links: never)."""
        return False

    def why_not_inside(self, path: str, root: str) -> str | None:
        """None when `path` is a regular file whose real location is inside directory `root`; otherwise
        why not. Stores without links (object stores) have nothing to check."""
        return None

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries durable (no-op where the store has no such notion)."""

    # --------------------------------------------------------------------------- engine access
    def engine_path(self, path: str) -> str | None:
        """An OS path the C++ engine can open for reading `path` directly, or None (then reads go
        through `read_ranges`)."""
        return None

    @abc.abstractmethod
    @contextlib.contextmanager
    def engine_outputs(self, directory: str, rels: list[str]) -> Iterator[list[str]]:
        """Local paths for the engine to write the files `directory/rel`; they are in the store once the
        block exits without an error (stores that cannot be written by the engine upload them then), or,
        inside a `background_uploads` block, once that block exits."""

    @contextlib.contextmanager
    def background_uploads(self) -> Iterator[None]:
        """Within this block, uploads that `engine_outputs` would make as it exits run in the background
        while the block goes on writing other files; the block's exit waits for all of them and raises
        the first failure (after a failure inside the block, it waits and raises that one). Stores the
        engine writes directly have nothing to upload: a plain block."""
        yield

    # ------------------------------------------------------------------------- commit protocol
    @abc.abstractmethod
    def prepare_for_save(self) -> None:
        """Make sure a save can write under the root: create it where creating is harmless (a local
        directory); never create a bucket. Raises StorageError when the root cannot be written."""

    @abc.abstractmethod
    def save_target(self, ckpt_id: str, staging: str) -> str:
        """Where a save of `ckpt_id` writes its files: a staging directory (`staging`, a name the format
        layer reserved) committed by a rename, or the checkpoint's final location itself."""

    @abc.abstractmethod
    def may_hold_uncommitted(self) -> bool:
        """Whether a checkpoint-named directory without its commit marker can be a save's leftover
        (stores that write in place), rather than something a user put there."""

    @abc.abstractmethod
    def commit(self, target: str, ckpt_id: str, marker: str, data: bytes, fsync: bool = True) -> None:
        """Make the fully written `target` visible as checkpoint `ckpt_id` in one step; `marker` (the
        manifest, relative to the checkpoint) with `data` is written last. Fails, committing nothing,
        if `ckpt_id` is committed already."""

    def drop_leftovers(self, target: str, files: set[str], marker: str) -> None:
        """Just before the commit: remove every file under `target` other than `files` (what this save
        wrote, paths relative to `target`) and `marker`, and raise StorageError if one of `files` is
        missing (another process removed it). Stores that write in place can find there the files of an
        earlier cut-short save of the same id (more shard files, another worker count) that recovery
        has not removed; a staging directory is this save's own (nothing to do)."""

    @abc.abstractmethod
    def discard(self, target: str, ckpt_id: str, marker: str) -> None:
        """Remove what a failed save wrote into `target`; never a committed checkpoint."""

    @abc.abstractmethod
    def delete_checkpoint(self, ckpt_id: str, marker: str, trash: str) -> None:
        """Invalidate `ckpt_id` in one step (a reader then sees it absent, never partial), then remove
        its files; `trash` is a free name the store may rename it to first."""

    @contextlib.contextmanager
    def links_lock(self) -> Iterator[None]:
        """Held while an increment's parent is checked and the increment committed, and while retention, prune or delete choose and delete
        checkpoints: so no process commits an increment on a parent another is deleting. A store with no
        lock shared across processes (object stores) holds nothing; there the parent is checked again
        right after the commit, which narrows the race without closing it (docs/SAFETY.md)."""
        yield

    @abc.abstractmethod
    def claim(self, target: str, owner: str) -> Claim:
        """Mark `target` as being written by this live process (one worker of a save), through the file
        `owner` (a name the format layer reserved for this worker). The claim records its holder (host,
        boot id, pid namespace, process), a heartbeat and an expiry (claims.py), renewed until released.
        Raises CheckpointExistsError where another live writer holds it."""

    @abc.abstractmethod
    def remove_if_unowned(self, owners: list[str], paths: list[str]) -> bool:
        """If every claim of `owners` (one per worker writing the target) is provably abandoned
        (claims.abandoned, plus what the store can prove besides): remove `paths` (trees or files, links
        not followed), then the claim files, and return True; otherwise leave everything and return False."""
