"""The errors recckpt raises. Each message says what failed, where (file, table, rank) and what to do.

Every public error class lives here (docs/SAFETY.md lists them; a test keeps the two in step). Every
class derives from RecckptError and from the builtin a caller would otherwise catch
(FileNotFoundError, ValueError, ...), so existing `except` clauses keep working. Besides the message,
each error carries the structured fields `path`, `table` and `rank` (None where the raise site did
not know them), so a caller can act on where it failed without parsing the text.
"""
from __future__ import annotations


class RecckptError(Exception):
    """Base class of every error raised on purpose by recckpt.

    Attributes:
        path: the file or checkpoint directory concerned, or None.
        table: the sparse table concerned, or None.
        rank: the worker (shard) concerned, or None.
    """

    def __init__(self, message: str = "", *, path: str | None = None, table: str | None = None,
                 rank: int | None = None):
        super().__init__(message)
        self.path, self.table, self.rank = path, table, rank

    def fields(self) -> dict:
        """The structured fields, for re-raising with a longer message: `type(e)(msg, **e.fields())`."""
        return {"path": self.path, "table": self.table, "rank": self.rank}

    def retold(self, message: str) -> "RecckptError":
        """The same error (class and fields) with a new message: for adding context while re-raising."""
        return type(self)(message, **self.fields())


class CheckpointNotFoundError(RecckptError, FileNotFoundError):
    """No committed checkpoint where one was asked for (missing directory, empty version file, unknown id)."""


class CorruptCheckpointError(RecckptError):
    """A checkpoint's bytes do not match what was written: a checksum mismatch, a truncated file, or a
    header/index that fails structural validation. The message names the file (and table when known).
    `path` may also be given positionally, as before the fields moved to RecckptError."""

    def __init__(self, message: str = "", path: str | None = None, *, table: str | None = None,
                 rank: int | None = None):
        super().__init__(message, path=path, table=table, rank=rank)


class IncompatibleCheckpointError(RecckptError, ValueError):
    """The checkpoint is intact but cannot be applied: unknown format version, shape or dtype mismatch,
    missing tables or keys under strict loading."""


class CheckpointSaveError(RecckptError):
    """A save failed. Earlier checkpoints are untouched and nothing partial was committed."""


class CommitOutcomeUnknownError(CheckpointSaveError):
    """A worker of a distributed save handed its part to the committing worker (rank 0), then could not
    learn whether the commit happened (rank 0 failed or stopped responding), and the checkpoint is not
    visible from this worker. Rank 0 may have committed it since, may still commit it, or may have
    failed; a commit is one step (docs/SAFETY.md), so the checkpoint is complete or absent, never
    partial. List the checkpoints later to find out."""


class CheckpointExistsError(CheckpointSaveError, FileExistsError):
    """A committed checkpoint with this id already exists; committed checkpoints are never overwritten."""


class InvalidCheckpointIdError(RecckptError, ValueError):
    """A checkpoint id that cannot name a directory safely (empty, '/', '..', NUL, ...)."""


class LoadConfigError(RecckptError, ValueError):
    """A load configuration that cannot be valid (unknown key or category, wrong type)."""


class CoordinationError(RecckptError):
    """A collective on recckpt's coordination group failed or timed out: another rank failed, exited
    or stopped responding; or the ranks disagree on what they see (a restore whose ranks find different
    checkpoints under one name: an output directory that is not shared). The message names this rank
    and the step of the protocol. `rank` may also
    be given positionally."""

    def __init__(self, message: str = "", rank: int | None = None, *, path: str | None = None,
                 table: str | None = None):
        super().__init__(message, path=path, table=table, rank=rank)


class ConcurrentCommitError(CheckpointExistsError):
    """Another writer committed this checkpoint id while this save was writing it. This save's data
    was discarded; the committed checkpoint on disk is the other writer's, complete and loadable."""


class InvalidArgumentError(RecckptError, ValueError, TypeError):
    """An argument that cannot be valid for this checkpoint or call: a bad option value or type (Saver,
    CheckpointManager, policies, options, tables, reader, export and command-line tool), an unknown table,
    slot or registered name. The message names the argument and the valid choices. It is both a
    ValueError and a TypeError, so code written against Python's conventions keeps catching it."""


class StorageError(RecckptError, OSError):
    """A store refused or failed an operation (an object-store request that failed after its retries, a
    missing bucket, wrong credentials, a timeout). The message names the object and the operation.
    Also built like an OSError, `StorageError(errno, message, path)`, so `.errno` says what kind of failure."""

    def __init__(self, *args, path: str | None = None, table: str | None = None, rank: int | None = None):
        if len(args) >= 2 and isinstance(args[0], int):   # (errno, message[, path])
            OSError.__init__(self, *args[:3])
            path = args[2] if len(args) > 2 and path is None else path
        else:
            OSError.__init__(self, *args)
        self.path, self.table, self.rank = path, table, rank

    def retold(self, message: str) -> "StorageError":
        out = StorageError(self.errno, message, path=self.path, table=self.table, rank=self.rank) \
            if self.errno is not None else StorageError(message, path=self.path, table=self.table, rank=self.rank)
        return out


class CheckpointDeletedError(CheckpointNotFoundError):
    """The checkpoint being loaded was deleted (by retention in another process) while it was read.
    Nothing was applied to the model; load again (the newest checkpoint) to recover."""


class StorageURLError(RecckptError, ValueError):
    """An output directory or checkpoint location that names no usable store: empty, or a URL whose
    protocol fsspec does not know (or whose driver package is missing)."""


class LoadApplyError(RecckptError):
    """A load failed part-way through changing the model for a reason other than the checkpoint's bytes
    (out of memory, a table refusing rows). The message says exactly what was applied before it."""


class MissingDependencyError(RecckptError, ImportError):
    """An optional integration was asked for and its library is missing or of an untested version (e.g.
    TorchRec): the message names the extra and the install script."""


class DuplicateIdsError(IncompatibleCheckpointError):
    """The same id is stored by more than one worker of a checkpoint and the duplicate rule could not
    pick one copy."""


class AsyncSaveError(CheckpointSaveError):
    """A save that was written in the background failed. Earlier checkpoints are intact."""


class AsyncCommitOutcomeUnknownError(AsyncSaveError, CommitOutcomeUnknownError):
    """The background write of a distributed async save handed its part to rank 0 and never learned
    whether rank 0 committed it (see CommitOutcomeUnknownError)."""


def os_error_hint(e: BaseException | None, retry: str = "save again") -> str:
    """What to do about the storage error behind a failure (the first OSError in `e`'s chain), if it is one
    recckpt can name; `retry`: what to do once it is fixed."""
    import errno
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    if e is None:
        return ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f" The disk or quota is full: free space (or lower max_keep) and {retry}."
    if e.errno == errno.EIO:
        return f" The storage reported an I/O error: check the device, mount or endpoint, then {retry}."
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f" The output directory is not writable: fix its permissions or mount, then {retry}."
    return ""


def raw_os_errors_named(op: str):
    """Decorator of a public tool (prune, delete, gc, compact, export): an OSError that is not a recckpt
    error already (a version file that cannot be written into a read-only directory, ...) is raised as a
    StorageError naming the operation, the file and what to do. The tool's signature is unchanged."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OSError as e:
                if isinstance(e, RecckptError):
                    raise
                where = f" at {e.filename}" if getattr(e, "filename", None) else ""
                raise StorageError(e.errno, f"{op} failed{where}: {e.strerror or e}."
                                            f"{os_error_hint(e, op + ' again')}", path=e.filename) from e
        return run
    return wrap
