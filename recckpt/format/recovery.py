"""Start-up recovery of an output directory: what a killed save or delete can leave behind, and putting
the version file back in line with the committed checkpoints.

A save killed at any moment leaves at most: its save target (a `.staging-*` directory on stores that
commit by rename; a manifest-less `<ckpt_id>/` on stores that write in place), the writers' claims
(`.owner-*`), a `.deleting-*` directory (during retention), a `.checkpoint.tmp-*` file (while the version
file was being replaced), and a stale version file. None of these is ever read as a checkpoint.

Other processes may be saving, compacting or rewriting the version file in the same directory right now
(a job restarted while its old instance still writes, two jobs sharing a directory). Every save target
and temporary version file is covered by its writer's claim, and `recover` removes one only when every
claim on it is provably abandoned (storage.Storage.remove_if_unowned, storage/claims.py). A `.deleting-*`
directory is a checkpoint already invalidated: any process may finish removing it. `keep` names targets
of the save that is starting (its other workers may not have claimed yet).

One bad entry never stops a directory: an entry named like ours but of another kind (a file or a link
named `.deleting-x`, a directory named `.checkpoint.tmp-x`) is not ours and is left alone, links are
never followed, and an entry that cannot be removed is skipped; each is reported (`Recovered.skipped`,
and a warning) and the rest goes on.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from ..errors import InvalidCheckpointIdError
from ..storage import Storage
from . import catalog, names

log = logging.getLogger("recckpt")

# Everything a writer puts at the top of a checkpoint directory. A directory holding only these names and
# no manifest is an uncommitted checkpoint of ours; anything else might be the user's and is left alone.
_OWN_ENTRIES = frozenset({names.MANIFEST, names.INDEX, names.DENSE, names.EXTRAS, names.SPARSE_DIR,
                          names.IO_STATE_DIR})


def _uncommitted_leftover(storage: Storage, name: str) -> bool:
    if not storage.may_hold_uncommitted():
        return False
    try:
        names.validate_ckpt_id(name)
    except InvalidCheckpointIdError:
        return False
    if not storage.isdir(name) or catalog.is_committed(storage, name):
        return False
    return set(storage.listdir(name)) <= _OWN_ENTRIES


def _owners(listing: list[str], target: str) -> list[str]:
    prefix = names.owner_target_prefix(target)
    return [n for n in listing if n.startswith(prefix)]


def remove_target_if_unowned(storage: Storage, target: str, listing: list[str] | None = None) -> bool:
    """Remove a save target (and its claims) unless a live writer holds it; True if removed. `listing`
    must be taken after `target` was seen (a writer claims before it creates its target, so the claim is
    in any listing taken later, until released)."""
    listing = storage.listdir("") if listing is None else listing
    return storage.remove_if_unowned(_owners(listing, target), [target])


#: What each kind of leftover is (the kind of entry its writer creates), by name.
_TARGET, _TRASH, _VERSION_TMP, _CATALOG_TMP, _OWNER = "target", "trash", "version_tmp", "catalog_tmp", "owner"
_EXPECTED_KIND = {_TARGET: "dir", _TRASH: "dir", _VERSION_TMP: "file", _CATALOG_TMP: "file", _OWNER: "file"}
_LEFT_BY = {
    _TARGET: "an interrupted save (or one still running: removed only when no live process claims it)",
    _TRASH: "an interrupted delete",
    _VERSION_TMP: "an interrupted version-file update (or one still running: removed only when abandoned)",
    _CATALOG_TMP: "an interrupted catalog update (or one still running: removed only when abandoned)",
    _OWNER: "a writer's claim (removed only when its writer is gone)",
}


def _classify(storage: Storage, name: str) -> str | None:
    if name.startswith(names.STAGING_PREFIX):
        return _TARGET
    if name.startswith(names.TRASH_PREFIX):
        return _TRASH
    if name.startswith(names.VERSION_TMP_PREFIX):
        return _VERSION_TMP
    if name.startswith(names.CATALOG_TMP_PREFIX):
        return _CATALOG_TMP
    if name.startswith(names.OWNER_PREFIX):
        return _OWNER
    if _uncommitted_leftover(storage, name):
        return _TARGET
    return None


def _stray(storage: Storage, name: str, what: str) -> str | None:
    """Why an entry named like a leftover is not one of ours (None when it is of the kind we create)."""
    kind = storage.entry_kind(name)
    want = _EXPECTED_KIND[what]
    if kind is None or kind == want:
        return None
    shown = {"link": "a symbolic link", "dir": "a directory", "file": "a file"}.get(kind, "a special file")
    return (f"is {shown}, where recckpt leaves {'a directory' if want == 'dir' else 'a file'}: not recckpt's, "
            f"left alone (remove it yourself if it is not needed)")


@dataclass
class Recovered:
    removed: list[str] = field(default_factory=list)                 # names removed
    skipped: list[tuple[str, str]] = field(default_factory=list)     # (name, why) left alone


def find_leftovers(storage: Storage, keep: Collection[str] = (), top: list[str] | None = None
                   ) -> list[tuple[str, str]]:
    """(name, what left it) for each top-level entry of `storage` that `recover` would remove, were its
    writer dead: a save target that a live process still claims is listed too (`recover` keeps it).
    `top`: the top-level names, when the caller has listed them already."""
    found = []
    for name in storage.listdir("") if top is None else top:
        what = None if name in keep else _classify(storage, name)
        if what is not None and _stray(storage, name, what) is None:
            found.append((name, _LEFT_BY[what]))
    return found


def find_strays(storage: Storage, keep: Collection[str] = (), top: list[str] | None = None
                ) -> list[tuple[str, str]]:
    """(name, why) for entries named like recckpt's own that recckpt must not touch, and a version file
    that is not a regular file. `keep`: names known not to be (committed checkpoints); `top`: the
    top-level names, when the caller has listed them already."""
    out = []
    for name in storage.listdir("") if top is None else top:
        what = None if name in keep else _classify(storage, name)
        why = None if what is None else _stray(storage, name, what)
        if why is not None:
            out.append((name, why))
    kind = storage.entry_kind(names.VERSION_FILE)
    if kind not in (None, "file"):
        out.append((names.VERSION_FILE, f"the version file is a {kind}, not a regular file: recckpt cannot "
                                        f"replace it; move it away and the next save writes it"))
    return out


def _skip(out: Recovered, storage: Storage, name: str, why: str) -> None:
    log.warning("recckpt: left %s alone: %s", storage.describe(name), why)
    out.skipped.append((name, why))


def recover(storage: Storage, keep: Collection[str] = (), fsync: bool = True, rebuild_catalog: bool = False
            ) -> Recovered:
    """Remove what interrupted saves and deletes left in `storage` (except the targets in `keep` and
    those a live writer holds) and rewrite the version file and the catalog if they are missing, garbled
    or stale (`rebuild_catalog`: the catalog from every manifest, trusting none of it). Entries that are
    not ours or cannot be removed are skipped and reported; nothing here raises for one entry."""
    out = Recovered()
    listing = storage.listdir("")
    found = [(n, w) for n, w in ((n, None if n in keep else _classify(storage, n)) for n in listing)
             if w is not None]
    owners_listing = storage.listdir("")   # after the targets were seen: see remove_target_if_unowned
    for name, what in found:
        why = _stray(storage, name, what)
        if why is not None:
            _skip(out, storage, name, why)
            continue
        try:
            if what in (_TARGET, _VERSION_TMP, _CATALOG_TMP):
                if what == _TARGET and not name.startswith(names.STAGING_PREFIX) and \
                        not _uncommitted_leftover(storage, name):
                    # Committed in place since it was classified: its writer released the claim only after
                    # the commit, so the owners listing above cannot show it. Look again before removing.
                    continue
                if not remove_target_if_unowned(storage, name, owners_listing):
                    log.info("recckpt: leaving %s alone: a live process is writing it", storage.describe(name))
                    continue
            elif what == _TRASH:
                storage.remove_tree(name)
            else:
                # Claims no live writer holds (their writer died before creating its target, or after
                # committing it but before releasing): removing one is never harmful, a writer racing to
                # claim re-creates it.
                if any(name.startswith(names.owner_target_prefix(t)) for t in keep):
                    continue
                if storage.exists(name) and storage.remove_if_unowned([name], []):
                    out.removed.append(name)
                continue
        except FileNotFoundError:
            continue   # another process's delete or recovery finished it
        except OSError as e:
            _skip(out, storage, name, f"could not remove it: {e}")
            continue
        log.warning("recckpt: removed %s, left by %s", storage.describe(name), _LEFT_BY[what].split(" (")[0])
        out.removed.append(name)
    try:
        catalog.sync_version_file(storage, fsync, rebuild=rebuild_catalog)
    except OSError as e:
        # The version file is advisory (listings rebuild it): a save goes on without it.
        _skip(out, storage, names.VERSION_FILE, f"could not rewrite the version file: {e}")
    return out
