"""Manifest and index: typed records, built by the writer and validated field by field on read.

docs/FORMAT.md states the same schema in prose; change both together. Validation raises
CorruptCheckpointError naming the file and the field, so a garbled or hostile file is rejected before
any offset in it is used.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from . import dtypes, layout
from .digest import DIGEST_NAME, DenseDigest, Digest, Digests, TableDigest
from .hashing import HASH_NAME, NUM_BUCKETS_LIMIT
from .names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INCREMENTAL_SINCE,
    READABLE_FORMAT_VERSIONS,
    validate_ckpt_id,
    validate_relpath,
)

CATEGORIES = ("sparse", "sparse_opt")
_U32 = 1 << 32
_I63 = 1 << 63


@dataclass(frozen=True)
class SlotInfo:
    dtype: str                 # format dtype name, see format/dtypes.py
    shape: tuple[int, ...]     # row shape
    category: str              # "sparse" | "sparse_opt"

    @property
    def row_bytes(self) -> int:
        n = dtypes.itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n

    def to_json(self):
        return {"dtype": self.dtype, "shape": list(self.shape), "category": self.category}


@dataclass(frozen=True)
class TableInfo:
    slots: dict[str, SlotInfo]  # in column order
    rows: int
    changes: bool = False       # incremental: only rows changed since the parent (+ removed ids)
    removed: int = 0            # ids removed since the parent (only with changes)

    def to_json(self):
        out = {"slots": [[k, v.to_json()] for k, v in self.slots.items()], "rows": self.rows}
        if self.changes:
            out.update(changes=True, removed=self.removed)
        return out


@dataclass(frozen=True)
class ParentRef:
    """An incremental checkpoint's parent: its id (a sibling directory) and the SHA-256 of the parent's
    manifest.json bytes, which cover every file of the parent through their sizes and checksums."""
    ckpt_id: str
    manifest_sha256: str

    def to_json(self):
        return {"ckpt_id": self.ckpt_id, "manifest_sha256": self.manifest_sha256}


@dataclass(frozen=True)
class FileInfo:
    size: int
    crc32c: int


@dataclass
class Manifest:
    ckpt_id: str
    created_ns: int
    writer: str
    num_buckets: int
    chunk_bytes: int
    shard_num: int
    tables: dict[str, TableInfo] = field(default_factory=dict)
    files: dict[str, FileInfo] = field(default_factory=dict)   # every file but the manifest and .bin shards
    index: str | None = None
    dense: str | None = None
    extras: str | None = None
    io_state: dict[int, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    worker_steps: dict[int, int] = field(default_factory=dict)  # worker → training step it saved at
    format_version: int = FORMAT_VERSION
    parent: ParentRef | None = None   # set: an incremental checkpoint (format version 3)
    digests: Digests | None = None    # content digests (format version 4); None: not recorded
    shard_bytes: int | None = None    # bytes of all .bin shard files (version 4); None: not recorded
    content_sha256: str | None = None  # SHA-256 of manifest.json as read or written (not a field of it)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version, "ckpt_id": self.ckpt_id,
            "created_ns": self.created_ns, "writer": self.writer, "num_buckets": self.num_buckets,
            "hash": HASH_NAME, "checksum": "crc32c", "chunk_bytes": self.chunk_bytes,
            "shard_num": self.shard_num,
            "tables": {k: v.to_json() for k, v in self.tables.items()},
            "files": {k: {"size": v.size, "crc32c": v.crc32c} for k, v in self.files.items()},
            "index": self.index, "dense": self.dense, "extras": self.extras,
            "io_state": {str(k): v for k, v in sorted(self.io_state.items())},
            "metadata": dict(self.metadata),
            **({"worker_steps": {str(k): v for k, v in sorted(self.worker_steps.items())}}
               if self.worker_steps else {}),
            **({"parent": self.parent.to_json()} if self.parent is not None else {}),
            **({"digests": self.digests.to_json()} if self.digests is not None else {}),
            **({"shard_bytes": self.shard_bytes} if self.shard_bytes is not None else {}),
        }


@dataclass(frozen=True)
class Column:
    offset: int
    length: int
    crc32c: tuple[int, ...]   # one per chunk

    def to_json(self):
        return {"offset": self.offset, "length": self.length, "crc32c": list(self.crc32c)}


@dataclass(frozen=True)
class Segment:
    file: int                 # index into IndexDoc.files
    rows: int
    buckets: Column           # int64[B+1] row offsets, one CRC over the whole block
    columns: tuple[Column, ...]  # [ids, slot 0, slot 1, ...]

    def pad_before(self, k: int, format_version: int) -> int:
        """Zero bytes before column k (the rule: `layout.pad_before`)."""
        if k == 0:
            return 0
        prev = self.columns[k - 1]
        return layout.pad_before(prev.offset + prev.length, self.columns[k].offset, k, format_version)

    def to_json(self):
        b = self.buckets
        return {"file": self.file, "rows": self.rows,
                "buckets": {"offset": b.offset, "length": b.length, "crc32c": b.crc32c[0]},
                "columns": [c.to_json() for c in self.columns]}


@dataclass
class IndexDoc:
    """The merged index (index.json) and each worker's own index share this schema."""
    num_buckets: int
    chunk_bytes: int
    files: list[tuple[str, int]] = field(default_factory=list)           # (relpath, size)
    tables: dict[str, tuple[list[str], list[Segment]]] = field(default_factory=dict)  # name -> (slots, segments)
    format_version: int = FORMAT_VERSION
    removed: dict[str, list[Segment]] = field(default_factory=dict)  # name -> segments of removed ids (no slots)

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version, "num_buckets": self.num_buckets,
            "chunk_bytes": self.chunk_bytes,
            "files": [{"path": p, "size": s} for p, s in self.files],
            "tables": {k: {"slots": list(slots), "segments": [s.to_json() for s in segs],
                           **({"removed": [s.to_json() for s in self.removed[k]]} if k in self.removed else {})}
                       for k, (slots, segs) in self.tables.items()},
        }

    @staticmethod
    def merge(parts: list["IndexDoc"]) -> "IndexDoc":
        """One index for the checkpoint: files concatenated in worker order, segments re-pointed."""
        if not parts:
            raise ValueError("nothing to merge")
        out = IndexDoc(parts[0].num_buckets, parts[0].chunk_bytes, format_version=parts[0].format_version)
        for p in parts:
            if (p.num_buckets, p.chunk_bytes) != (out.num_buckets, out.chunk_bytes):
                raise ValueError("worker indexes disagree on num_buckets/chunk_bytes")
            base = len(out.files)
            out.files.extend(p.files)
            for name, (slots, segs) in p.tables.items():
                have = out.tables.setdefault(name, (list(slots), []))
                if have[0] != list(slots):
                    raise ValueError(f"table {name!r}: workers wrote different slots {have[0]} vs {slots}")
                have[1].extend(Segment(s.file + base, s.rows, s.buckets, s.columns) for s in segs)
            for name, segs in p.removed.items():
                out.removed.setdefault(name, []).extend(Segment(s.file + base, s.rows, s.buckets, s.columns)
                                                        for s in segs)
        return out


# ----------------------------------------------------------------------------------------- validation
class _V:
    """Field-by-field checks that report `<file>: <field path>: <problem>`."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, problem: str):
        raise CorruptCheckpointError(f"{self.path}: field {where}: {problem}", self.path)

    def get(self, obj, key, where):
        if not isinstance(obj, dict) or key not in obj:
            self.fail(f"{where}.{key}" if where else key, "missing")
        return obj[key]

    def int(self, v, where, lo=0, hi=_I63):
        if type(v) is not int or not lo <= v < hi:
            self.fail(where, f"expected an integer in [{lo}, {hi}), got {v!r:.80}")
        return v

    def str(self, v, where):
        if not isinstance(v, str) or "\x00" in v:
            self.fail(where, f"expected a string, got {v!r:.80}")
        return v

    def dict(self, v, where):
        if not isinstance(v, dict):
            self.fail(where, f"expected an object, got {type(v).__name__}")
        return v

    def list(self, v, where):
        if not isinstance(v, list):
            self.fail(where, f"expected a list, got {type(v).__name__}")
        return v

    def worker_key(self, w, where) -> int:
        """A worker number used as an object key: ASCII digits only ("²" and "٣" are digits to
        str.isdigit but not to int()), at most 7 of them (shard_num < 2**20)."""
        if not (isinstance(w, str) and w.isascii() and w.isdigit() and len(w) <= 7):
            self.fail(where, f"worker key {w!r:.20} is not a worker number")
        return int(w)

    def relpath(self, v, where):
        try:
            return validate_relpath(v, where)
        except ValueError as e:
            self.fail(where, str(e))

    def opt_relpath(self, v, where):
        return None if v is None else self.relpath(v, where)


def manifest_from_json(obj: dict, path: str) -> Manifest:
    v = _V(path)
    if v.get(obj, "format", "") != FORMAT_NAME:
        v.fail("format", f"expected {FORMAT_NAME!r}; this is not a recckpt checkpoint")
    ver = v.int(v.get(obj, "format_version", ""), "format_version")
    if ver not in READABLE_FORMAT_VERSIONS:
        raise IncompatibleCheckpointError(
            f"{path}: format version {ver} is not supported by this recckpt (reads versions "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}); upgrade recckpt to load it")
    for key, want in (("hash", HASH_NAME), ("checksum", "crc32c")):
        if v.get(obj, key, "") != want:
            v.fail(key, f"expected {want!r}")
    tables = {}
    for name, t in v.dict(v.get(obj, "tables", ""), "tables").items():
        where = f"tables[{name!r}]"
        slots = {}
        for i, pair in enumerate(v.list(v.get(t, "slots", where), f"{where}.slots")):
            if not (isinstance(pair, list) and len(pair) == 2):
                v.fail(f"{where}.slots[{i}]", "expected [name, spec]")
            sname, spec = v.str(pair[0], f"{where}.slots[{i}]"), v.dict(pair[1], f"{where}.slots[{i}]")
            dt = v.get(spec, "dtype", f"{where}.{sname}")
            if dt not in dtypes.names():
                v.fail(f"{where}.{sname}.dtype", f"unknown dtype {dt!r:.40}")
            shape = tuple(v.int(d, f"{where}.{sname}.shape", 0, 1 << 31)
                          for d in v.list(v.get(spec, "shape", f"{where}.{sname}"), f"{where}.{sname}.shape"))
            if len(shape) > 8:
                v.fail(f"{where}.{sname}.shape", "more than 8 dimensions")
            cat = v.get(spec, "category", f"{where}.{sname}")
            if cat not in CATEGORIES:
                v.fail(f"{where}.{sname}.category", f"expected one of {CATEGORIES}")
            if sname in slots:
                v.fail(f"{where}.slots", f"slot {sname!r} listed twice")
            slots[sname] = SlotInfo(dt, shape, cat)
        changes = t.get("changes", False)
        if changes is not False and changes is not True:
            v.fail(f"{where}.changes", "expected true or false")
        removed = v.int(t.get("removed", 0), f"{where}.removed")
        if removed and not changes:
            v.fail(f"{where}.removed", "removed ids in a table that is not saved as changes")
        tables[v.str(name, "tables")] = TableInfo(slots, v.int(v.get(t, "rows", where), f"{where}.rows"),
                                                  changes, removed)
    files = {}
    for rel, f in v.dict(v.get(obj, "files", ""), "files").items():
        v.relpath(rel, "files")
        files[rel] = FileInfo(v.int(v.get(f, "size", f"files[{rel!r}]"), f"files[{rel!r}].size"),
                              v.int(v.get(f, "crc32c", f"files[{rel!r}]"), f"files[{rel!r}].crc32c", 0, _U32))
    io_state = {}
    for w, rel in v.dict(v.get(obj, "io_state", ""), "io_state").items():
        io_state[v.worker_key(w, "io_state")] = v.relpath(rel, f"io_state[{w}]")
    meta = v.dict(obj.get("metadata", {}), "metadata")
    worker_steps = {}
    for w, st in v.dict(obj.get("worker_steps", {}), "worker_steps").items():
        worker_steps[v.worker_key(w, "worker_steps")] = v.int(st, f"worker_steps[{w}]", -_I63, _I63)
    parent = None
    if obj.get("parent") is not None:
        p = v.dict(obj["parent"], "parent")
        pid = v.str(v.get(p, "ckpt_id", "parent"), "parent.ckpt_id")
        try:
            validate_ckpt_id(pid)
        except ValueError as e:
            v.fail("parent.ckpt_id", str(e))
        digest = v.str(v.get(p, "manifest_sha256", "parent"), "parent.manifest_sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            v.fail("parent.manifest_sha256", "expected 64 lower-case hex digits")
        if ver < INCREMENTAL_SINCE:
            v.fail("parent", f"format version {ver} has no incremental checkpoints")
        parent = ParentRef(pid, digest)
    elif any(t.changes for t in tables.values()):
        v.fail("tables", "a table holds only changes but the checkpoint names no parent")
    m = Manifest(
        ckpt_id=v.str(v.get(obj, "ckpt_id", ""), "ckpt_id"),
        created_ns=v.int(v.get(obj, "created_ns", ""), "created_ns"),
        writer=v.str(v.get(obj, "writer", ""), "writer"),
        num_buckets=v.int(v.get(obj, "num_buckets", ""), "num_buckets", 1, NUM_BUCKETS_LIMIT),
        chunk_bytes=v.int(v.get(obj, "chunk_bytes", ""), "chunk_bytes", 1, 1 << 31),
        shard_num=v.int(v.get(obj, "shard_num", ""), "shard_num", 1, 1 << 20),
        tables=tables, files=files,
        index=v.opt_relpath(v.get(obj, "index", ""), "index"),
        dense=v.opt_relpath(v.get(obj, "dense", ""), "dense"),
        extras=v.opt_relpath(v.get(obj, "extras", ""), "extras"),
        io_state=io_state,
        metadata={v.str(k, "metadata"): v.str(x, f"metadata[{k!r}]") for k, x in meta.items()},
        worker_steps=worker_steps,
        format_version=ver,
        parent=parent,
    )
    for rel in [m.index, m.dense, m.extras, *m.io_state.values()]:
        if rel is not None and rel not in m.files:
            v.fail("files", f"{rel!r} is referenced but has no size/checksum entry")
    if tables and m.index is None:
        v.fail("index", "the checkpoint has sparse tables but no index")
    if obj.get("digests") is not None:
        m.digests = _digests_from_json(v, v.dict(obj["digests"], "digests"), tables)
    if obj.get("shard_bytes") is not None:
        m.shard_bytes = v.int(obj["shard_bytes"], "shard_bytes")
    return m


def _digests_from_json(v: _V, d: dict, tables: dict[str, TableInfo]) -> Digests | None:
    """The manifest's `digests`; None when they use an algorithm this recckpt does not know (a newer
    writer's: the checkpoint stays readable, its contents are just not comparable by digest)."""
    if v.str(v.get(d, "hash", "digests"), "digests.hash") != DIGEST_NAME:
        return None

    def hex_(x, where):
        try:
            return Digest.from_hex(x)
        except ValueError as e:
            v.fail(where, str(e))

    out = Digests()
    for name, t in v.dict(v.get(d, "tables", "digests"), "digests.tables").items():
        where = f"digests.tables[{name!r}]"
        info = tables.get(name)
        if info is None:
            v.fail(where, "no such table in the manifest")
        rows = v.int(v.get(t, "rows", where), f"{where}.rows")
        if not info.changes and rows != info.rows:
            v.fail(f"{where}.rows", f"{rows}, but the table holds {info.rows} rows")
        slots = v.dict(v.get(t, "slots", where), f"{where}.slots")
        if set(slots) != set(info.slots):   # an object: its keys are stored sorted, not in column order
            v.fail(f"{where}.slots", f"{sorted(slots)} differ from the table's slots {sorted(info.slots)}")
        out.tables[name] = TableDigest(list(info.slots), rows, hex_(v.get(t, "ids", where), f"{where}.ids"),
                                       {s: hex_(slots[s], f"{where}.slots[{s!r}]") for s in info.slots})
    if "dense" in d:
        out.dense = {}
        for key, e in v.dict(d["dense"], "digests.dense").items():
            where = f"digests.dense[{key!r}]"
            dt = v.get(e, "dtype", where)
            if dt not in dtypes.names():
                v.fail(f"{where}.dtype", f"unknown dtype {dt!r:.40}")
            shape = tuple(v.int(x, f"{where}.shape", 0, _I63) for x in v.list(v.get(e, "shape", where), f"{where}.shape"))
            out.dense[v.str(key, "digests.dense")] = DenseDigest(dt, shape, hex_(v.get(e, "digest", where),
                                                                                f"{where}.digest"))
    return out


def index_from_json(obj: dict, path: str, manifest: Manifest | None = None) -> IndexDoc:
    """Validate an index; with a manifest, also check every column length against the slot specs."""
    v = _V(path)
    ver = v.int(v.get(obj, "format_version", ""), "format_version")
    if ver not in READABLE_FORMAT_VERSIONS:
        raise IncompatibleCheckpointError(f"{path}: index format version {ver} is not supported")
    if manifest is not None and ver != manifest.format_version:
        v.fail("format_version", f"{ver} but the manifest says {manifest.format_version}")
    nb = v.int(v.get(obj, "num_buckets", ""), "num_buckets", 1, NUM_BUCKETS_LIMIT)
    cb = v.int(v.get(obj, "chunk_bytes", ""), "chunk_bytes", 1, 1 << 31)
    if manifest is not None and (nb, cb) != (manifest.num_buckets, manifest.chunk_bytes):
        v.fail("num_buckets/chunk_bytes", "disagree with the manifest")
    doc = IndexDoc(nb, cb, format_version=ver)
    for i, f in enumerate(v.list(v.get(obj, "files", ""), "files")):
        doc.files.append((v.relpath(v.get(f, "path", f"files[{i}]"), f"files[{i}].path"),
                          v.int(v.get(f, "size", f"files[{i}]"), f"files[{i}].size")))
    nfiles = len(doc.files)

    def column(c, where, exact_len=None, one_crc=False):
        off = v.int(v.get(c, "offset", where), f"{where}.offset")
        ln = v.int(v.get(c, "length", where), f"{where}.length")
        crcs = tuple(v.int(x, f"{where}.crc32c", 0, _U32)
                     for x in (v.list(v.get(c, "crc32c", where), f"{where}.crc32c")
                               if not one_crc else [v.get(c, "crc32c", where)]))
        if exact_len is not None and ln != exact_len:
            v.fail(f"{where}.length", f"{ln} but the rows and slot shape imply {exact_len}")
        if not one_crc and len(crcs) != -(-ln // cb):
            v.fail(f"{where}.crc32c", f"{len(crcs)} checksums for {ln} bytes in {cb}-byte chunks")
        return Column(off, ln, crcs)

    def segment(s, sw, slots, row_bytes):
        """One segment of `slots` (row_bytes: [8, per slot] or None when unknown), validated."""
        fi = v.int(v.get(s, "file", sw), f"{sw}.file", 0, max(nfiles, 1))
        if fi >= nfiles:
            v.fail(f"{sw}.file", "no such file")
        rows = v.int(v.get(s, "rows", sw), f"{sw}.rows")
        buckets = column(v.get(s, "buckets", sw), f"{sw}.buckets", 8 * (nb + 1), one_crc=True)
        cols_raw = v.list(v.get(s, "columns", sw), f"{sw}.columns")
        if len(cols_raw) != len(slots) + 1:
            v.fail(f"{sw}.columns", f"{len(cols_raw)} columns for ids + {len(slots)} slots")
        cols = tuple(column(c, f"{sw}.columns[{k}]",
                            None if row_bytes is None else rows * row_bytes[k])
                     for k, c in enumerate(cols_raw))
        if row_bytes is None and cols[0].length != 8 * rows:
            v.fail(f"{sw}.columns[0].length", "ids column length is not 8 * rows")
        size = doc.files[fi][1]
        for k, c in enumerate((buckets,) + cols):
            if c.offset + c.length > size:
                v.fail(sw, f"block {k} [{c.offset}, {c.offset + c.length}) lies beyond the end of "
                           f"{doc.files[fi][0]} ({size} bytes)")
        if ver >= layout.ALIGNED_FROM_VERSION:
            for k, c in enumerate(cols[1:], 1):
                want = layout.column_start(cols[k - 1].offset + cols[k - 1].length, k, c.length, ver)
                if c.offset != want:
                    v.fail(f"{sw}.columns[{k}].offset", f"{c.offset}, expected {want}: in format version {ver} "
                                                        f"a slot column follows the previous column, padded "
                                                        f"to a multiple of {layout.COLUMN_ALIGN} when not empty")
        return Segment(fi, rows, buckets, cols)

    for name, t in v.dict(v.get(obj, "tables", ""), "tables").items():
        where = f"tables[{name!r}]"
        slots = [v.str(s, f"{where}.slots") for s in v.list(v.get(t, "slots", where), f"{where}.slots")]
        row_bytes = None
        if manifest is not None:
            info = manifest.tables.get(name)
            if info is None:
                v.fail(where, "table is not in the manifest")
            if slots != list(info.slots):
                v.fail(f"{where}.slots", f"{slots} disagree with the manifest's {list(info.slots)}")
            row_bytes = [8] + [info.slots[s].row_bytes for s in slots]
        segs = [segment(s, f"{where}.segments[{j}]", slots, row_bytes)
                for j, s in enumerate(v.list(v.get(t, "segments", where), f"{where}.segments"))]
        if "removed" in t:
            if ver < INCREMENTAL_SINCE:
                v.fail(f"{where}.removed", f"format version {ver} has no removed ids")
            doc.removed[name] = [segment(s, f"{where}.removed[{j}]", [], [8])
                                 for j, s in enumerate(v.list(t["removed"], f"{where}.removed"))]
        doc.tables[name] = (slots, segs)
    if manifest is not None and manifest.shard_bytes is not None and manifest.shard_bytes != sum(n for _, n in doc.files):
        v.fail("files", f"shard files of {sum(n for _, n in doc.files)} bytes, the manifest's shard_bytes says "
                        f"{manifest.shard_bytes}")
    if manifest is not None:
        for name, info in manifest.tables.items():
            if name not in doc.tables:
                v.fail("tables", f"table {name!r} of the manifest has no index entry")
            rows = sum(s.rows for s in doc.tables[name][1])
            if rows != info.rows:
                v.fail(f"tables[{name!r}]", f"segments hold {rows} rows, the manifest says {info.rows}")
            gone = sum(s.rows for s in doc.removed.get(name, []))
            if gone != info.removed:
                v.fail(f"tables[{name!r}].removed", f"segments hold {gone} removed ids, the manifest says "
                                                    f"{info.removed}")
    return doc
