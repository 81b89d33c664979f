"""Start-up recovery of an output directory after a crash: what a killed save or delete can leave
behind, and putting the version file back in line with the committed checkpoints.

A save killed at any moment leaves at most: a `.staging-*` directory (before the commit), a
`.deleting-*` directory (during retention), a `.checkpoint.tmp-*` file (while the version file was
being replaced), a stale version file (between the commit and its rewrite), and, on stores without an
atomic directory rename, a `<ckpt_id>/` directory whose manifest was never written (data moved, commit
not reached) or was already removed (a delete cut short). None of these is ever read as a checkpoint;
`recover` removes them and rewrites the version file, logging one line per thing it removes.

It must only run where no other save into the same directory can be in flight, except the ones whose
staging directories the caller passes in `keep` (the other workers of the save that is starting).
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
    if storage.atomic_rename:
        # With an atomic rename a checkpoint-named directory always had its manifest before it existed.
        return False
    try:
        names.validate_ckpt_id(name)
    except InvalidCheckpointIdError:
        return False
    if not storage.isdir(name) or storage.exists(f"{name}/{names.MANIFEST}"):
        return False
    entries = set(storage.listdir(name))
    return entries <= _OWN_ENTRIES


def find_leftovers(storage: Storage, keep: Collection[str] = ()) -> list[tuple[str, str]]:
    """(name, what left it) for each top-level entry of `storage` that `recover` would remove."""
    found = []
    for name in storage.listdir(""):
        if name in keep:
            continue
        if name.startswith((names.STAGING_PREFIX, names.TRASH_PREFIX)):
            what = "an interrupted save" if name.startswith(names.STAGING_PREFIX) else "an interrupted delete"
        elif name.startswith(names.VERSION_TMP_PREFIX):
            what = "an interrupted version-file update"
        elif _uncommitted_leftover(storage, name):
            what = "a save or delete interrupted before its manifest was written/after it was removed"
        else:
            continue
        found.append((name, what))
    return found


def recover(storage: Storage, keep: Collection[str] = (), fsync: bool = True) -> list[str]:
    """Remove what interrupted saves and deletes left in `storage` (except the names in `keep`) and
    rewrite the version file if it is missing, garbled or stale. Returns the names removed."""
    removed = []
    for name, what in find_leftovers(storage, keep):
        remove = storage.remove_file if name.startswith(names.VERSION_TMP_PREFIX) else storage.remove_tree
        log.warning("recckpt: removing %s, left by %s", storage.describe(name), what)
        try:
            remove(name)
        except FileNotFoundError:
            continue
        removed.append(name)
    catalog.sync_version_file(storage, fsync)
    return removed
