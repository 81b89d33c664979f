"""Manifest and index: typed records, built by the writer and validated field by field on read.

docs/FORMAT.md states the same schema in prose; change both together. Validation raises
CorruptCheckpointError naming the file and the field, so a garbled or hostile file is rejected before
any offset in it is used.
"""
from __future__ import annotations

import binascii
import re
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from . import dtypes, layout
from .digest import DIGEST_NAME, DenseDigest, Digest, Digests, ParsedTableDigests, TableDigest
from .geometry import GROUP_WIDTH, TableGeometry
from .hashing import HASH_NAME, NUM_BUCKETS_LIMIT
from .names import (
    COLUMN_GROUPS_SINCE,
    FORMAT_NAME,
    FORMAT_VERSION,
    INCREMENTAL_SINCE,
    READABLE_FORMAT_VERSIONS,
    SEGMENT_DIR_SINCE,
    validate_ckpt_id,
    validate_relpath,
)

CATEGORIES = ("sparse", "sparse_opt")
_U32 = 1 << 32
_I63 = 1 << 63

#: Format version 4's per-table bucket functions (docs/FORMAT.md, Buckets and ownership).
BUCKET_FNS = ("hash", "row_range", "id_range")
#: A row_range table has fewer rows than this, so that row * B fits an int64 (B < 2**24).
MAX_ROW_RANGE_ROWS = 1 << 40


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

    def row_bytes_for(self, width: int | None) -> int:
        """Bytes of one row when only `width` entries of the last dim are stored (a split slot of a
        column block); None: the whole row."""
        if width is None:
            return self.row_bytes
        n = dtypes.itemsize(self.dtype)
        for d in self.shape[:-1]:
            n *= d
        return n * width

    def to_json(self):
        return {"dtype": self.dtype, "shape": list(self.shape), "category": self.category}


@dataclass(frozen=True)
class ColumnBlocks:
    """Format version 4: a table saved column-split. `slots` are the split slots (same last dim D);
    `blocks` the [c0, c1) ranges of that dim, sorted, partitioning [0, D)."""
    slots: tuple[str, ...]
    blocks: tuple[tuple[int, int], ...]

    def width(self, block: int) -> int:
        c0, c1 = self.blocks[block]
        return c1 - c0

    def to_json(self):
        return {"slots": list(self.slots), "blocks": [list(b) for b in self.blocks]}


@dataclass(frozen=True)
class ColumnGroups:
    """Format version 5: the split slots of a row_range table (each of shape (D,)) stored as one column per
    group of `width` columns of D (the last group of a column block may be narrower), so that a reader of
    columns [a, b) reads only the groups overlapping them (docs/FORMAT.md, Column groups)."""
    slots: tuple[str, ...]
    width: int

    def to_json(self):
        return {"slots": list(self.slots), "width": self.width}


def column_groups_for(split: tuple[str, ...], dim: int) -> ColumnGroups | None:
    """The column groups recckpt writes for a fixed-size table whose split slots (shape (dim,)) are `split`:
    groups of `geometry.GROUP_WIDTH` columns (of `dim`, when that is smaller); None without split slots."""
    return ColumnGroups(tuple(split), min(GROUP_WIDTH, dim)) if split else None


@dataclass(frozen=True)
class TableInfo:
    slots: dict[str, SlotInfo]  # in column order
    rows: int
    changes: bool = False       # incremental: only rows changed since the parent (+ removed ids)
    removed: int = 0            # ids removed since the parent (only with changes)
    bucket_fn: str = "hash"     # format version 4: "hash" | "row_range"
    num_rows: int = 0           # row_range: N, the logical rows (ids are 0..N-1)
    column_blocks: ColumnBlocks | None = None  # format version 4: saved column-split
    input_size: int = 0         # id_range: H, ids [0, H) are bucketed by range (the rest: bucket B-1)
    column_groups: ColumnGroups | None = None  # format version 5: split slots stored by column group

    def bucket_args(self) -> dict:
        """The keyword arguments of `_C.bucket_of` that select this table's bucket function."""
        return {"num_rows": self.num_rows if self.bucket_fn == "row_range" else 0,
                "id_range": self.input_size if self.bucket_fn == "id_range" else 0}

    def to_json(self, format_version: int = FORMAT_VERSION):
        out = {"slots": [[k, v.to_json()] for k, v in self.slots.items()], "rows": self.rows}
        if self.changes:
            out.update(changes=True, removed=self.removed)
        if format_version >= SEGMENT_DIR_SINCE:
            out["bucket_fn"] = self.bucket_fn
            if self.bucket_fn == "row_range":
                out["num_rows"] = self.num_rows
            if self.bucket_fn == "id_range":
                out["input_size"] = self.input_size
            if self.column_blocks is not None:
                out["column_blocks"] = self.column_blocks.to_json()
        if format_version >= COLUMN_GROUPS_SINCE and self.column_groups is not None:
            out["column_groups"] = self.column_groups.to_json()
        return out

    def geometry(self, format_version: int = FORMAT_VERSION) -> TableGeometry:
        """Where each slot lies among a segment's columns (format/geometry.py); in format version 5 a
        row_range table's segments may be row runs."""
        runs = self.num_rows if self.bucket_fn == "row_range" and format_version >= COLUMN_GROUPS_SINCE else 0
        return TableGeometry.shared(self.slots, self.column_blocks, self.column_groups, runs)


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
            "tables": {k: v.to_json(self.format_version) for k, v in self.tables.items()},
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
    crc32c: tuple[int, ...]   # one per checksum step (a tuple, or in version 4 a uint32 array)
    step: int = 0             # bytes per CRC; 0: the index's chunk_bytes (versions 1 to 3)

    def to_json(self):
        return {"offset": self.offset, "length": self.length, "crc32c": [int(c) for c in self.crc32c]}


@dataclass(frozen=True, eq=False)
class Segment:
    file: int                 # index into IndexDoc.files
    rows: int
    buckets: Column           # versions 1-3: int64[B+1] row offsets; 4: the bucket directory (one CRC)
    columns: tuple[Column, ...]  # [ids, slot 0, slot 1, ...]
    dir_entries: int = 0      # version 4: entries of the bucket directory; 0: a version 1-3 offsets block
    first: int = 0            # version 4: first and last bucket holding rows (versions 1-3: 0, B-1)
    last: int = -1
    packed: bool = False      # version 4: no alignment padding
    block: int = 0            # version 4: column block (tables with column_blocks)
    id0: int = -1             # version 5: >= 0: a row run, ids [id0, id0 + rows), no ids or directory stored

    @property
    def offset(self) -> int:
        """Where the segment starts in its file (its first block)."""
        return self.buckets.offset

    @property
    def is_run(self) -> bool:
        """Format version 5: the segment's ids are [id0, id0 + rows) in order, stored nowhere."""
        return self.id0 >= 0

    def pad_before(self, k: int, format_version: int) -> int:
        """Zero bytes before column k (the rule: `layout.pad_before`)."""
        if k == 0:
            return 0
        prev = self.columns[k - 1]
        return layout.pad_before(prev.offset + prev.length, self.columns[k].offset, k, format_version)

    def key(self) -> tuple:
        """Everything the index records of the segment (equality of indexes)."""
        return (self.file, self.rows, self.buckets.offset, self.buckets.length, tuple(self.buckets.crc32c),
                self.dir_entries, self.first, self.last, self.packed, self.block, self.id0,
                tuple((c.offset, c.length, c.step, tuple(int(x) for x in c.crc32c)) for c in self.columns))

    def to_json(self):
        b = self.buckets
        return {"file": self.file, "rows": self.rows,
                "buckets": {"offset": b.offset, "length": b.length, "crc32c": int(b.crc32c[0])},
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
    blocked: set[str] = field(default_factory=set)   # version 4: tables whose segments carry a column block
    geometry: dict[str, TableGeometry] = field(default_factory=dict)   # known tables' columns (version 4+)

    def geometry_of(self, table: str) -> TableGeometry:
        """Where each slot of `table` lies among its segments' columns (one column each when not known:
        versions 1 to 3)."""
        g = self.geometry.get(table)
        return g if g is not None else TableGeometry.plain(self.tables[table][0])

    def to_json(self) -> dict:
        if self.format_version >= SEGMENT_DIR_SINCE:
            return self._to_json_v4()
        return {
            "format_version": self.format_version, "num_buckets": self.num_buckets,
            "chunk_bytes": self.chunk_bytes,
            "files": [{"path": p, "size": s} for p, s in self.files],
            "tables": {k: {"slots": list(slots), "segments": [s.to_json() for s in segs],
                           **({"removed": [s.to_json() for s in self.removed[k]]} if k in self.removed else {})}
                       for k, (slots, segs) in self.tables.items()},
        }

    def _to_json_v4(self) -> dict:
        blocked = self.blocked
        tables = {}
        for name, (slots, segs) in self.tables.items():
            runs = self.format_version >= COLUMN_GROUPS_SINCE and self.geometry_of(name).runs
            t = {"slots": list(slots), "segments": _segs_to_json(segs, True, name in blocked, runs)}
            if name in self.removed:
                t["removed"] = _segs_to_json(self.removed[name], False, False)
            tables[name] = t
        return {"format_version": self.format_version, "num_buckets": self.num_buckets,
                "chunk_bytes": self.chunk_bytes, "files": [{"path": p, "size": s} for p, s in self.files],
                "tables": tables}

    @staticmethod
    def merge(parts: list["IndexDoc"]) -> "IndexDoc":
        """One index for the checkpoint: files concatenated in worker order, segments re-pointed."""
        if not parts:
            raise ValueError("nothing to merge")
        out = IndexDoc(parts[0].num_buckets, parts[0].chunk_bytes, format_version=parts[0].format_version)
        for p in parts:
            if (p.num_buckets, p.chunk_bytes, p.format_version) != (out.num_buckets, out.chunk_bytes,
                                                                     out.format_version):
                raise ValueError("worker indexes disagree on num_buckets/chunk_bytes/format_version")
            base = len(out.files)
            out.files.extend(p.files)
            out.blocked |= p.blocked
            for name, g in p.geometry.items():
                if out.geometry.setdefault(name, g) != g:
                    raise ValueError(f"table {name!r}: workers wrote it with different columns")
            for name, (slots, segs) in p.tables.items():
                have = out.tables.setdefault(name, (list(slots), []))
                if have[0] != list(slots):
                    raise ValueError(f"table {name!r}: workers wrote different slots {have[0]} vs {slots}")
                have[1].extend(segs if base == 0 else (replace(s, file=s.file + base) for s in segs))
            for name, segs in p.removed.items():
                out.removed.setdefault(name, []).extend(replace(s, file=s.file + base) for s in segs)
        return out


def _hex(crcs) -> str:
    return np.asarray(crcs, dtype=">u4").tobytes().hex()


def _segs_to_json(segs: list[Segment], with_packed: bool, with_block: bool, with_id0: bool = False) -> dict:
    """Version 4's SEGS (and version 5's, with `id0` for a row_range table): the segments as parallel lists
    and one string of CRCs."""
    out = {"file": [s.file for s in segs], "offset": [s.offset for s in segs], "rows": [s.rows for s in segs],
           "dir": [s.dir_entries for s in segs], "first": [s.first for s in segs], "last": [s.last for s in segs]}
    if with_packed:
        out["packed"] = [int(s.packed) for s in segs]
    if with_block:
        out["block"] = [s.block for s in segs]
    if with_id0:
        out["id0"] = [s.id0 for s in segs]
    # every CRC of the table in one string: its segments in turn, each its directory's (none in a run) then
    # its columns'
    crcs = [c for s in segs for c in (s.buckets.crc32c, *(col.crc32c for col in s.columns))]
    out["crc32c"] = _hex(np.concatenate(crcs)) if crcs else ""
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
    """A manifest, validated (tables in the common form through `_table_info_fast`: the same rules, checked
    once per distinct slot layout)."""
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
    tables, layouts = {}, _SlotLayouts()
    for name, t in v.dict(v.get(obj, "tables", ""), "tables").items():
        info = _table_info_fast(name, t, ver, layouts)   # the common form, or None: the rules
        tables[name] = info if info is not None else _table_from_json(v, name, t, ver)
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


def _table_from_json(v: _V, name, t, ver: int) -> TableInfo:
    """One table of a manifest, field by field."""
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
    bucket_fn, num_rows, blocks, input_size = _table_v4_fields(v, t, where, ver, slots)
    groups = _column_groups(v, t, where, ver, slots, bucket_fn, blocks)
    info = TableInfo(slots, v.int(v.get(t, "rows", where), f"{where}.rows"), changes, removed, bucket_fn,
                     num_rows, blocks, input_size, groups)
    v.str(name, "tables")
    return info


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
    raw = v.dict(v.get(d, "tables", "digests"), "digests.tables")
    fast = _table_digests_fast(raw, tables)   # the common form, or None: the rules below
    for name, t in raw.items() if fast is None else ():
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
    if fast is not None:
        out.tables = fast
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


def _check_shard_bytes(v: _V, doc: IndexDoc, manifest: Manifest) -> None:
    """The merged index's shard files add up to the manifest's `shard_bytes`, where it records them."""
    total = sum(n for _, n in doc.files)
    if manifest.shard_bytes is not None and manifest.shard_bytes != total:
        v.fail("files", f"shard files of {total} bytes, the manifest's shard_bytes says {manifest.shard_bytes}")


def _table_v4_fields(v: _V, t: dict, where: str, ver: int, slots: dict[str, SlotInfo]):
    """A manifest table's version 4 fields: (bucket_fn, num_rows, column_blocks, input_size)."""
    if ver < SEGMENT_DIR_SINCE:
        for key in ("bucket_fn", "num_rows", "column_blocks", "input_size"):
            if key in t:
                v.fail(f"{where}.{key}", f"not a field of format version {ver}")
        return "hash", 0, None, 0
    fn = v.get(t, "bucket_fn", where)
    if fn not in BUCKET_FNS:
        v.fail(f"{where}.bucket_fn", f"expected one of {BUCKET_FNS}, got {fn!r:.40}")
    num_rows = 0
    if fn == "row_range":
        num_rows = v.int(v.get(t, "num_rows", where), f"{where}.num_rows", 1, MAX_ROW_RANGE_ROWS)
    elif "num_rows" in t:
        v.fail(f"{where}.num_rows", "only a row_range table has num_rows")
    input_size = 0
    if fn == "id_range":
        input_size = v.int(v.get(t, "input_size", where), f"{where}.input_size", 1, _I63)
    elif "input_size" in t:
        v.fail(f"{where}.input_size", "only an id_range table has input_size")
    if fn == "id_range" and "column_blocks" in t:
        v.fail(f"{where}.column_blocks", "an id_range table is not saved column-split")
    blocks = None
    if "column_blocks" in t:
        cw = f"{where}.column_blocks"
        cb = v.dict(t["column_blocks"], cw)
        names = [v.str(x, f"{cw}.slots") for x in v.list(v.get(cb, "slots", cw), f"{cw}.slots")]
        if not names or len(set(names)) != len(names) or any(n not in slots for n in names):
            v.fail(f"{cw}.slots", "expected distinct slots of the table, at least one")
        dims = {slots[n].shape[-1] if slots[n].shape else None for n in names}
        if len(dims) != 1 or None in dims:
            v.fail(f"{cw}.slots", "split slots need a shape of at least one dim and the same last dim")
        d = dims.pop()
        out, pos = [], 0
        for i, b in enumerate(v.list(v.get(cb, "blocks", cw), f"{cw}.blocks")):
            if not (isinstance(b, list) and len(b) == 2):
                v.fail(f"{cw}.blocks[{i}]", "expected [c0, c1]")
            c0, c1 = v.int(b[0], f"{cw}.blocks[{i}]"), v.int(b[1], f"{cw}.blocks[{i}]")
            if c0 != pos or c1 <= c0:
                v.fail(f"{cw}.blocks[{i}]", f"[{c0}, {c1}): blocks must be sorted, non-empty and contiguous from 0")
            out.append((c0, c1))
            pos = c1
        if pos != d or not out:
            v.fail(f"{cw}.blocks", f"blocks must partition [0, {d}) of the split slots' last dim")
        blocks = ColumnBlocks(tuple(names), tuple(out))
    return fn, num_rows, blocks, input_size


def _column_groups(v: _V, t: dict, where: str, ver: int, slots: dict[str, SlotInfo], bucket_fn: str,
                   blocks: ColumnBlocks | None) -> ColumnGroups | None:
    """A manifest table's version 5 `column_groups`, validated (docs/FORMAT.md, Column groups)."""
    if "column_groups" not in t:
        return None
    cw = f"{where}.column_groups"
    if ver < COLUMN_GROUPS_SINCE:
        v.fail(cw, f"not a field of format version {ver}")
    if bucket_fn != "row_range":
        v.fail(cw, "only a row_range table stores column groups")
    cg = v.dict(t["column_groups"], cw)
    extra = set(cg) - {"slots", "width"}
    if extra:
        v.fail(cw, f"unknown fields {sorted(extra)!r:.80}")
    names = [v.str(x, f"{cw}.slots") for x in v.list(v.get(cg, "slots", cw), f"{cw}.slots")]
    if not names or len(set(names)) != len(names) or any(n not in slots for n in names):
        v.fail(f"{cw}.slots", "expected distinct slots of the table, at least one")
    dims = {slots[n].shape for n in names}
    if len(dims) != 1 or len(next(iter(dims))) != 1 or next(iter(dims))[0] < 1:
        v.fail(f"{cw}.slots", "grouped slots need the same shape (D,) with D >= 1")
    d = next(iter(dims))[0]
    width = v.int(v.get(cg, "width", cw), f"{cw}.width", 1, d + 1)
    if blocks is not None and tuple(blocks.slots) != tuple(names):
        v.fail(cw, f"slots {names} differ from column_blocks' {list(blocks.slots)}: a table splits one set of slots")
    return ColumnGroups(tuple(names), width)


def index_from_json(obj: dict, path: str, manifest: Manifest | None = None, *, worker: bool = False) -> IndexDoc:
    """Validate an index; with a manifest, also check every column length against the slot specs.
    `worker`: a worker's own index (sparse/worker-W.index.json), whose tables hold that worker's rows
    only: its row counts are not compared with the manifest's. A version 4 index needs the manifest
    (its column lengths follow from the slot specs)."""
    v = _V(path)
    if worker and obj.get("format_version") != FORMAT_VERSION and not (
            isinstance(obj.get("format_version"), int) and obj["format_version"] >= SEGMENT_DIR_SINCE):
        manifest = None   # versions 1-3: a worker index is checked on its own
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
    if ver >= SEGMENT_DIR_SINCE:
        return _index_v4(v, obj, doc, manifest, worker)

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
        cols = tuple(replace(column(c, f"{sw}.columns[{k}]", None if row_bytes is None else rows * row_bytes[k]),
                             step=cb)
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
        return Segment(fi, rows, replace(buckets, step=max(buckets.length, 1)), cols, 0, 0, nb - 1)

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
    if manifest is not None and not worker:
        _check_shard_bytes(v, doc, manifest)
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


# ------------------------------------------------------------------------------ version 4 index
def _crcs_from_hex(text: str) -> np.ndarray | None:
    """CRC32Cs written as 8 lower-case hex digits each, as uint32; None where `text` holds any other
    character (or is not a whole number of CRCs). `unhexlify` refuses anything but hex digits, and writing
    the bytes back as hex matches the text only where every digit was lower case: two passes in C, where a
    regular expression costs ten times more on the megabytes of CRCs an index of many tables holds."""
    if len(text) % 8 or not text.isascii():
        return None
    try:
        raw = binascii.unhexlify(text)
    except binascii.Error:
        return None
    if raw.hex() != text:
        return None
    return np.frombuffer(raw, dtype=">u4").astype(np.uint32)


_SEG_KEYS = ("file", "offset", "rows", "dir", "first", "last")


def _int_array(v: _V, raw, where: str, n: int | None) -> np.ndarray:
    """A JSON list of integers as int64, checked in one vectorised step (no per-element Python)."""
    lst = v.list(raw, where)
    if n is not None and len(lst) != n:
        v.fail(where, f"{len(lst)} entries, the other lists have {n}")
    if not lst:
        return np.zeros(0, dtype=np.int64)
    try:
        a = np.asarray(lst)
    except (OverflowError, ValueError, TypeError):
        v.fail(where, "expected a list of integers")
    if a.ndim != 1 or a.dtype.kind not in "iu" or a.dtype.itemsize > 8:
        v.fail(where, "expected a list of integers")
    if a.dtype.kind == "u" and a.size and a.max() >= _I63:
        v.fail(where, "an integer beyond 2**63")
    return a.astype(np.int64, copy=False)


@dataclass
class _SegArrays:
    """One table's SEGS after the vectorised checks (phase 1), before its CRCs are decoded."""
    where: str
    raw: dict
    a: dict[str, np.ndarray]
    packed: np.ndarray
    block: np.ndarray
    id0: np.ndarray        # [s] version 5: first id of a row run, -1 for a segment storing its ids
    starts: np.ndarray     # [s, ncols] column offsets
    lengths: np.ndarray    # [s, ncols] (columns past a segment's block's count have length 0)
    ends: np.ndarray       # [s] where each segment ends
    ncols: list[int]       # columns of a segment of each block (ids first)
    rows_total: int | None = None   # rows of every segment together (None: summed here)

    def __post_init__(self):
        if self.rows_total is None:
            self.rows_total = int(self.a["rows"].sum())


def _segs_v4(v: _V, raw, where: str, doc: IndexDoc, geo: TableGeometry | None,
             with_packed: bool, with_block: bool, nblocks: int) -> _SegArrays:
    """Phase 1 of one table's SEGS, vectorised (no per-segment Python): list lengths, ranges, column
    positions by the layout rule, each segment inside its file. `geo`: the table's columns per column
    block (format/geometry.py); None for removed ids (one column, the ids). Version 5: a row_range table's
    segments carry `id0`, and a row run (id0 >= 0) stores no directory and no ids."""
    seg = v.dict(raw, where)
    a = {k: _int_array(v, v.get(seg, k, where), f"{where}.{k}", None if k == "file" else len(seg["file"]))
         for k in _SEG_KEYS}
    s = len(a["file"])
    runs = geo is not None and geo.runs and doc.format_version >= COLUMN_GROUPS_SINCE
    packed = (_int_array(v, v.get(seg, "packed", where), f"{where}.packed", s) if with_packed
              else np.zeros(s, dtype=np.int64))
    block = (_int_array(v, v.get(seg, "block", where), f"{where}.block", s) if with_block
             else np.zeros(s, dtype=np.int64))
    id0 = (_int_array(v, v.get(seg, "id0", where), f"{where}.id0", s) if runs
           else np.full(s, -1, dtype=np.int64))
    for key, present in (("packed", with_packed), ("block", with_block), ("id0", runs)):
        if key in seg and not present:
            v.fail(f"{where}.{key}", "not a field of these segments")
    extra = set(seg) - set(_SEG_KEYS) - {"packed", "block", "id0", "crc32c"}
    if extra:
        v.fail(where, f"unknown fields {sorted(extra)!r:.80}")
    nb, nfiles = doc.num_buckets, len(doc.files)

    def check(ok: np.ndarray, key: str, rule: str) -> None:
        if not ok.all():
            i = int(np.argmin(ok))
            v.fail(f"{where}.{key}[{i}]", f"{rule}")

    run = id0 >= 0
    check((a["file"] >= 0) & (a["file"] < nfiles), "file", f"not a file of the index ({nfiles} files)")
    check(a["offset"] >= 0, "offset", "negative")
    check((a["rows"] >= 1) & (a["rows"] < _U32), "rows", "expected 1 <= rows < 2**32")
    check(run | ((a["dir"] >= 1) & (a["dir"] <= np.minimum(a["rows"], nb))), "dir",
          "expected 1 <= dir <= min(rows, B)")
    check((a["first"] >= 0) & (a["first"] <= a["last"]) & (a["last"] < nb), "first",
          "expected 0 <= first <= last < B")
    check(a["last"] - a["first"] + 1 >= a["dir"], "dir", "more directory entries than buckets in [first, last]")
    check((packed == 0) | (packed == 1), "packed", "expected 0 or 1")
    check((block >= 0) & (block < max(nblocks, 1)), "block", "not a column block of the table")
    if runs:
        n_rows = geo.num_rows
        check(id0 >= -1, "id0", "expected -1 (ids stored) or the first id of a row run")
        check(~run | (a["dir"] == 0), "dir", "a row run (id0 >= 0) has no directory: expected 0")
        # (id0 + rows could wrap in int64 for a hostile id0 near 2**63; N - rows cannot)
        check(~run | (id0 <= n_rows - a["rows"]), "id0", f"the row run passes the table's {n_rows} rows")
        u0 = np.where(run, id0, 0).astype(np.uint64)
        last_id = np.where(run, id0 + a["rows"] - 1, 0).astype(np.uint64)
        b0 = (u0 * np.uint64(nb) // np.uint64(n_rows)).astype(np.int64)   # < 2**64: exact in uint64
        b1 = (last_id * np.uint64(nb) // np.uint64(n_rows)).astype(np.int64)
        check(~run | ((a["first"] == b0) & (a["last"] == b1)), "first",
              "a row run's first and last buckets are those of its first and last ids")
        # Each id once per column block: the runs of a block must not overlap (explicit ids are checked
        # by the loaders, which read them).
        r = np.nonzero(run)[0]
        order = r[np.lexsort((id0[r], block[r]))]
        same = block[order][1:] == block[order][:-1]
        ends = id0[order][:-1] + a["rows"][order][:-1]
        if np.any(same & (id0[order][1:] < ends)):
            i = int(order[1:][np.argmax(same & (id0[order][1:] < ends))])
            v.fail(f"{where}.id0[{i}]", "row runs of one column block overlap: each row is stored once")
    widths = [[8]] if geo is None else [geo.widths(j) for j in range(max(nblocks, 1))]
    aligned = [[False]] if geo is None else [geo.begins_slot(j) for j in range(max(nblocks, 1))]
    ncols = [len(w) for w in widths]
    width = max(ncols)
    if any(x * (_U32 - 1) >= (1 << 62) for rbs in widths for x in rbs):
        v.fail(where, "a slot row is too large for any segment")
    rb = np.asarray([w + [0] * (width - len(w)) for w in widths], dtype=np.int64)[block]     # [s, ncols]
    al = np.asarray([x + [False] * (width - len(x)) for x in aligned], dtype=bool)[block]   # [s, ncols]
    lengths = a["rows"][:, None] * rb                          # < 2**62 (checked above)
    lengths[run, 0] = 0                                        # a run stores no ids
    starts = np.empty_like(lengths)
    pos = a["offset"] + 8 * a["dir"]
    check(pos < (1 << 62), "offset", "beyond any file")
    unpadded = packed.astype(bool)
    for k in range(width):
        ln = lengths[:, k]
        starts[:, k] = np.where(unpadded | (ln == 0) | ~al[:, k], pos, layout.align_up(pos))
        pos = starts[:, k] + lengths[:, k]
        check(pos < (1 << 62), "offset", "beyond any file")
    sizes = np.asarray([sz for _, sz in doc.files], dtype=np.int64)
    if s:
        check(pos <= sizes[a["file"]], "offset", "the segment ends beyond its file")
    return _SegArrays(where, seg, a, packed, block, id0, starts, lengths, pos, ncols)


def _tiling_v4(v: _V, doc: IndexDoc, parts: list[_SegArrays]) -> None:
    """The segments of every table tile each shard file exactly (docs/FORMAT.md, Tiling), checked on
    the arrays before anything per segment is built: a segment listed twice, overlapping or leaving a
    gap is refused in one vectorised pass, naming the file."""
    nfiles = len(doc.files)
    if not parts:
        fi = off = end = np.zeros(0, dtype=np.int64)
    else:
        fi = np.concatenate([p.a["file"] for p in parts])
        off = np.concatenate([p.a["offset"] for p in parts])
        end = np.concatenate([p.ends for p in parts])
    order = np.lexsort((end, off, fi))
    fi, off, end = fi[order], off[order], end[order]
    first = np.ones(len(fi), dtype=bool)
    first[1:] = fi[1:] != fi[:-1]
    want = np.zeros(len(fi), dtype=np.int64)
    want[1:] = end[:-1]
    want[first] = 0
    last_end = np.zeros(nfiles, dtype=np.int64)
    if len(fi):
        last = np.ones(len(fi), dtype=bool)
        last[:-1] = fi[:-1] != fi[1:]
        last_end[fi[last]] = end[last]
    sizes = np.asarray([sz for _, sz in doc.files], dtype=np.int64)
    bad = np.nonzero(off != want)[0]
    short = np.nonzero(last_end != sizes)[0]
    if bad.size or short.size:
        f = int(fi[bad[0]]) if bad.size and (not short.size or fi[bad[0]] <= short[0]) else int(short[0])
        nbad = int(np.count_nonzero(fi[bad] == f)) if bad.size else 0
        parts_msg = []
        if nbad:
            i = int(bad[np.argmax(fi[bad] == f)])
            parts_msg.append(f"{nbad} segment(s) overlap, repeat or leave a gap (one at [{off[i]}, {end[i]}) "
                             f"where byte {want[i]} was due)")
        if last_end[f] != sizes[f]:
            parts_msg.append(f"the segments end at byte {last_end[f]} of {sizes[f]}")
        files_bad = len(set(fi[bad].tolist()) | set(short.tolist()))
        more = f" (and {files_bad - 1} more shard files)" if files_bad > 1 else ""
        v.fail("files", f"{doc.files[f][0]}: the index's segments do not tile the file: {'; '.join(parts_msg)}"
                        f"{more}. Every byte of a shard file belongs to exactly one segment; the index is corrupt "
                        f"or hostile")


def _segments_from(v: _V, doc: IndexDoc, p: _SegArrays) -> list[Segment]:
    """Phase 2: decode the table's CRC string and build its Segment records."""
    steps = layout.checksum_steps(p.lengths, doc.chunk_bytes)
    has_dir = (p.id0 < 0).astype(np.int64)   # the directory's CRC (a run has none), then the columns'
    counts = has_dir + layout.crc_count(p.lengths, steps).sum(axis=1)
    text = v.str(v.get(p.raw, "crc32c", p.where), f"{p.where}.crc32c")
    total = int(counts.sum())
    crcs = _crcs_from_hex(text) if len(text) == 8 * total else None
    if crcs is None:
        v.fail(f"{p.where}.crc32c", f"expected {total} CRCs as {8 * total} lower-case hex digits, got "
                                    f"{len(text)} characters")
    a = {k: x.tolist() for k, x in p.a.items()}
    packed_l, block_l, id0_l, dir_l = p.packed.tolist(), p.block.tolist(), p.id0.tolist(), has_dir.tolist()
    starts_l, lengths_l, steps_l = p.starts.tolist(), p.lengths.tolist(), steps.tolist()
    ends_l = np.cumsum(counts).tolist()
    out = []
    lo = 0
    for i in range(len(a["file"])):
        c = lo + dir_l[i]
        cols = []
        for k in range(p.ncols[block_l[i]]):
            ln, st = lengths_l[i][k], steps_l[i][k]
            m = -(-ln // st)
            cols.append(Column(starts_l[i][k], ln, crcs[c:c + m], st))
            c += m
        off, k_dir = a["offset"][i], a["dir"][i]
        out.append(Segment(a["file"][i], a["rows"][i], Column(off, 8 * k_dir, crcs[lo:lo + dir_l[i]], 8 * k_dir),
                           tuple(cols), k_dir, a["first"][i], a["last"][i], bool(packed_l[i]), block_l[i],
                           id0_l[i]))
        lo = ends_l[i]
    return out


def _index_v4(v: _V, obj: dict, doc: IndexDoc, manifest: Manifest | None, worker: bool) -> IndexDoc:
    tables = v.dict(v.get(obj, "tables", ""), "tables")
    if manifest is None:
        if tables:
            v.fail("tables", "a version 4 index is validated against its manifest (its slot specs)")
        return doc
    # Phase 1: fields, ranges, where every segment ends, row counts; every table at once, or (when
    # anything is wrong) table by table, which finds and words the first problem.
    phase1 = _phase1_all_tables(v, tables, doc, manifest, worker)
    if phase1 is None:
        phase1 = _phase1_by_table(v, tables, doc, manifest, worker)
    if not worker:
        for name in manifest.tables:
            if name not in tables:
                v.fail("tables", f"table {name!r} of the manifest has no index entry")
        _check_shard_bytes(v, doc, manifest)
    _tiling_v4(v, doc, [p for _, _, segs, rem, _ in phase1 for p in (segs, rem) if p is not None])
    # Phase 2: the CRCs, and the records the readers use: every table at once when all pass, else table by
    # table (which finds and words the first problem).
    parts = [p for _, _, segs, rem, _ in phase1 for p in (segs, rem) if p is not None]
    at_once = _segments_all(parts, doc)
    built = iter(at_once if at_once is not None else [_segments_from(v, doc, p) for p in parts])
    for name, slots, segs, removed, blocked in phase1:
        doc.tables[name] = (slots, next(built))
        if removed is not None:
            doc.removed[name] = next(built)
        if blocked:
            doc.blocked.add(name)
    return doc


def _phase1_all_tables(v: _V, tables: dict, doc: IndexDoc, manifest: Manifest, worker: bool) -> list | None:
    """`_phase1_by_table`'s result with every table's segments checked at once (`_segs_v4_all`), or None
    when anything would fail (the caller then runs `_phase1_by_table` for the exact finding)."""
    items, tabs = [], []
    for name, t in tables.items():
        info = manifest.tables.get(name)
        if type(t) is not dict or info is None or "segments" not in t or t.get("slots") != list(info.slots):
            return None
        geo = info.geometry(doc.format_version)
        where = f"tables[{name!r}]"
        # (the geometry has row runs only where the index's version has them)
        items.append(_SegsInput(f"{where}.segments", t["segments"], geo.widths_per_block, geo.begins_per_block,
                                True, info.column_blocks is not None, geo.num_rows))
        if "removed" in t:
            if not info.changes:
                return None
            items.append(_SegsInput(f"{where}.removed", t["removed"], *_IDS_ONLY, False, False))
        tabs.append((name, info, "removed" in t, geo))
    parts = _segs_v4_all(items, doc)
    if parts is None:
        return None
    out, k = [], 0
    for name, info, has_removed, geo in tabs:
        segs = parts[k]
        removed = parts[k + 1] if has_removed else None
        k += 2 if has_removed else 1
        if not worker:
            nblocks = len(geo.blocks)
            per_block = (np.bincount(segs.block, weights=segs.a["rows"], minlength=nblocks).tolist() if nblocks > 1
                         else (segs.rows_total,))
            gone = removed.rows_total if removed is not None else 0
            if any(r != info.rows for r in per_block) or gone != info.removed:
                return None
        doc.geometry[name] = geo
        out.append((name, list(info.slots), segs, removed, info.column_blocks is not None))
    return out


def _phase1_by_table(v: _V, tables: dict, doc: IndexDoc, manifest: Manifest, worker: bool) -> list:
    """Phase 1 of `_index_v4`, vectorised per table: [(name, slots, table segs, removed segs or None,
    column-split)]; raises at the first problem."""
    return [_phase1_table(v, name, t, doc, manifest, worker) for name, t in tables.items()]


def _phase1_table(v: _V, name, t, doc: IndexDoc, manifest: Manifest, worker: bool) -> tuple:
    """Phase 1 of one table, vectorised: (name, slots, table segs, removed segs or None, column-split);
    raises at its first problem."""
    where = f"tables[{name!r}]"
    slots = [v.str(x, f"{where}.slots") for x in v.list(v.get(t, "slots", where), f"{where}.slots")]
    info = manifest.tables.get(name)
    if info is None:
        v.fail(where, "table is not in the manifest")
    if slots != list(info.slots):
        v.fail(f"{where}.slots", f"{slots} disagree with the manifest's {list(info.slots)}")
    cb = info.column_blocks
    nblocks = len(cb.blocks) if cb is not None else 1
    geo = doc.geometry[name] = info.geometry(doc.format_version)
    segs = _segs_v4(v, v.get(t, "segments", where), f"{where}.segments", doc, geo, True,
                    cb is not None, nblocks)
    removed = None
    if "removed" in t:
        if not info.changes:
            v.fail(f"{where}.removed", "removed ids in a table that is not saved as changes")
        removed = _segs_v4(v, t["removed"], f"{where}.removed", doc, None, False, False, 1)
    if not worker:
        per_block = np.bincount(segs.block, weights=segs.a["rows"], minlength=nblocks)
        if np.any(per_block != info.rows):
            v.fail(where, f"segments hold {per_block.astype(np.int64).tolist()[:8]} rows per column block, "
                          f"the manifest says {info.rows}")
        gone = removed.rows_total if removed is not None else 0
        if gone != info.removed:
            v.fail(f"{where}.removed", f"segments hold {gone} removed ids, the manifest says {info.removed}")
    return name, slots, segs, removed, cb is not None


# --------------------------------------------------------------- version 4 and 5 index, every table at once
# An index's tables validated all at once, version 5 row runs and column groups included: the checks of
# `_segs_v4` and `_segments_from` (one table at a time, about twenty numpy calls each) run on every table's
# segment lists concatenated, so an index of a thousand small tables costs a few numpy passes and one loop
# over its segments, not a thousand rounds of calls.
#
# The rules are the per-table functions'; these only batch them, and answer None whenever anything is out
# of order: the caller then runs the per-table functions, which find the same first problem and word it
# exactly (naming the table, field and position). A hostile or corrupt index is refused with the same
# message either way, only more slowly.
_LIMIT62 = 1 << 62
#: The columns of removed ids' segments: the ids alone (row bytes and alignment, as _SegsInput takes them).
_IDS_ONLY = ([[8]], [[False]])
#: The keys a table's SEGS holds: (with packed, with block, with id0) -> keys.
_SEGS_KEYS = {(p, b, r): frozenset(_SEG_KEYS) | {"crc32c"} | ({"packed"} if p else set()) | ({"block"} if b else set())
              | ({"id0"} if r else set()) for p in (False, True) for b in (False, True) for r in (False, True)}


@dataclass(frozen=True)
class _SegsInput:
    """One table's SEGS as `_segs_v4` takes it."""
    where: str
    raw: object
    row_bytes: list[list[int]]   # per column block: bytes of a row of each column, ids first
    begins_slot: list[list[bool]]  # per column block: whether each column begins a slot (is padded)
    with_packed: bool
    with_block: bool
    runs_over: int = 0           # > 0: a version 5 row_range table of this many rows (segments carry id0)


def _ints_or_none(values: list) -> np.ndarray | None:
    """`values` as int64 when every one is a Python int in [-2**63, 2**63), else None."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, values)) != {int}:
        return None
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        return None


def _segs_v4_all(items: list[_SegsInput], doc: IndexDoc) -> list[_SegArrays] | None:
    """`_segs_v4` of every item, or None where any of them would fail."""
    #: The optional fields, with the value a segment without the field has. Where no table has one, it is
    #: filled in as an array (a hostile index of 200 000 segments costs no list of 200 000 Python ints).
    absent = {"packed": 0, "block": 0, "id0": -1}
    somewhere = {"packed": any(it.with_packed for it in items), "block": any(it.with_block for it in items),
                 "id0": any(it.runs_over > 0 for it in items)}
    cols = {k: [] for k in (*_SEG_KEYS, *absent)}
    counts, widths, aligned, base, nblocks, runs_over = [], [], [], [], [], []
    layouts = {}   # a shared geometry's lists (by identity, alive for this call) -> their first row in widths
    for it in items:
        raw = it.raw
        if type(raw) is not dict or raw.keys() != _SEGS_KEYS[(it.with_packed, it.with_block, it.runs_over > 0)]:
            return None
        n = len(raw["file"]) if type(raw["file"]) is list else -1
        for k in _SEG_KEYS:
            lst = raw[k]
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        for k, present in (("packed", it.with_packed), ("block", it.with_block), ("id0", it.runs_over > 0)):
            if not somewhere[k]:
                continue
            lst = raw[k] if present else [absent[k]] * n
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        if any(x * (_U32 - 1) >= _LIMIT62 for rbs in it.row_bytes for x in rbs):
            return None   # "a slot row is too large for any segment"
        counts.append(n)
        key = (id(it.row_bytes), id(it.begins_slot))
        row = layouts.get(key)
        if row is None:
            row = layouts[key] = len(widths)
            widths += it.row_bytes
            aligned += it.begins_slot
        base.append(row)
        nblocks.append(len(it.row_bytes))
        runs_over.append(it.runs_over)
    a = {}
    total = sum(counts)
    for k, lst in cols.items():
        a[k] = _ints_or_none(lst) if somewhere.get(k, True) else np.full(total, absent[k], dtype=np.int64)
        if a[k] is None:
            return None
    nb, nfiles = doc.num_buckets, len(doc.files)
    fi, off, rows, dirs, first, last, packed, block, id0 = (a[k] for k in (*_SEG_KEYS, "packed", "block", "id0"))
    counts_a = np.asarray(counts, dtype=np.int64)
    table_of = np.repeat(np.arange(len(items)), counts_a)
    n_rows = np.asarray(runs_over, dtype=np.int64)[table_of]   # 0 for a table without row runs (id0 all -1)
    run = id0 >= 0
    ok = ((fi >= 0) & (fi < nfiles) & (off >= 0) & (rows >= 1) & (rows < _U32)
          & np.where(run, dirs == 0, (dirs >= 1) & (dirs <= np.minimum(rows, nb)))
          & (first >= 0) & (first <= last) & (last < nb)
          & (last - first + 1 >= dirs) & ((packed == 0) | (packed == 1))
          & (block >= 0) & (block < np.asarray(nblocks, dtype=np.int64)[table_of])
          & (id0 >= -1) & (~run | (id0 <= n_rows - rows)))
    if not ok.all():
        return None
    if run.any():
        r = np.nonzero(run)[0]
        nb64, nr = np.uint64(nb), n_rows[r].astype(np.uint64)   # id0 < N <= 2**40, B <= 2**24: exact
        b0 = (id0[r].astype(np.uint64) * nb64 // nr).astype(np.int64)
        b1 = ((id0[r] + rows[r] - 1).astype(np.uint64) * nb64 // nr).astype(np.int64)
        if not ((first[r] == b0) & (last[r] == b1)).all():
            return None
        order = r[np.lexsort((id0[r], block[r], table_of[r]))]   # each row once per table and column block
        same = (table_of[order][1:] == table_of[order][:-1]) & (block[order][1:] == block[order][:-1])
        if np.any(same & (id0[order][1:] < id0[order][:-1] + rows[order][:-1])):
            return None
    ncols = [len(w) for w in widths]
    width = max(ncols, default=1)
    rb = np.array([w + [0] * (width - len(w)) for w in widths], dtype=np.int64).reshape(len(widths), width)
    al = np.array([b + [False] * (width - len(b)) for b in aligned], dtype=bool).reshape(len(widths), width)
    which = np.asarray(base, dtype=np.int64)[table_of] + block
    lengths = rows[:, None] * rb[which]   # < 2**62
    lengths[run, 0] = 0                    # a run stores no ids
    al = al[which] & ~packed.astype(bool)[:, None]
    starts = np.empty_like(lengths)
    pos = off + 8 * dirs
    if (pos >= _LIMIT62).any():
        return None
    for k in range(width):
        ln = lengths[:, k]
        starts[:, k] = np.where(al[:, k] & (ln != 0), layout.align_up(pos), pos)
        pos = starts[:, k] + ln
        if (pos >= _LIMIT62).any():
            return None
    if len(pos) and (pos > np.asarray([sz for _, sz in doc.files], dtype=np.int64)[fi]).any():
        return None
    out, lo = [], 0
    rows_before = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows, out=rows_before[1:])   # exact: fewer than 2**31 segments of fewer than 2**32 rows
    rows_before = rows_before.tolist()
    for it, n, b0 in zip(items, counts, base):
        hi = lo + n
        nc = ncols[b0:b0 + len(it.row_bytes)]
        w = max(nc)
        out.append(_SegArrays(it.where, it.raw, {k: a[k][lo:hi] for k in _SEG_KEYS}, packed[lo:hi],
                              block[lo:hi], id0[lo:hi], starts[lo:hi, :w], lengths[lo:hi, :w], pos[lo:hi], nc,
                              rows_total=rows_before[hi] - rows_before[lo]))
        lo = hi
    return out


def _segments_all(parts: list[_SegArrays], doc: IndexDoc) -> list[list[Segment]] | None:
    """`_segments_from` of every part (phase 1 passed), or None where any CRC string is wrong."""
    if not parts:
        return []
    width = max(p.lengths.shape[1] for p in parts)
    lengths = np.zeros((sum(len(p.ends) for p in parts), width), dtype=np.int64)
    lo = 0
    for p in parts:
        lengths[lo:lo + len(p.ends), :p.lengths.shape[1]] = p.lengths
        lo += len(p.ends)
    has_dir = (np.concatenate([p.id0 for p in parts]) < 0).astype(np.int64)   # a row run has no directory
    steps = layout.checksum_steps(lengths, doc.chunk_bytes)
    per_col = layout.crc_count(lengths, steps)
    counts = has_dir + per_col.sum(axis=1)   # the directory's CRC, then the columns'
    texts, lo = [], 0
    for p in parts:
        text = p.raw.get("crc32c") if type(p.raw) is dict else None
        n = len(p.ends)
        if type(text) is not str or len(text) != 8 * int(counts[lo:lo + n].sum()):
            return None
        texts.append(text)
        lo += n
    crcs = _crcs_from_hex("".join(texts))
    if crcs is None:
        return None
    ends = np.cumsum(counts).tolist()
    lengths_l, steps_l, per_l, dir_l = lengths.tolist(), steps.tolist(), per_col.tolist(), has_dir.tolist()
    out, i, c0 = [], 0, 0
    for p in parts:
        file_l, off_l, rows_l, k_dir_l, first_l, last_l = (p.a[k].tolist() for k in _SEG_KEYS)
        packed_l, block_l, id0_l, starts_l = p.packed.tolist(), p.block.tolist(), p.id0.tolist(), p.starts.tolist()
        segs = []
        for j in range(len(file_l)):
            c = c0 + dir_l[i]
            cs = []
            for k in range(p.ncols[block_l[j]]):
                m = per_l[i][k]
                cs.append(Column(starts_l[j][k], lengths_l[i][k], crcs[c:c + m], steps_l[i][k]))
                c += m
            k_dir = k_dir_l[j]
            segs.append(Segment(file_l[j], rows_l[j], Column(off_l[j], 8 * k_dir, crcs[c0:c0 + dir_l[i]], 8 * k_dir),
                                tuple(cs), k_dir, first_l[j], last_l[j], bool(packed_l[j]), block_l[j], id0_l[j]))
            c0 = ends[i]
            i += 1
        out.append(segs)
    return out


# ------------------------------------------------------------ manifest tables in the common form, at once
# A manifest's tables and digests read with the rules checked once per distinct slot layout.
#
# A model of a thousand tables repeats a handful of slot layouts (dim and optimizer) a thousand times; the
# field-by-field rules of `_table_from_json` cost a few dozen calls per table. Here a table in
# the common form (known keys only, `hash` buckets) is read in a few dict lookups, its slots checked once
# per distinct layout, and anything else is answered None, so that the caller applies the rules to that
# table (they find and word any problem, in the same order as before: every table accepted here, those
# rules accept too).
#: The keys of a table read here: any other (a newer format's, or column blocks, row or id
#: ranges) goes through the full rules.
_PLAIN = frozenset({"slots", "rows", "bucket_fn"})
_CHANGES = _PLAIN | {"changes", "removed"}
_DTYPES = frozenset(dtypes.names())
_HEX_LOWER = re.compile(r"[0-9a-f]*")   # (digest.Digest.from_hex's rule, for many digests at once)


class _SlotLayouts:
    """Slot layouts (a table's `slots` as parsed JSON) checked so far, by their contents."""

    def __init__(self):
        self._seen: dict[tuple, dict[str, SlotInfo]] = {}

    def slots(self, raw) -> dict[str, SlotInfo] | None:
        """The table's slots (name -> SlotInfo, column order), or None where a rule may fail."""
        if type(raw) is not list:
            return None
        try:
            key = tuple((p[0], p[1]["dtype"], tuple(p[1]["shape"]), p[1]["category"]) if type(p) is list
                        and len(p) == 2 and type(p[1]) is dict and type(p[1].get("shape")) is list else None
                        for p in raw)
            have = self._seen.get(key)
        except (KeyError, TypeError):   # a missing field, an unhashable shape entry
            return None
        if have is None:
            have = _check_layout(key)
            if have is None:
                return None
            self._seen[key] = have
        return dict(have)


def _check_layout(key: tuple) -> dict[str, SlotInfo] | None:
    out = {}
    for item in key:
        if item is None:
            return None
        name, dt, shape, cat = item
        if type(name) is not str or "\x00" in name or name in out or dt not in _DTYPES or cat not in CATEGORIES \
                or len(shape) > 8 or not all(type(d) is int and 0 <= d < (1 << 31) for d in shape):
            return None
        out[name] = SlotInfo(dt, shape, cat)
    return out


def _table_info_fast(name, t, version: int, layouts: _SlotLayouts) -> TableInfo | None:
    """A version 4 manifest table in the common form, or None (the full rules then read it)."""
    if type(t) is not dict or type(name) is not str or "\x00" in name or version < SEGMENT_DIR_SINCE:
        return None
    keys = t.keys()
    if not (keys == _PLAIN or keys <= _CHANGES and _PLAIN <= keys) or t["bucket_fn"] != "hash":
        return None
    rows, changes, removed = t["rows"], t.get("changes", False), t.get("removed", 0)
    if type(rows) is not int or not 0 <= rows < _I63 or (changes is not True and changes is not False) \
            or type(removed) is not int or not 0 <= removed < _I63 or (removed and not changes):
        return None
    slots = layouts.slots(t["slots"])
    return None if slots is None else TableInfo(slots, rows, changes, removed)


def _table_digests_fast(raw: dict, tables: dict[str, TableInfo]) -> ParsedTableDigests | None:
    """Every table's entry of the manifest's `digests.tables` (`raw`, a dict) in the common form, their
    hex digits checked and decoded at once; None where any entry needs the full rules."""
    names, rows, texts = [], [], []
    for name, t in raw.items():
        info = tables.get(name)
        if info is None or type(t) is not dict or t.keys() != {"rows", "ids", "slots"}:
            return None
        n, slots = t["rows"], t["slots"]
        if type(n) is not int or not 0 <= n < _I63 or (not info.changes and n != info.rows) \
                or type(slots) is not dict or slots.keys() != info.slots.keys():
            return None
        names.append(name)
        rows.append(n)
        texts.append(t["ids"])
        texts += [slots[s] for s in info.slots]
    if not texts:
        return ParsedTableDigests({})
    if set(map(type, texts)) != {str} or set(map(len, texts)) != {32}:
        return None
    joined = "".join(texts)
    if not _HEX_LOWER.fullmatch(joined):
        return None
    lanes = np.frombuffer(bytes.fromhex(joined), dtype=">u8").tolist()
    parts, k = {}, 0
    for name, n in zip(names, rows):
        slots = list(tables[name].slots)
        parts[name] = (slots, n, lanes[2 * k:2 * (k + 1 + len(slots))])
        k += 1 + len(slots)
    return ParsedTableDigests(parts)
