"""The output directory: which checkpoints are committed, the version file, commit and delete.

A checkpoint is committed when `<output_dir>/<ckpt_id>/manifest.json` exists and verifies. The version
file lists committed ids oldest first; it is a convenience for people and tools and is rebuilt from the
directories when it is missing, stale or garbled, so losing it never loses a checkpoint.
"""
from __future__ import annotations

import logging
import uuid

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError, InvalidCheckpointIdError
from ..storage import Storage
from . import checked_json, names
from .schema import Manifest, manifest_from_json

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
    try:
        size = storage.size(path)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(where) from None
    if size > names.MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {size} bytes exceeds the manifest size cap", where)
    check_inside(storage, path, ckpt_dir, where)
    return manifest_from_json(checked_json.loads(storage.read_bytes(path), where, names.MAX_MANIFEST_BYTES),
                              where)


def read_version_file(storage: Storage) -> list[str] | None:
    """Ids listed in the version file; None when it is missing or garbled (then the caller rebuilds)."""
    try:
        too_big = storage.size(names.VERSION_FILE) > names.MAX_VERSION_FILE_BYTES
        raw = None if too_big else storage.read_bytes(names.VERSION_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except CorruptCheckpointError as e:   # a FIFO, device or link (storage reads regular files only)
        log.warning("recckpt: version file %s: %s; rebuilding it from the committed checkpoints",
                    storage.describe(names.VERSION_FILE), e)
        return None
    if raw is None:
        log.warning("recckpt: version file %s is too large to be one; rebuilding it from the committed "
                    "checkpoints", storage.describe(names.VERSION_FILE))
        return None
    try:
        ids = [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]
        for i in ids:
            names.validate_ckpt_id(i)
    except (UnicodeDecodeError, InvalidCheckpointIdError):
        log.warning("recckpt: version file %s is garbled; rebuilding it from the committed checkpoints",
                    storage.describe(names.VERSION_FILE))
        return None
    return ids


def committed(storage: Storage) -> list[tuple[str, Manifest]]:
    """Committed checkpoints, oldest first: the version file's order, then any committed directory it
    does not list (a crash between commit and version-file update) by creation time."""
    listed = read_version_file(storage) or []
    found: dict[str, Manifest] = {}
    for name in storage.listdir(""):
        if name.startswith(".") or name == names.VERSION_FILE:
            continue
        try:
            names.validate_ckpt_id(name)
            m = read_manifest(storage, name)
        except (FileNotFoundError, InvalidCheckpointIdError, NotADirectoryError):
            continue
        except Exception as e:  # noqa: BLE001 - see below
            # Whatever one directory holds (a hostile manifest, an unreadable file, a bug of ours in
            # validation) must not make the whole output directory unusable: load, restore, verify
            # and later saves all list it. That checkpoint is skipped, loudly.
            log.warning("recckpt: skipping %s: %s: %s", storage.describe(name), type(e).__name__, e)
            continue
        found[name] = m
    order = [i for i in listed if i in found]
    rest = sorted((m.created_ns, i) for i, m in found.items() if i not in set(order))
    return [(i, found[i]) for i in order] + [(i, found[i]) for _, i in rest]


def write_version_file(storage: Storage, ids: list[str], fsync: bool = True) -> None:
    """Atomic where the store can rename: temp file, fsync, rename over, fsync the directory."""
    tmp = f"{names.VERSION_TMP_PREFIX}{uuid.uuid4().hex[:8]}"
    try:
        storage.write_bytes(tmp, "".join(f"{i}\n" for i in ids).encode(), fsync=fsync)
        storage.replace_file(tmp, names.VERSION_FILE)
    except BaseException:
        try:
            storage.remove_file(tmp)
        except OSError:
            pass  # start-up recovery removes it
        raise
    if fsync and storage.is_local:
        storage.fsync_dir("")


def sync_version_file(storage: Storage, fsync: bool = True) -> list[str]:
    ids = [i for i, _ in committed(storage)]
    if read_version_file(storage) != ids:
        write_version_file(storage, ids, fsync)
    return ids


def new_staging_dir(ckpt_id: str, nonce: str) -> str:
    return f"{names.STAGING_PREFIX}{ckpt_id}-{nonce}"


def commit(storage: Storage, stage: str, ckpt_id: str, manifest_bytes: bytes, fsync: bool = True) -> None:
    """Make a fully written staging directory visible as `ckpt_id` in one step.

    Where directories rename atomically the manifest is written into the staging directory and the
    rename is the commit. Elsewhere the data is moved first and the manifest, written last, is the commit.
    """
    if storage.atomic_rename:
        storage.write_bytes(f"{stage}/{names.MANIFEST}", manifest_bytes, fsync=fsync)
        if fsync and storage.is_local:
            for sub in ("", names.SPARSE_DIR, names.IO_STATE_DIR):
                if storage.isdir(f"{stage}/{sub}" if sub else stage):
                    storage.fsync_dir(f"{stage}/{sub}" if sub else stage)
        storage.rename(stage, ckpt_id)
        if fsync and storage.is_local:
            storage.fsync_dir("")
    else:
        storage.rename(stage, ckpt_id)
        storage.write_bytes(f"{ckpt_id}/{names.MANIFEST}", manifest_bytes, fsync=fsync)


def delete(storage: Storage, ckpt_id: str) -> None:
    """Invalidate first (atomic rename away, or manifest removal), then remove the data."""
    if storage.atomic_rename:
        trash = f"{names.TRASH_PREFIX}{ckpt_id}-{uuid.uuid4().hex[:8]}"
        storage.rename(ckpt_id, trash)
        if storage.is_local:
            storage.fsync_dir("")
        storage.remove_tree(trash)
    else:
        storage.remove_file(f"{ckpt_id}/{names.MANIFEST}")
        storage.remove_tree(ckpt_id)
