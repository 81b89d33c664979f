"""The catalog: what listing, retention and restore need of each committed checkpoint's manifest, kept in
one small file of the output directory (`.catalog.json`, docs/FORMAT.md "Output directory") so that
listing 10 000 checkpoints reads one file instead of 10 000 manifests.

It is advisory, like the version file: a cache of manifest fields keyed by checkpoint id. A reader
checks it against the directory listing (entries of checkpoints that are gone are dropped, committed
checkpoints it lacks are read from their manifests) and against the newest checkpoint's manifest, and
rebuilds it from the manifests when it is missing, garbled or stale. Losing it loses nothing.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, replace
from typing import Mapping

from .. import _C
from ..errors import CorruptCheckpointError, InvalidCheckpointIdError
from ..storage import Storage
from . import names
from .retention import META_COMPACTED_FROM as _COMPACTED_FROM, META_STEP, parse_step
from .schema import Manifest, ParentRef

log = logging.getLogger("recckpt")

CATALOG_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Metadata keys that name the checkpoint a compaction folded (the second is what compaction wrote before).
META_COMPACTED_FROM = (_COMPACTED_FROM, "compacted_from")
_I63 = 1 << 63


def payload_bytes(m: Manifest) -> int:
    """Bytes of sparse rows a manifest records (ids + every slot; removed ids count 8 each): what a link
    adds to a chain, comparable across links without reading their indexes."""
    return sum(t.rows * (8 + sum(s.row_bytes for s in t.slots.values())) + 8 * t.removed for t in m.tables.values())


@dataclass(frozen=True)
class CatalogEntry:
    """One committed checkpoint as listings see it: fields of its manifest (whose SHA-256 it records)."""
    ckpt_id: str
    manifest_sha256: str
    created_ns: int
    format_version: int
    shard_num: int
    metadata: Mapping[str, str]
    parent: ParentRef | None
    worker_step: int | None    # the newest step a worker saved at (manifest `worker_steps`)
    payload_bytes: int
    size_bytes: int | None     # its files: the manifest's entries plus the shard files; None: not known
    global_step: int | None = None   # metadata `recckpt.global_step`, parsed (set from `metadata`)

    def __post_init__(self):
        object.__setattr__(self, "global_step", parse_step(self.metadata.get(META_STEP)))

    @property
    def worker_steps(self) -> dict[int, int]:
        """The newest step a worker saved at, as a one-entry mapping: what `retention.recorded_step` reads
        of a manifest's `worker_steps` (the catalog keeps only the newest)."""
        return {} if self.worker_step is None else {0: self.worker_step}

    @property
    def step(self) -> int | None:
        """The global step, else the newest step a worker saved at."""
        g = self.global_step
        return g if g is not None else self.worker_step

    @property
    def compacted_from(self) -> str | None:
        """The checkpoint a compaction folded into this one (its step is this one's global step)."""
        return next((self.metadata[k] for k in META_COMPACTED_FROM if k in self.metadata), None)

    def describes(self, m: Manifest) -> bool:
        """Whether this entry says what manifest `m` says: its hash and every field listings use (a catalog
        edited by hand may keep the hash and change the step)."""
        fresh = CatalogEntry.from_manifest(m)
        return fresh == (self if self.size_bytes is not None else replace(self, size_bytes=fresh.size_bytes))

    @staticmethod
    def from_manifest(m: Manifest) -> "CatalogEntry":
        size = None if m.shard_bytes is None else sum(f.size for f in m.files.values()) + m.shard_bytes
        return CatalogEntry(m.ckpt_id, m.content_sha256, m.created_ns, m.format_version, m.shard_num,
                            dict(m.metadata), m.parent, max(m.worker_steps.values()) if m.worker_steps else None,
                            payload_bytes(m), size)

    def to_json(self) -> dict:
        src = self.compacted_from
        return {"manifest_sha256": self.manifest_sha256, "created_ns": self.created_ns,
                "format_version": self.format_version, "shard_num": self.shard_num, "metadata": dict(self.metadata),
                "parent": None if self.parent is None else self.parent.to_json(), "worker_step": self.worker_step,
                "payload_bytes": self.payload_bytes, "size_bytes": self.size_bytes,
                # informative copies of what the metadata says, for readers of the file
                "step": self.global_step,
                "compacted_from": None if src is None else {"ckpt_id": src, "step": self.global_step}}


def _entry_from_json(cid: str, e: dict) -> CatalogEntry:
    """One entry, every field checked (ValueError on any defect: the caller rebuilds the catalog)."""
    def num(key, lo=0, optional=False):
        x = e.get(key)
        if type(x) is int and lo <= x < _I63 or optional and x is None:
            return x
        raise ValueError(f"entry {cid!r}: field {key!r} is not an integer in [{lo}, 2**63)")

    names.validate_ckpt_id(cid)
    sha = e.get("manifest_sha256")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise ValueError(f"entry {cid!r}: manifest_sha256 is not 64 hex digits")
    meta = e.get("metadata")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError(f"entry {cid!r}: metadata is not an object of strings")
    parent = e.get("parent")
    if parent is not None:
        if not isinstance(parent, dict):
            raise ValueError(f"entry {cid!r}: parent is not an object")
        pid, psha = parent.get("ckpt_id"), parent.get("manifest_sha256")
        names.validate_ckpt_id(pid)
        if not (isinstance(psha, str) and _SHA256.fullmatch(psha)):
            raise ValueError(f"entry {cid!r}: parent.manifest_sha256 is not 64 hex digits")
        parent = ParentRef(pid, psha)
    return CatalogEntry(cid, sha, num("created_ns"), num("format_version", 1), num("shard_num", 1), dict(meta),
                        parent, num("worker_step", -_I63, optional=True), num("payload_bytes"),
                        num("size_bytes", optional=True))


def read_catalog(storage: Storage) -> dict[str, CatalogEntry] | None:
    """The catalog's entries by id; None when it is missing or garbled (the caller reads manifests)."""
    try:
        raw = storage.read_bytes(names.CATALOG, 0, names.MAX_CATALOG_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except (OSError, CorruptCheckpointError) as e:
        log.warning("recckpt: catalog %s: %s; reading the manifests instead", storage.describe(names.CATALOG), e)
        return None
    try:
        if len(raw) > names.MAX_CATALOG_BYTES:
            raise ValueError("larger than any catalog")
        obj = json.loads(_checked_body(raw))
        if not isinstance(obj, dict) or not isinstance(obj.get("checkpoints"), dict):
            raise ValueError("not a catalog")
        return {cid: _entry_from_json(cid, e if isinstance(e, dict) else {})
                for cid, e in obj["checkpoints"].items()}
    except (ValueError, RecursionError, CorruptCheckpointError, InvalidCheckpointIdError) as e:
        log.warning("recckpt: catalog %s is garbled (%s); rebuilding it from the manifests",
                    storage.describe(names.CATALOG), e)
        return None


def _checked_body(raw: bytes) -> bytes:
    """The JSON body of a catalog file after its header line, checked against the header's length and
    CRC-32C (one pass in the engine: a catalog of 10 000 checkpoints is a few MB, read on every listing)."""
    end = raw.find(b"\n", 0, 256)
    if end < 0:
        raise ValueError("no header line")
    head = json.loads(raw[:end])
    body = raw[end + 1:]
    if not isinstance(head, dict) or head.get("catalog_version") != CATALOG_VERSION:
        raise ValueError(f"not a version {CATALOG_VERSION} catalog")
    if head.get("bytes") != len(body) or head.get("crc32c") != _C.crc32c(body):
        raise ValueError("its body does not match the length and CRC-32C of its header (torn or edited)")
    return body


def write_catalog(storage: Storage, entries: list[CatalogEntry]) -> None:
    """Replace the catalog in one step. Never fsynced: a catalog lost or torn by a crash is rebuilt."""
    body = json.dumps({"checkpoints": {e.ckpt_id: e.to_json() for e in entries}}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True).encode("ascii")
    head = json.dumps({"catalog_version": CATALOG_VERSION, "bytes": len(body), "crc32c": _C.crc32c(body)},
                      sort_keys=True, separators=(",", ":")).encode("ascii")
    tmp = f"{names.CATALOG_TMP_PREFIX}{uuid.uuid4().hex[:8]}"
    storage.write_atomic(names.CATALOG, head + b"\n" + body, tmp=tmp, fsync=False, owner=names.owner_file(tmp, 0))


__all__ = ["CatalogEntry", "META_COMPACTED_FROM", "payload_bytes", "read_catalog", "write_catalog"]
