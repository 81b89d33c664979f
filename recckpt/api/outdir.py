"""An output directory as a whole: list its checkpoints and leftovers, prune old checkpoints, and
remove what crashed saves left behind (gc). The command-line verbs ls, prune and gc are these."""
from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ..format import catalog, names, recovery
from .policies import CkptEntry, KeepPolicy
from .reader import kind_of, open_output_dir, parent_of, recorded_step


@dataclass(frozen=True)
class CheckpointSummary:
    ckpt_id: str
    path: str
    step: int | None
    kind: str                 # 'full' | 'incremental' | 'ephemeral'
    size_bytes: int
    created: _dt.datetime
    parent: str | None = None


@dataclass
class Listing:
    output_dir: str
    checkpoints: list[CheckpointSummary] = field(default_factory=list)   # oldest first
    leftovers: list[tuple[str, str]] = field(default_factory=list)       # (name, what left it)


def _require_dir(storage) -> None:
    if not storage.isdir(""):
        raise CheckpointNotFoundError(f"{storage.describe()} is not a directory; pass an output directory "
                                      f"(the one given to Saver/CheckpointManager as output_dir)",
                                      path=storage.describe())
    if storage.exists(names.MANIFEST):
        raise InvalidArgumentError(f"{storage.describe()} is one checkpoint, not an output directory; pass "
                                   f"its parent directory")


def _size(storage, ckpt_id: str, m) -> int:
    """Bytes the manifest records plus the shard files on disk (the index holds their sizes, but reading
    a large index only to list checkpoints would make `ls` slow)."""
    total = sum(f.size for f in m.files.values())
    sparse = f"{ckpt_id}/{names.SPARSE_DIR}"
    if m.index is not None and storage.isdir(sparse):
        total += sum(storage.size(f"{sparse}/{n}") for n in storage.listdir(sparse)
                     if names.shard_file_worker(f"{names.SPARSE_DIR}/{n}") is not None)
    return total


def list_checkpoints(output_dir, storage_options: Mapping[str, Any] | None = None) -> Listing:
    """Committed checkpoints of `output_dir` (oldest first) and the leftovers of crashed saves in it."""
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    out = Listing(storage.describe())
    for cid, m in catalog.committed(storage):
        parent = parent_of(m)
        out.checkpoints.append(CheckpointSummary(
            cid, storage.describe(cid), recorded_step(m.metadata, m.worker_steps), kind_of(m.metadata, parent),
            _size(storage, cid, m), _dt.datetime.fromtimestamp(m.created_ns / 1e9, tz=_dt.timezone.utc), parent))
    out.leftovers = recovery.find_leftovers(storage)
    return out


def prune(output_dir, keep: int, *, dry_run: bool = False,
          storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Delete all but the newest `keep` regular checkpoints (the keep policy of a CheckpointManager with
    max_keep=keep: ephemeral ones go unless newest). Each is invalidated before its data is removed.
    Returns the ids deleted (or, with dry_run, that would be)."""
    if type(keep) is not int or keep < 1:
        raise InvalidArgumentError(f"--keep {keep!r}: expected an integer >= 1 (the newest checkpoint is "
                                   f"always kept)")
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    found = catalog.committed(storage)
    entries = [CkptEntry.from_metadata(cid, m.metadata) for cid, m in found]
    # never a link that a kept incremental checkpoint's chain needs (docs/INCREMENTAL.md)
    doomed = catalog.without_needed_links(found, KeepPolicy(max_keep=keep).doomed(entries))
    if dry_run:
        return doomed
    for cid in doomed:
        catalog.delete(storage, cid)
    catalog.sync_version_file(storage)
    return doomed


def gc(output_dir, *, dry_run: bool = False, storage_options: Mapping[str, Any] | None = None
       ) -> list[tuple[str, str]]:
    """Remove the leftovers of crashed saves and deletes (staging and half-deleted directories, temporary
    version files) and bring the version file in line, through the same recovery a save runs at start.
    Returns (name, what left it) for each thing removed (or, with dry_run, found)."""
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    found = recovery.find_leftovers(storage)
    if dry_run:
        return found
    removed = set(recovery.recover(storage))
    return [(n, w) for n, w in found if n in removed]


__all__ = ["CheckpointSummary", "Listing", "gc", "list_checkpoints", "prune"]
