"""Manifest and index: typed records, built by the writer and written as JSON here; read back and
validated field by field by `manifest_parse` and `index_parse`.

docs/FORMAT.md states the same schema in prose; change both together.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import dtypes, layout
from .digest import Digests
from .geometry import GROUP_WIDTH, TableGeometry
from .hashing import HASH_NAME
from .names import (
    COLUMN_GROUPS_SINCE,
    FORMAT_NAME,
    FORMAT_VERSION,
    SEGMENT_DIR_SINCE,
)

CATEGORIES = ("sparse", "sparse_opt")

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
