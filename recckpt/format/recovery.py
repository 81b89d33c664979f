"""Start-up recovery of an output directory: what a killed save or delete can leave behind, and putting
the version file back in line with the committed checkpoints.

A save killed at any moment leaves at most: its save target (a `.staging-*` directory on stores that
commit by rename; a manifest-less `<ckpt_id>/` on stores that write in place), the writers' claims
(`.owner-*`), a `.deleting-*` directory (during retention), a `.checkpoint.tmp-*` file (while the version
file was being replaced), and a stale version file. None of these is ever read as a checkpoint.

Another process may be saving into the same directory right now (a job restarted while its old instance
still writes). Its save target is covered by its writers' live claims, and `recover` leaves a target
alone while any claim on it is alive (storage.Storage.remove_if_unowned decides, per kind of store).
`keep` names targets of the save that is starting (its other workers may not have claimed yet).
"""
from __future__ import annotations

import logging
from collections.abc import Collection

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
    """Remove a save target (and its claims) unless a live writer holds it; True if removed."""
    listing = storage.listdir("") if listing is None else listing
    return storage.remove_if_unowned(_owners(listing, target), [target])


def find_leftovers(storage: Storage, keep: Collection[str] = (), top: list[str] | None = None
                   ) -> list[tuple[str, str]]:
    """(name, what left it) for each top-level entry of `storage` that `recover` would remove, were its
    writer dead: a save target that a live process still claims is listed too (`recover` keeps it).
    `top`: the top-level names, when the caller has listed them already."""
    found = []
    for name in storage.listdir("") if top is None else top:
        if name in keep:
            continue
        if name.startswith(names.STAGING_PREFIX) or _uncommitted_leftover(storage, name):
            what = "an interrupted save (or one still running: removed only when no live process claims it)"
        elif name.startswith(names.TRASH_PREFIX):
            what = "an interrupted delete"
        elif name.startswith(names.VERSION_TMP_PREFIX):
            what = "an interrupted version-file update"
        elif name.startswith(names.CATALOG_TMP_PREFIX):
            what = "an interrupted catalog update"
        elif name.startswith(names.OWNER_PREFIX):
            what = "a writer's claim (removed only when its writer is gone)"
        else:
            continue
        found.append((name, what))
    return found


def recover(storage: Storage, keep: Collection[str] = (), fsync: bool = True, rebuild_catalog: bool = False
            ) -> list[str]:
    """Remove what interrupted saves and deletes left in `storage` (except the targets in `keep` and
    those a live writer holds) and rewrite the version file and the catalog if they are missing, garbled
    or stale (`rebuild_catalog`: the catalog from every manifest, trusting none of it). Returns the names
    removed."""
    removed = []
    listing = storage.listdir("")
    for name in listing:
        if name in keep:
            continue
        if name.startswith(names.STAGING_PREFIX) or _uncommitted_leftover(storage, name):
            what = "an interrupted save"
            if not remove_target_if_unowned(storage, name, listing):
                log.info("recckpt: leaving %s alone: a live process is writing it", storage.describe(name))
                continue
        elif name.startswith(names.TRASH_PREFIX):
            what = "an interrupted delete"
            try:
                storage.remove_tree(name)
            except FileNotFoundError:
                continue   # another process's delete or recovery finished it
        elif name.startswith((names.VERSION_TMP_PREFIX, names.CATALOG_TMP_PREFIX)):
            what = ("an interrupted version-file update" if name.startswith(names.VERSION_TMP_PREFIX)
                    else "an interrupted catalog update")
            storage.remove_file(name)
        else:
            continue
        log.warning("recckpt: removed %s, left by %s", storage.describe(name), what)
        removed.append(name)
    # Claims no live writer holds (their writer died before creating its target, or after committing it
    # but before releasing): removing one is never harmful, a writer racing to claim re-creates it.
    for name in listing:
        if not name.startswith(names.OWNER_PREFIX) or any(name.startswith(names.owner_target_prefix(t))
                                                          for t in keep):
            continue
        if storage.exists(name) and storage.remove_if_unowned([name], []):
            removed.append(name)
    catalog.sync_version_file(storage, fsync, rebuild=rebuild_catalog)
    return removed
