"""An output directory as a whole: list its checkpoints and leftovers, prune old checkpoints, delete
named ones, and remove what crashed saves left behind (gc). The command-line verbs ls, prune and gc
are these."""
from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidArgumentError, StorageError, raw_os_errors_named
from ..format import catalog, names, recovery
from ..format.retention import CkptEntry, KeepPolicy
from .reader import kind_of, open_output_dir, parent_of

log = logging.getLogger("recckpt")


@dataclass(frozen=True)
class CheckpointSummary:
    ckpt_id: str
    path: str
    step: int | None
    kind: str                 # 'full' | 'incremental' | 'ephemeral'
    size_bytes: int
    created: _dt.datetime
    parent: str | None = None
    compacted_from: str | None = None   # the checkpoint a compaction folded into this one


@dataclass
class Listing:
    output_dir: str
    checkpoints: list[CheckpointSummary] = field(default_factory=list)   # oldest first
    leftovers: list[tuple[str, str]] = field(default_factory=list)       # (name, what left it)
    strays: list[tuple[str, str]] = field(default_factory=list)          # (name, why recckpt leaves it alone)
    damaged: list[tuple[str, str]] = field(default_factory=list)
    """(name, why): checkpoint directories whose manifest does not verify. Not committed (never loaded or
    restored), but their ids stay taken until `recckpt.delete` removes them."""
    broken: list[tuple[str, str]] = field(default_factory=list)
    """(id, why): committed incremental checkpoints (also in `checkpoints`) that cannot be loaded, since a
    link of their chain is not a committed checkpoint."""
    unfound: list[tuple[str, str]] = field(default_factory=list)
    """(id, what is there): ids the version file lists that are not committed checkpoints, nor damaged,
    leftovers or strays (a directory replaced by a file, a manifest deleted by hand)."""
    output_dirs_below: list[str] = field(default_factory=list)
    """When this directory holds no checkpoint: output directories found below it (a user who passed
    the run's folder instead of its output_dir), as paths relative to it."""


#: How far `ls` looks below a directory without checkpoints for output directories: levels, and
#: directories listed in all (each a request on an object store).
SEARCH_DEPTH, SEARCH_DIRS = 3, 200


def _holds_checkpoints(storage, path: str, entries: list[str]) -> bool:
    """Whether directory `path` (listing `entries`) looks like an output directory: a version file, or a
    committed checkpoint directory (one with a manifest) in it."""
    if names.VERSION_FILE in entries:
        return True
    return any(not e.startswith(".") and storage.exists(f"{path}/{e}/{names.MANIFEST}") for e in entries)


def output_dirs_below(storage, depth: int = SEARCH_DEPTH, budget: int = SEARCH_DIRS) -> list[str]:
    """Output directories below the root of `storage` (breadth first, at most `depth` levels and `budget`
    directories listed); paths relative to the root."""
    found, level, listed = [], [""], 0
    for _ in range(depth):
        nxt = []
        for d in level:
            for e in storage.listdir(d):
                if e.startswith(".") or e == names.VERSION_FILE:
                    continue
                path = f"{d}/{e}" if d else e
                if listed >= budget or not storage.isdir(path):
                    continue
                listed += 1
                entries = storage.listdir(path)
                if _holds_checkpoints(storage, path, entries):
                    found.append(path)
                else:
                    nxt.append(path)
        level = nxt
    return sorted(found)


def _require_dir(storage, top: list[str] | None = None) -> None:
    """An output directory: not missing, not one checkpoint. `top`: its listing, when already made (then a
    non-empty one answers the first question without another request)."""
    if not top and not storage.isdir(""):
        if storage.size_is_a_request:
            # an object store has no empty directories: an existing bucket with nothing under the prefix is a
            # run that has not saved yet (as restore() takes it), and a missing bucket raised when listed
            return
        raise CheckpointNotFoundError(f"{storage.describe()} is not a directory; pass an output directory "
                                      f"(the one given to Saver/CheckpointManager as output_dir)",
                                      path=storage.describe())
    if (names.MANIFEST in top) if top is not None else storage.exists(names.MANIFEST):
        raise InvalidArgumentError(f"{storage.describe()} is one checkpoint, not an output directory; pass "
                                   f"its parent directory")


def _size(storage, ckpt_id: str, entry) -> int:
    """Bytes the catalog records (from the manifest); for a checkpoint written before manifests recorded
    their shard bytes, the manifest's files plus the shard files on disk (the index holds their sizes,
    but reading a large index only to list checkpoints would make `ls` slow)."""
    if entry.size_bytes is not None:
        return entry.size_bytes
    m = catalog.read_manifest(storage, ckpt_id)
    total = sum(f.size for f in m.files.values())
    sparse = f"{ckpt_id}/{names.SPARSE_DIR}"
    if m.index is not None and storage.isdir(sparse):
        total += sum(storage.size(f"{sparse}/{n}") for n in storage.listdir(sparse)
                     if names.shard_file_worker(f"{names.SPARSE_DIR}/{n}") is not None)
    return total


def list_checkpoints(output_dir, storage_options: Mapping[str, Any] | None = None, *, check: bool = False
                     ) -> Listing:
    """Committed checkpoints of `output_dir` (oldest first) and the leftovers of crashed saves in it.
    From the catalog (no manifest read a checkpoint; on an object store the newest one is checked against
    its manifest and the rest trusted); `check=True` reads every manifest, so that one deleted by hand
    shows as unfound there too (a request a checkpoint)."""
    storage = open_output_dir(output_dir, storage_options)
    # one listing, for the checkpoints, the leftovers and the checks; the catalog (no manifest read per
    # checkpoint) is read while it runs
    found, top = catalog.committed_and_top(storage, check_top=lambda top: _require_dir(storage, top),
                                           trust_catalog=not check)
    out = Listing(storage.describe())
    for cid, e in found:
        parent = parent_of(e)
        out.checkpoints.append(CheckpointSummary(
            cid, storage.describe(cid), e.step, kind_of(e.metadata, parent), _size(storage, cid, e),
            _dt.datetime.fromtimestamp(e.created_ns / 1e9, tz=_dt.timezone.utc), parent, e.compacted_from))
    committed_ids = {cid for cid, _ in found}   # committed: neither leftovers nor strays (no request per name)
    out.leftovers = recovery.find_leftovers(storage, keep=committed_ids, top=top)
    out.strays = recovery.find_strays(storage, keep=committed_ids, top=top)
    taken = committed_ids | {name for name, _ in out.leftovers} | {name for name, _ in out.strays}
    out.damaged = catalog.damaged(storage, top, taken)
    out.broken = catalog.broken_chains(found)
    listed = catalog.read_version_file(storage)
    accounted = taken | {name for name, _ in out.damaged}
    top_names = set(top)
    for i in listed or []:
        if i not in accounted:
            out.unfound.append((i, "nothing" if i not in top_names else
                                "a file, not a checkpoint directory" if not storage.isdir(i) else
                                f"a directory without {names.MANIFEST}"))
    if not out.checkpoints and listed is None:
        out.output_dirs_below = output_dirs_below(storage)
    return out


@raw_os_errors_named("prune")
def prune(output_dir, keep: int, *, dry_run: bool = False,
          storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Delete all but the newest `keep` regular checkpoints (the keep policy of a CheckpointManager with
    max_keep=keep: ephemeral ones go unless newest). Each is invalidated before its data is removed.
    Returns the ids deleted (or, with dry_run, that would be)."""
    if type(keep) is not int or keep < 1:
        raise InvalidArgumentError(f"prune: keep={keep!r}, expected an integer >= 1 (the newest checkpoint is "
                                   f"always kept)")
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    found = catalog.committed(storage)
    entries = [CkptEntry.from_metadata(cid, m.metadata, m.worker_steps) for cid, m in found]
    # never a link that a kept incremental checkpoint's chain needs (docs/INCREMENTAL.md)
    doomed = catalog.without_needed_links(found, KeepPolicy(max_keep=keep).doomed(entries))
    if dry_run:
        return doomed
    with catalog.links_lock(storage, bool(doomed)):
        doomed = catalog.unneeded_now(storage, found, doomed)   # a job may have committed on one meanwhile
        deleted = catalog.retire(storage, [cid for cid, _ in found if cid not in doomed], doomed,
                                 entries=dict(found))
    left = [cid for cid in doomed if cid not in deleted]
    if left:
        raise StorageError(f"prune: deleted {deleted}, but could not delete {left} of {storage.describe()} (the "
                           f"warnings above say why; a link of a checkpoint that stayed is kept with it). Every "
                           f"checkpoint listed is still loadable; fix the cause and prune again",
                           path=storage.describe(left[0]))
    return deleted


@raw_os_errors_named("delete")
def delete(output_dir, ckpt_ids: str | list[str], *, storage_options: Mapping[str, Any] | None = None
           ) -> list[str]:
    """Delete the named committed checkpoints of `output_dir`, e.g. newer ones that a run rewound past
    (`CheckpointManager.restore` after a corrupt newest checkpoint, or an explicit older step) will
    reach again. The version file is rewritten first, then each is invalidated before its data is
    removed (docs/SAFETY.md). Refuses, before deleting anything, an id that is not committed, and a
    link that a checkpoint not being deleted depends on (delete its dependents too). A checkpoint
    directory whose manifest does not verify (`Listing.damaged`: never loaded, but its id stays taken) is
    deleted too. Do not delete a checkpoint that another process may be loading. Returns the ids deleted."""
    ids = [ckpt_ids] if isinstance(ckpt_ids, str) else list(ckpt_ids)
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    with catalog.links_lock(storage):   # no increment commits on one of them meanwhile
        found = catalog.committed(storage)
        committed = [cid for cid, _ in found]
        unknown = [cid for cid in ids if cid not in committed]
        broken = dict(catalog.damaged(storage, unknown, set())) if unknown else {}
        unknown = [cid for cid in unknown if cid not in broken]
        if unknown:
            raise CheckpointNotFoundError(f"delete: {[storage.describe(c) for c in unknown]} not committed checkpoints "
                                          f"of {storage.describe()}; committed: {committed}",
                                          path=storage.describe(unknown[0]))
        needed = sorted(set(ids) - set(catalog.without_needed_links(found, ids)))
        if needed:
            dependents = [cid for cid, m in found if m.parent is not None and m.parent.ckpt_id in needed
                          and cid not in ids]
            raise InvalidArgumentError(f"delete: {needed} are links of incremental checkpoints {dependents} that are "
                                       f"not being deleted; delete those too, or compact them first "
                                       f"(recckpt.compact)", path=storage.describe(needed[0]))
        deleted = catalog.retire(storage, [cid for cid in committed if cid not in ids],
                                 [cid for cid in committed if cid in ids], entries=dict(found))   # committed order
        for cid in broken:   # not committed: nothing depends on them and no listing names them
            log.info("recckpt: deleting %s (its manifest does not verify: %s)", storage.describe(cid), broken[cid])
            catalog.delete(storage, cid)
            deleted.append(cid)
        return deleted


@raw_os_errors_named("gc")
def gc(output_dir, *, dry_run: bool = False, storage_options: Mapping[str, Any] | None = None
       ) -> list[tuple[str, str]]:
    """Remove the leftovers of crashed saves and deletes (staging and half-deleted directories, temporary
    version files) and bring the version file in line, through the same recovery a save runs at start.
    Returns (name, what left it) for each thing removed (or, with dry_run, found). Entries it must not
    or cannot remove (named like leftovers but of another kind, links, a version file that is a
    directory, a removal that fails) are skipped with a warning naming each (`recckpt` logger)."""
    storage = open_output_dir(output_dir, storage_options)
    _require_dir(storage)
    found = recovery.find_leftovers(storage)
    if dry_run:
        for name, why in recovery.find_strays(storage):
            log.warning("recckpt: would leave %s alone: %s", storage.describe(name), why)
        return found
    removed = set(recovery.recover(storage, rebuild_catalog=True).removed)
    return [(n, w) for n, w in found if n in removed]


__all__ = ["CheckpointSummary", "Listing", "gc", "list_checkpoints", "prune", "output_dirs_below"]
