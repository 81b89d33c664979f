"""The output directory: which checkpoints are committed, the version file, commit and delete.

A checkpoint is committed when `<output_dir>/<ckpt_id>/manifest.json` exists and verifies. The version
file lists committed ids oldest first; it is a convenience for people and tools and is rebuilt from the
directories when it is missing, stale or garbled, so losing it never loses a checkpoint. The catalog
(catalog_file.py) keeps what listings need of each manifest, so that a listing reads one file, not one
manifest per checkpoint; it is checked and rebuilt the same way.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator

from ..errors import (
    CheckpointDeletedError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidCheckpointIdError,
    RecckptError,
)
from ..storage import Storage
from . import checked_json, gcpause, names
from .catalog_file import CatalogEntry, read_catalog, write_catalog
from .manifest_parse import manifest_from_json
from .schema import Manifest

log = logging.getLogger("recckpt")


def check_inside(storage: Storage, path: str, ckpt_dir: str, where: str) -> None:
    """Refuse a checkpoint file that is a link, or leads outside its checkpoint directory."""
    why = storage.why_not_inside(path, ckpt_dir)
    if why is not None:
        raise CorruptCheckpointError(f"{where} {why}; every file of a checkpoint must be a regular file inside "
                                     f"its directory (a checkpoint from elsewhere may be hostile)", where)


def read_manifest(storage: Storage, ckpt_dir: str) -> Manifest:
    path = f"{ckpt_dir}/{names.MANIFEST}" if ckpt_dir else names.MANIFEST
    where = storage.describe(path)
    try:   # one read, capped one byte past the limit: no size request first, and never more than the cap
        data = storage.read_bytes(path, 0, names.MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(where) from None
    if len(data) > names.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: more than {names.MAX_MANIFEST_BYTES} bytes exceeds the manifest "
                                     f"size cap", where)
    check_inside(storage, path, ckpt_dir, where)
    sha = hashlib.sha256(data).hexdigest()   # what an increment on it names as its parent
    m = _recent.get(sha)
    if m is None:
        with gcpause.paused():   # a thousand tables' entries
            m = parse_manifest(data, where, sha)
        with _recent_lock:
            if _recent_depth:
                _recent[sha] = m
    return m


def parse_manifest(data: bytes, where: str, sha256: str | None = None) -> Manifest:
    """The manifest in `data` (a manifest.json's bytes), validated."""
    m = manifest_from_json(checked_json.loads(data, where, names.MAX_MANIFEST_BYTES), where)
    m.content_sha256 = sha256 or hashlib.sha256(data).hexdigest()
    return m


# Manifests parsed within `manifests_remembered`, by the SHA-256 of their bytes: the same bytes always
# parse to the same manifest (only error messages name the file). Readers never change a manifest.
_recent: dict[str, Manifest] = {}
_recent_depth = 0
_recent_lock = threading.Lock()


@contextlib.contextmanager
def manifests_remembered():
    """Within the block, `read_manifest` parses each manifest's bytes once: a load reads the newest
    manifest twice (the listing checks it against the catalog, then the reader opens it), which for a
    thousand tables cost as much as the rest of its metadata. Forgotten when the last such block ends,
    so that every operation parses what it reads at least once."""
    global _recent_depth
    with _recent_lock:
        _recent_depth += 1
    try:
        yield
    finally:
        with _recent_lock:
            _recent_depth -= 1
            if not _recent_depth:
                _recent.clear()


#: Who rewrites a damaged version file or stale catalog: listings (ls, restore, load) only read, and say so.
_REWRITTEN_BY = "the next save or `recckpt gc` rewrites it"
_WITHOUT_IT = f"listing the committed checkpoints without it ({_REWRITTEN_BY})"


def read_version_file(storage: Storage) -> list[str] | None:
    """Ids listed in the version file; None when it is missing or garbled (then the caller rebuilds)."""
    try:
        raw = storage.read_bytes(names.VERSION_FILE, 0, names.MAX_VERSION_FILE_BYTES + 1)   # capped, one read
        if len(raw) > names.MAX_VERSION_FILE_BYTES:
            raw = None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except CorruptCheckpointError as e:   # a FIFO, device or link (storage reads regular files only)
        log.warning("recckpt: version file %s: %s; " + _WITHOUT_IT,
                    storage.describe(names.VERSION_FILE), e)
        return None
    if raw is None:
        log.warning("recckpt: version file %s is too large to be one; " + _WITHOUT_IT, storage.describe(names.VERSION_FILE))
        return None
    try:
        ids = [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]
        for i in ids:
            names.validate_ckpt_id(i)
    except (UnicodeDecodeError, InvalidCheckpointIdError):
        log.warning("recckpt: version file %s is garbled; " + _WITHOUT_IT,
                    storage.describe(names.VERSION_FILE))
        return None
    return ids


def committed(storage: Storage, top: list[str] | None = None, known: dict[str, Manifest] | None = None
              ) -> list[tuple[str, CatalogEntry]]:
    """Committed checkpoints, oldest first: the version file's order, with any committed directory it
    does not list placed among them by creation time. Each comes with what the catalog records of its
    manifest (read from the manifest where the catalog has no entry). `top`: the names at the top of
    `storage` when the caller has listed them already (one listing is a request per 1000 names on an
    object store). `known`: manifests the caller holds (one it has just committed), not read again."""
    return _listing(storage, top=top, known=known)[0]


def committed_and_top(storage: Storage, check_top: Callable[[list[str]], None] = lambda top: None,
                      trust_catalog: bool = True) -> tuple[list[tuple[str, CatalogEntry]], list[str]]:
    """`committed(storage)` and the names at the top of `storage` it listed, for a caller that needs
    both (`ls`: leftovers and strays); `check_top(top)` may refuse the listing before it is used.
    `trust_catalog=False` reads every manifest instead of the catalog (`ls --check`)."""
    found, _, top = _listing3(storage, trust_catalog, check_top=check_top)
    return found, top


def _listing(storage: Storage, trust_catalog: bool = True, top: list[str] | None = None,
             known: dict[str, Manifest] | None = None) -> tuple[list[tuple[str, CatalogEntry]], bool]:
    """(committed checkpoints as `committed` lists them, whether the catalog held exactly them)."""
    found, fresh, _ = _listing3(storage, trust_catalog, top, known=known)
    return found, fresh


def _listing3(storage: Storage, trust_catalog: bool = True, top: list[str] | None = None,
              check_top: Callable[[list[str]], None] = lambda top: None,
              known: dict[str, Manifest] | None = None):
    """`_listing`, with the names at the top of `storage` it listed (or was given)."""
    if top is None and storage.size_is_a_request:
        # An object store lists 1000 names a request, one request after the other (10 000 checkpoints:
        # ~0.8 s on moto): the version file and the catalog are read and parsed while it lists.
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as pool:
            listing = pool.submit(storage.listdir, "")
            listed = read_version_file(storage) or []
            cached = (read_catalog(storage) if trust_catalog else None) or {}
            top = listing.result()
    else:
        listed = read_version_file(storage) or []
        top = storage.listdir("") if top is None else top
        cached = (read_catalog(storage) if trust_catalog else None) or {}
    check_top(top)
    candidates = [n for n in top if not n.startswith(".") and n != names.VERSION_FILE]
    found: dict[str, CatalogEntry] = {n: cached[n] for n in candidates if n in cached}
    if found and not storage.size_is_a_request:
        # A folder whose manifest is gone (an interrupted `rm -rf`, a hand edit) is not committed, whatever
        # the catalog says: on a local disk that costs one stat per entry. (On an object store it would be
        # a request per checkpoint; there the newest is checked below and the rest trusted.)
        found = {n: e for n, e in found.items() if storage.exists(f"{n}/{names.MANIFEST}")}
    known = known or {}
    # a manifest the caller holds (one it has just committed) wins over the catalog's entry for its id: that
    # entry may describe a checkpoint deleted by hand and saved again under the same id
    found.update({n: CatalogEntry.from_manifest(known[n]) for n in candidates if n in known})
    unknown = [n for n in candidates if n not in found]
    for name, m in zip(unknown, _read_manifests(storage, unknown)):
        if m is not None:
            found[name] = CatalogEntry.from_manifest(m)
    order = _order(listed, found)
    # The newest checkpoint is what a restart loads and what an increment builds on: its entry is checked
    # against its manifest (one read), and a mismatch means the catalog is stale.
    if order and order[-1] in cached:
        m = _manifest_or_none(storage, order[-1])
        if m is None or not cached[order[-1]].describes(m):
            # (unlike a pick, an unreadable manifest here is a reason to list from the manifests)
            _warn_stale(storage, order[-1])
            return _listing(storage, trust_catalog=False)[0], False, top
    return [(i, found[i]) for i in order], set(cached) == set(found), top


def newest(storage: Storage, top: list[str] | None = None) -> tuple[list[tuple[str, CatalogEntry]], str | None]:
    """(`committed(storage, top)`, the checkpoint a load without an id loads: the highest recorded step,
    ties to the one committed last; None when none is committed). The entry of that one is checked against
    its manifest, and the listing read from the manifests instead when it is stale."""
    from .retention import recorded_step, restore_order

    def pick(found):
        order = restore_order([(i, recorded_step(m.metadata, m.worker_steps)) for i, m in found])
        return order[0] if order else None

    found = committed(storage, top)
    first = pick(found)
    if first is not None and not picked_entry_holds(storage, found, first):
        found = _listing(storage, trust_catalog=False, top=top)[0]
        first = pick(found)
    return found, first


def picked_entry_holds(storage: Storage, found: list[tuple[str, CatalogEntry]], ckpt_id: str) -> bool:
    """Whether the entry of `ckpt_id` in listing `found` still describes its checkpoint: the listing has
    checked (or read) the entry of the checkpoint committed last; another one is checked here."""
    if found and found[-1][0] == ckpt_id:
        return True
    return matches_its_manifest(storage, ckpt_id, dict(found)[ckpt_id])


def matches_its_manifest(storage: Storage, ckpt_id: str, entry: CatalogEntry) -> bool:
    """Whether `entry` (as a listing gave it) still describes checkpoint `ckpt_id` (one manifest read). A
    listing checks only the newest entry of the catalog so; a caller about to act on another entry (a
    restart picking the highest step) checks that one. False (with a warning) for a stale entry; True
    where the manifest cannot be read (the load that follows says why)."""
    m = _manifest_or_none(storage, ckpt_id)
    if m is None or entry.describes(m):
        return True
    _warn_stale(storage, ckpt_id)
    return False


def _warn_stale(storage: Storage, ckpt_id: str) -> None:
    log.warning("recckpt: catalog %s does not match checkpoint %s; reading the manifests instead (" + _REWRITTEN_BY + ")",
                storage.describe(names.CATALOG), storage.describe(ckpt_id))


def _order(listed: list[str], found: dict[str, CatalogEntry]) -> list[str]:
    order = [i for i in listed if i in found]
    # A committed checkpoint the version file does not list is either a commit whose version-file
    # update was lost (newer than everything listed) or one retention had dropped from the version file
    # and not yet deleted (older). Each goes where its creation time puts it among the listed ones:
    # appending them all would make a half-retired old checkpoint the "newest" one a restart loads.
    listed_set = set(order)
    for _, i in sorted((m.created_ns, i) for i, m in found.items() if i not in listed_set):
        created = found[i].created_ns
        at = next((k for k, j in enumerate(order) if found[j].created_ns > created), len(order))
        order.insert(at, i)
    return order


#: Manifests read at once when listing an output directory whose store charges a round trip per
#: request (object stores): their latency overlaps instead of adding up per checkpoint.
LIST_READ_THREADS = 8


def _manifest_or_none(storage: Storage, name: str) -> Manifest | None:
    try:
        names.validate_ckpt_id(name)
        return read_manifest(storage, name)
    except (FileNotFoundError, InvalidCheckpointIdError, NotADirectoryError):
        return None
    except Exception as e:  # noqa: BLE001 - see below
        # Whatever one directory holds (a hostile manifest, an unreadable file, a bug of ours in
        # validation) must not make the whole output directory unusable: load, restore, verify
        # and later saves all list it. That checkpoint is skipped, loudly.
        log.warning("recckpt: skipping %s: %s: %s", storage.describe(name), type(e).__name__, e)
        return None


def _read_manifests(storage: Storage, dirs: list[str]) -> list[Manifest | None]:
    """The manifest of each of `dirs`, or None where there is none that verifies."""
    if not storage.size_is_a_request or len(dirs) < 2:
        return [_manifest_or_none(storage, d) for d in dirs]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(LIST_READ_THREADS, len(dirs))) as pool:
        return list(pool.map(lambda d: _manifest_or_none(storage, d), dirs))


def not_a_checkpoint(storage: Storage) -> str:
    """Why the root of `storage`, where a checkpoint was expected, holds none: it does not exist (a
    missing bucket raises the store's StorageError naming it), it is an output directory (naming its
    newest checkpoint), or it has no manifest."""
    where = storage.describe()
    try:
        exists = storage.isdir("")
    except FileNotFoundError:
        exists = False
    if not exists:
        try:
            is_file = storage.exists("")
        except OSError:
            is_file = False
        if is_file:
            return (f"{where} is a file, not a checkpoint; pass its checkpoint directory, <output_dir>/<ckpt_id> "
                    f"(the directory holding {names.MANIFEST})")
        return (f"{where} does not exist (deleted, by retention or by hand, or never there); pass a committed "
                f"checkpoint directory, <output_dir>/<ckpt_id> (`recckpt ls <output_dir>` lists them)")
    try:
        found = [i for i, _ in committed(storage)]
    except OSError:
        found = []
    if found:
        return (f"{where} is an output directory, not one checkpoint; pass one of its checkpoints, e.g. "
                f"{storage.describe(found[-1])} (the newest of {len(found)})")
    return (f"{where} is not a committed checkpoint (no {names.MANIFEST}); pass a checkpoint directory, "
            f"<output_dir>/<ckpt_id>")


def damaged(storage: Storage, top: list[str], committed_ids: "set[str]") -> list[tuple[str, str]]:
    """(name, why) for each entry of `top` (the names at the top of `storage`) outside `committed_ids`
    that holds a manifest which does not verify: listings skip it (it is not committed), but its id stays
    taken, so a save under it is refused until it is deleted (`recckpt.delete` accepts such ids)."""
    out = []
    for name in top:
        if name in committed_ids or name.startswith(".") or name == names.VERSION_FILE:
            continue
        try:
            names.validate_ckpt_id(name)
            if not storage.exists(f"{name}/{names.MANIFEST}"):
                continue
            read_manifest(storage, name)
        except (FileNotFoundError, NotADirectoryError, InvalidCheckpointIdError):
            continue
        except Exception as e:  # noqa: BLE001 - whatever makes the manifest unreadable is the answer
            out.append((name, f"{type(e).__name__}: {e}"))
    return out


def with_parents(found: list[tuple[str, CatalogEntry]], keep: "set[str] | list[str]") -> set[str]:
    """`keep` plus every checkpoint a kept incremental checkpoint depends on (its parent, the parent's
    parent, ... down to the full base), among the committed ones in `found`. Retention deletes only
    what is outside this set, so it never breaks a kept chain."""
    parent_of = {i: m.parent.ckpt_id for i, m in found if m.parent is not None}
    out = set()
    for i in keep:
        while i is not None and i not in out:
            out.add(i)
            i = parent_of.get(i)
    return out


def broken_chains(found: list[tuple[str, CatalogEntry]]) -> list[tuple[str, str]]:
    """(id, why) for each committed incremental checkpoint in `found` that cannot be loaded because a
    link of its chain is not committed (deleted by hand, or its manifest gone): listings show it, and say
    so, instead of presenting it as loadable. No request: the catalog entries name the parents."""
    parent_of = {i: m.parent.ckpt_id for i, m in found if m.parent is not None}
    entry = dict(found)
    # a parent is the checkpoint its child names by id *and* manifest hash: one deleted and saved again
    # under the same id is another checkpoint (open_chain refuses it as "altered or replaced")
    committed_ids = {i for i, m in found}
    replaced = {i for i, m in found if m.parent is not None and m.parent.ckpt_id in entry
                and entry[m.parent.ckpt_id].manifest_sha256 != m.parent.manifest_sha256}
    missing_link: dict[str, str | None] = {}   # id -> the first link of its chain not committed (None: whole)
    for start, _ in found:
        path = []
        i = start
        while i not in missing_link:
            if i not in committed_ids:
                missing_link[i] = i
                break
            if i not in parent_of:
                missing_link[i] = None
                break
            if i in replaced:   # its parent's id holds another checkpoint now: the link is gone
                missing_link[i] = parent_of[i]
                break
            if i in path:   # a loop: only a hand-made catalog or manifest could name one
                missing_link[i] = i
                break
            path.append(i)
            i = parent_of[i]
        for j in reversed(path):
            missing_link[j] = missing_link[parent_of[j]] if parent_of[j] in missing_link else parent_of[j]
    out = []
    for i, _ in found:
        gone = missing_link.get(i)
        if gone is not None:
            what = "was replaced by another checkpoint of that id" if gone in committed_ids else \
                "is not a committed checkpoint"
            out.append((i, f"its parent {gone} {what}" if parent_of.get(i) == gone else
                        f"{gone}, a link of its chain, {what}"))
    return out


def without_needed_links(found: list[tuple[str, CatalogEntry]], doomed: list[str]) -> list[str]:
    """`doomed` minus every checkpoint that a checkpoint outside it depends on (see `with_parents`): what
    retention may really delete. Every deleter (Saver retention, the CLI's prune) filters through it."""
    needed = with_parents(found, {i for i, _ in found} - set(doomed))
    return [d for d in doomed if d not in needed]


@contextlib.contextmanager
def deleted_as_such(places: "list[tuple[Storage, str]]", doing: str) -> Iterator[None]:
    """Re-raise a failure of reading a checkpoint (missing or short files, an I/O error) as
    CheckpointDeletedError when one of `places` ((storage, checkpoint dir): the checkpoint and the links
    of its chain) is no longer committed: it was deleted under the reader (retention in another process,
    or by hand), which is not corruption and calls for reading the newest checkpoint again."""
    try:
        yield
    except (RecckptError, OSError) as e:
        if isinstance(e, (CheckpointDeletedError, InvalidArgumentError)):
            raise
        gone = None
        for storage, ckpt_dir in places:
            try:
                if not storage.exists(f"{ckpt_dir}/{names.MANIFEST}" if ckpt_dir else names.MANIFEST):
                    gone = storage.describe(ckpt_dir)
                    break
            except OSError:
                continue
        if gone is None:
            raise
        raise CheckpointDeletedError(
            f"checkpoint {gone} was deleted while it was being {doing} (by retention in another process, or by "
            f"hand): {type(e).__name__}: {e}. Open the newest checkpoint again.", path=gone) from e


def links_lock(storage: Storage, needed: bool = True):
    """The output directory's lock between increments' commits and deletes (`Storage.links_lock`):
    held by a commit of an increment around its parent's last check, and by every deleter (retention,
    prune, delete) from its last listing through its deletes. `needed=False`: nothing to hold (a full
    checkpoint depends on no other)."""
    return storage.links_lock() if needed else contextlib.nullcontext()


def unneeded_now(storage: Storage, found: list[tuple[str, CatalogEntry]], doomed: list[str]) -> list[str]:
    """`doomed` (chosen from `found`) minus the links that a checkpoint committed since `found` was listed
    needs: another writer's increment on one of them, which deleting it would leave unloadable. One more
    listing of the top of `storage`, and a manifest read per checkpoint not in `found`; retention's own
    listing can be seconds old on a large output directory."""
    if not doomed:
        return doomed
    try:
        top = storage.listdir("")
    except OSError:
        return doomed
    seen = {i for i, _ in found}
    new = [n for n in top if not n.startswith(".") and n != names.VERSION_FILE and n not in seen]
    if not new:
        return doomed
    now = list(found) + [(n, CatalogEntry.from_manifest(m)) for n, m in zip(new, _read_manifests(storage, new))
                         if m is not None]
    kept = [d for d in doomed if d not in without_needed_links(now, doomed)]
    if kept:
        log.info("recckpt: retention keeps %s: checkpoints committed meanwhile build on them", kept)
    return [d for d in doomed if d not in kept]


def write_version_file(storage: Storage, ids: list[str], fsync: bool = True,
                       entries: "dict[str, CatalogEntry] | None" = None) -> None:
    """Replace the version file in one step (the store decides how: temp file + rename, or one PUT);
    with `entries` (id -> CatalogEntry, as `committed` gives them), then the catalog too, listing `ids`.
    A catalog that cannot be written is removed (a stale one must not outlive a retention)."""
    tmp = f"{names.VERSION_TMP_PREFIX}{uuid.uuid4().hex[:8]}"
    # Claimed while it exists, so another process's recovery never removes it mid-way (issue 30).
    storage.write_atomic(names.VERSION_FILE, "".join(f"{i}\n" for i in ids).encode(), tmp=tmp, fsync=fsync,
                         owner=names.owner_file(tmp, 0))
    if entries is None:
        return
    try:
        write_catalog(storage, [entries[i] for i in ids if i in entries])
    except OSError as e:
        log.warning("recckpt: could not write the catalog %s (%s); listings read the manifests until it is "
                    "rebuilt", storage.describe(names.CATALOG), e)
        try:
            storage.remove_file(names.CATALOG)
        except OSError:
            pass


def sync_version_file(storage: Storage, fsync: bool = True, rebuild: bool = False) -> list[str]:
    """Bring the version file and the catalog in line with the committed checkpoints; `rebuild` reads
    every manifest instead of trusting the catalog (`recckpt gc`)."""
    found, fresh = _listing(storage, trust_catalog=not rebuild)
    ids = [i for i, _ in found]
    if read_version_file(storage) != ids or not fresh or rebuild:
        write_version_file(storage, ids, fsync, dict(found))
    return ids


def new_staging_dir(ckpt_id: str, nonce: str) -> str:
    return f"{names.STAGING_PREFIX}{ckpt_id}-{nonce}"


def is_committed(storage: Storage, ckpt_id: str) -> bool:
    """Whether `ckpt_id` has its commit marker (the manifest); a leftover without one is not. (A manifest
    that does not verify counts here, so that nothing writes over it; listings skip it: `damaged`.)"""
    return storage.exists(f"{ckpt_id}/{names.MANIFEST}")


def commit(storage: Storage, target: str, ckpt_id: str, manifest_bytes: bytes, fsync: bool = True) -> None:
    """Make the fully written save target visible as `ckpt_id` in one step: the manifest is written
    last, and the store commits in its own way (storage.base.Storage.commit)."""
    storage.commit(target, ckpt_id, names.MANIFEST, manifest_bytes, fsync=fsync)


def delete(storage: Storage, ckpt_id: str) -> None:
    """Invalidate first (the store's one step: a rename away, or removing the manifest), then remove."""
    storage.delete_checkpoint(ckpt_id, names.MANIFEST, f"{names.TRASH_PREFIX}{ckpt_id}-{uuid.uuid4().hex[:8]}")


def retire(storage: Storage, kept: list[str], doomed: list[str], fsync: bool = True,
           entries: "dict[str, CatalogEntry] | None" = None) -> list[str]:
    """Retention: rewrite the version file to list only `kept`, then delete each of `doomed` (a crash
    in between leaves a version file that never names a deleted checkpoint). `doomed` is in committed
    order (oldest first) and is deleted newest first: an increment goes before the links it depends on,
    so a crash part way never leaves a committed increment whose parent is gone (recovery would list it
    again, unloadable). Returns the ids deleted; a failed delete is logged (a leftover checkpoint costs
    space, not correctness) and start-up recovery or the next retention finishes it. A checkpoint that
    stays committed because its delete failed keeps the links it builds on (`entries` says which), so a
    failure part way never leaves a committed increment whose parent is gone either."""
    if not doomed:
        return []
    write_version_file(storage, kept, fsync, entries)   # if this fails nothing is deleted: the next save retries
    parent_of = {i: e.parent.ckpt_id for i, e in (entries or {}).items() if e.parent is not None}
    held: dict[str, str] = {}   # link -> the increment that could not be deleted and builds on it
    deleted = []
    for cid in reversed(doomed):
        if cid in held:
            log.warning("recckpt: kept %s: %s, which could not be deleted, builds on it", storage.describe(cid),
                        storage.describe(held[cid]))
            continue
        log.info("recckpt: deleting %s", storage.describe(cid))
        try:
            delete(storage, cid)
            deleted.append(cid)
        except FileNotFoundError:
            deleted.append(cid)   # another process's retention got there first
        except OSError as e:
            log.warning("recckpt: could not delete %s: %s", storage.describe(cid), e)
            try:   # a delete that failed after invalidating it holds nothing; an unanswered question holds
                stays = is_committed(storage, cid)
            except OSError:
                stays = True
            if stays:
                link = parent_of.get(cid)
                while link is not None and link not in held:
                    held[link] = cid
                    link = parent_of.get(link)
    gone = set(deleted)
    return [cid for cid in doomed if cid in gone]
