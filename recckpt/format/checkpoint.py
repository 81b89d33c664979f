"""Writing and reading one checkpoint directory: the parts each worker writes, the merge and manifest
that worker 0 writes last, and a reader that verifies every file before handing out its contents."""
from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from .. import _C, __version__
from ..errors import CheckpointSaveError, CorruptCheckpointError, IncompatibleCheckpointError, RecckptError
from ..storage import Storage
from . import catalog, checked_json, gcpause, names, safetensors_io, structure, tree_codec, visibility
from .digest import DenseDigest, Digest, Digests, TableDigest, dense_digest
from .index_parse import index_from_json
from .schema import (
    ColumnBlocks,
    ColumnGroups,
    FileInfo,
    IndexDoc,
    Manifest,
    ParentRef,
    SlotInfo,
    TableInfo,
)
from .sparse_io import ReadOptions, SegmentReader
from .sparse_write import SparseWriteOptions, TableSource, write_tables

if TYPE_CHECKING:
    import torch


@dataclass
class WorkerPart:
    """What one worker wrote into the staging directory; JSON-serialisable so a collective can carry it."""
    worker: int
    index: dict
    files: dict[str, list[int]] = field(default_factory=dict)     # rel -> [size, crc32c]
    tables: dict[str, dict] = field(default_factory=dict)         # name -> TableInfo json
    io_state: str | None = None
    dense: str | None = None
    extras: str | None = None
    step: int | None = None       # the training step the worker saved at (duplicate-id resolution)
    parent: dict | None = None    # incremental: ParentRef json of the checkpoint the changes are since
    digests: dict | None = None   # table -> TableDigest json of this worker's rows (tables written whole)
    dense_digests: dict | None = None   # key -> DenseDigest json (the worker that wrote the dense state)
    # The index as this process built it (not carried by collectives): finalize takes it as is instead
    # of parsing `index` back, which for a thousand tables cost more than writing them.
    doc: IndexDoc | None = field(default=None, repr=False, compare=False)
    doc_bytes: bytes | None = field(default=None, repr=False, compare=False)   # its index file, as written
    # Likewise its tables and digests as built (finalize takes them instead of `tables`/`digests`);
    # `digests` is written out only for a collective (`to_json`).
    infos: dict[str, TableInfo] | None = field(default=None, repr=False, compare=False)
    sums: dict[str, TableDigest] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("doc", "doc_bytes", "infos", "sums")}
        if self.digests is None and self.sums is not None:
            out["digests"] = {name: d.to_json() for name, d in self.sums.items()}
        return out

    @staticmethod
    def from_json(d: dict) -> "WorkerPart":
        return WorkerPart(**d)


def _write_safetensors(storage: Storage, rel_path: str, tensors, metadata, fsync, each=None) -> list[int]:
    with storage.open_write(rel_path, fsync=fsync) as f:
        size, crc = safetensors_io.write(f, tensors, metadata, each)
    return [size, crc]


def _dense_digests_of(data, threads: int) -> dict:
    """DenseDigest json of every tensor of a whole dense.safetensors file held in `data` (no torch)."""
    entries, _ = safetensors_io.parse(data, names.DENSE)
    raw = np.frombuffer(data, dtype=np.uint8)
    return {k: dense_digest(dt, shape, raw[s:e], threads).to_json() for k, (dt, shape, s, e) in entries.items()}


def index_bytes(doc: IndexDoc, as_json: dict | None = None) -> bytes:
    """The bytes of an index file: checked JSON up to format version 3; from version 4 plain JSON, which
    the manifest's `files` entry covers (docs/FORMAT.md, Checked JSON). `as_json`: `doc.to_json()`, when
    the caller has it already."""
    obj = doc.to_json() if as_json is None else as_json
    if doc.format_version >= names.SEGMENT_DIR_SINCE:
        # Its only free text, the table and slot names, is in the manifest too, which `finalize` parses
        # back with every rule before anything commits: the rules are not walked twice here.
        return checked_json.dumps_unchecked(obj, check=False)
    return checked_json.dumps(obj)


def parse_index_bytes(data: "bytes | str", where: str, format_version: int) -> dict:
    """An index file's JSON object, by the rules of the manifest's `format_version`."""
    if format_version >= names.SEGMENT_DIR_SINCE:
        return checked_json.loads_unchecked(data, where, names.MAX_INDEX_BYTES)
    return checked_json.loads(data, where, names.MAX_INDEX_BYTES, precheck=lambda obj: _fits(obj, where))


def _fits(obj, where: str) -> None:
    """Refuse a version 1-3 index whose blocks claim more bytes of a shard file than it has, before the
    slower rule checks and per-segment validation (structure.overclaimed_file)."""
    over = structure.overclaimed_file(obj)
    if over is not None:
        path, claimed, size = over
        raise CorruptCheckpointError(f"{where}: the index's blocks do not tile shard file {path}: they claim "
                                     f"{claimed} bytes of its {size}; the index is corrupt or hostile", where)


def write_worker_part(storage: Storage, stage: str, worker: int, *, tables: list[TableSource],
                      dense: dict[str, torch.Tensor] | None, extras: object | None,
                      io_state: object | None, opts: SparseWriteOptions,
                      step: int | None = None, parent: ParentRef | None = None,
                      removed: list[TableSource] = ()) -> WorkerPart:
    """Write this worker's shard files, index and IO state (and, for the dense and extras the caller
    passes, those files) into the staging directory `stage`. With `parent` the checkpoint is an
    increment on it: the tables named in `removed` hold only their changed rows plus those removed ids,
    the other tables all their rows."""
    storage.makedirs(stage)
    if removed and parent is None:
        raise ValueError("removed ids are written only in an incremental checkpoint (with a parent)")
    # On an object store the shard files upload while the index, IO state, dense state and extras are
    # written; every file is in the store when this returns.
    with storage.background_uploads():
        return _write_worker_files(storage, stage, worker, tables, dense, extras, io_state, opts, step,
                                   parent, removed)


def _write_worker_files(storage, stage, worker, tables, dense, extras, io_state, opts, step, parent,
                        removed) -> WorkerPart:
    # Tables written whole get content digests, computed as the rows are written; tables holding only
    # their changes since the parent do not (their content is the fold of a chain: docs/FORMAT.md).
    changes = {t.name for t in removed}
    for t in tables:
        if t.digest is None and t.name not in changes:
            cb = t.column_blocks
            t.digest = (TableDigest.for_slots(t.slots) if cb is None
                        else TableDigest.for_block(t.slots, cb.slots, cb.blocks, t.block))
    doc = write_tables(storage, stage, worker, tables, opts, removed)
    with gcpause.paused():
        part, data = _describe_part(doc, worker, tables, changes, step, parent)
    rel = names.worker_index(worker)
    storage.makedirs(f"{stage}/{names.SPARSE_DIR}")
    storage.write_bytes(f"{stage}/{rel}", data, fsync=opts.fsync)
    part.files[rel] = [len(data), _C.crc32c(data)]
    part.doc_bytes = data
    return _write_worker_state(storage, stage, worker, part, dense, extras, io_state, opts)


def _describe_part(doc: IndexDoc, worker: int, tables: list[TableSource], changes: set[str], step, parent
                   ) -> tuple[WorkerPart, bytes]:
    """The part's JSON (index, digests, tables) and its index file's bytes: metadata only."""
    index = doc.to_json()
    part = WorkerPart(worker, index, step=step, parent=None if parent is None else parent.to_json(), doc=doc)
    sums: dict[str, TableDigest] = {}    # a column-split table comes as one source per block
    for t in tables:
        if t.digest is not None and t.name not in changes:
            sums[t.name] = sums[t.name] + t.digest if t.name in sums else t.digest
    part.sums = sums
    # Rows as exported, not as the table's metadata claimed: the index must agree with the manifest.
    # A column-split table counts its rows in block 0 only: every block holds the same rows.
    part.infos = {t.name: TableInfo(t.slots, sum(s.rows for s in doc.tables[t.name][1] if s.block == 0),
                                    t.name in doc.removed,
                                    sum(s.rows for s in doc.removed.get(t.name, [])),
                                    t.bucket_fn, t.num_rows, t.column_blocks, t.input_size, t.column_groups)
                  for t in tables}
    part.tables = {name: info.to_json() for name, info in part.infos.items()}
    return part, index_bytes(doc, index)


def _write_worker_state(storage, stage, worker, part: WorkerPart, dense, extras, io_state, opts) -> WorkerPart:
    """The worker's IO state and (worker 0) dense state and extras files, recorded in `part`."""
    if io_state is not None:
        rel = names.io_state_file(worker)
        storage.makedirs(f"{stage}/{names.IO_STATE_DIR}")
        text, tensors = tree_codec.encode(io_state, f"io_state[worker {worker}]")
        part.files[rel] = _write_safetensors(storage, f"{stage}/{rel}", tensors,
                                             {tree_codec.TREE_KEY: text}, opts.fsync)
        part.io_state = rel
    if dense is not None:
        part.dense_digests = {}

        def digest(name, dtype, shape, data):   # each tensor as it is written, while its bytes are at hand
            part.dense_digests[name] = dense_digest(dtype, shape, data, opts.concurrency).to_json()

        part.files[names.DENSE] = _write_safetensors(storage, f"{stage}/{names.DENSE}", dense, None, opts.fsync,
                                                     digest)
        part.dense = names.DENSE
    if extras is not None:
        text, tensors = tree_codec.encode(extras, "extras")
        part.files[names.EXTRAS] = _write_safetensors(storage, f"{stage}/{names.EXTRAS}", tensors,
                                                      {tree_codec.TREE_KEY: text}, opts.fsync)
        part.extras = names.EXTRAS
    return part


def copy_whole_files(src: "CheckpointReader", storage: Storage, stage: str, part: WorkerPart,
                     fsync: bool = True) -> None:
    """Copy, verified, the files of `src` that belong to `part.worker` and are not sparse data (its IO
    state; for worker 0 also the dense state and extras) into the staging directory, and record them
    in `part` (compaction: they are stored whole in every link, so the newest link's are the state)."""
    m, w = src.manifest, part.worker
    rels = [(m.io_state.get(w), "io_state")]
    if w == 0:
        rels += [(m.dense, "dense"), (m.extras, "extras")]
    for rel, attr in rels:
        if rel is None:
            continue
        data = src.read_file(rel)
        if "/" in rel:
            storage.makedirs(f"{stage}/{rel.rsplit('/', 1)[0]}")
        storage.write_bytes(f"{stage}/{rel}", data, fsync=fsync)
        part.files[rel] = [m.files[rel].size, m.files[rel].crc32c]
        setattr(part, attr, rel)
        if attr == "dense":   # from the bytes copied (the source may predate digests)
            part.dense_digests = _dense_digests_of(data, 1)


def expected_files(parts: list[WorkerPart]) -> list[visibility.ExpectedFile]:
    """Every file the parts say their workers wrote (shard files, indexes, IO state, dense, extras)."""
    out = []
    for p in parts:
        out += [visibility.ExpectedFile(p.worker, rel, int(size)) for rel, (size, _) in p.files.items()]
        out += [visibility.ExpectedFile(p.worker, f["path"], int(f["size"])) for f in p.index.get("files", [])]
    return out


def finalize(storage: Storage, stage: str, ckpt_id: str, parts: list[WorkerPart], *,
             opts: SparseWriteOptions, metadata: dict[str, str] | None = None,
             visible_within_s: float | None = None) -> Manifest:
    """Worker 0: merge the workers' indexes, write index.json and the manifest, and commit.
    `visible_within_s`: first check that every file of every part is in `stage` with its size, waiting
    up to that long for files another node wrote (None: the parts were written by this process)."""
    parts = sorted(parts, key=lambda p: p.worker)
    if [p.worker for p in parts] != list(range(len(parts))):
        raise ValueError(f"expected one part per worker 0..{len(parts) - 1}, got {[p.worker for p in parts]}")
    if visible_within_s is not None:
        visibility.check_visible(storage, stage, expected_files(parts), ckpt_id=ckpt_id,
                                 timeout_s=visible_within_s)
    with gcpause.paused():   # the merge and manifest of a thousand tables: metadata only
        m, merged, data = _merge_parts(storage, ckpt_id, parts, opts, metadata)
    if m.tables:
        storage.write_bytes(f"{stage}/{names.INDEX}", data, fsync=opts.fsync)
        m.files[names.INDEX] = FileInfo(len(data), _C.crc32c(data))
        m.index = names.INDEX
    with gcpause.paused():
        data = checked_json.dumps(m.to_json(), check=False)   # parsed back, with every rule, below
        # The writer refuses what every reader would: a manifest that fails the reader's validation (e.g.
        # a table or slot name with a NUL) would commit a checkpoint that listings skip and loads refuse.
        try:
            sha256 = catalog.parse_manifest(data, names.MANIFEST).content_sha256
        except CorruptCheckpointError as e:
            raise CheckpointSaveError(f"checkpoint {storage.describe(ckpt_id)} was not committed: its manifest "
                                      f"would not be readable ({e}); rename what the message names",
                                      path=storage.describe(ckpt_id)) from None
    # What commits is exactly what the manifest and the index list: nothing missing, nothing more.
    storage.drop_leftovers(stage, set(m.files) | {rel for rel, _ in merged.files}, names.MANIFEST)
    # An increment is committed only while its parent is: another process's retention or delete may
    # remove the parent while the increment's rows are written (its choice was checked only at the start).
    # Deleters hold the same lock while they choose and delete (catalog.links_lock).
    with catalog.links_lock(storage, m.parent is not None):
        _require_parent(storage, ckpt_id, m.parent, committed=False)
        catalog.commit(storage, stage, ckpt_id, data, fsync=opts.fsync)
    try:   # ... and once more after the commit, where the store has no such lock
        _require_parent(storage, ckpt_id, m.parent, committed=True)
    except CheckpointSaveError:
        catalog.delete(storage, ckpt_id)
        raise
    m.content_sha256 = sha256
    return m


def _require_parent(storage: Storage, ckpt_id: str, parent: ParentRef | None, committed: bool) -> None:
    """Raise CheckpointSaveError when increment `ckpt_id`'s `parent` is no longer the committed checkpoint
    it was written on (`committed`: the increment was committed, and the caller withdraws it)."""
    if parent is None:
        return
    try:
        sha = catalog.read_manifest(storage, parent.ckpt_id).content_sha256
    except (OSError, RecckptError):
        sha = None
    if sha == parent.manifest_sha256:
        return
    what = "deleted" if sha is None else "replaced"
    raise CheckpointSaveError(
        f"incremental checkpoint {storage.describe(ckpt_id)} was "
        f"{'withdrawn right after its commit' if committed else 'not committed'}: "
        f"its parent {parent.ckpt_id!r} was {what} while it was written (another process's retention, "
        f"prune or delete in this output directory). Earlier checkpoints are intact; the next save writes a "
        f"full checkpoint. Give each job its own output_dir, or keep the parent (max_keep)",
        path=storage.describe(ckpt_id))


def _merge_parts(storage: Storage, ckpt_id: str, parts: list[WorkerPart], opts: SparseWriteOptions,
                 metadata: dict[str, str] | None) -> tuple[Manifest, IndexDoc, bytes]:
    """The manifest (all but its index entry), the merged index and that index's bytes (b"" without
    tables) of the workers' parts."""
    if any(p.parent != parts[0].parent for p in parts):
        raise ValueError(f"checkpoint {ckpt_id!r}: the workers disagree on its parent "
                         f"({sorted({str(p.parent) for p in parts})}); every worker must save an increment on "
                         f"the same checkpoint, or all a full one")
    parent = None if parts[0].parent is None else ParentRef(**parts[0].parent)
    m = Manifest(ckpt_id=ckpt_id, created_ns=time.time_ns(), writer=f"recckpt {__version__}",
                 num_buckets=opts.num_buckets, chunk_bytes=opts.chunk_bytes, shard_num=len(parts),
                 metadata=dict(metadata or {}), parent=parent)
    for p in parts:
        for name, tj in p.tables.items():
            info = p.infos[name] if p.infos is not None else _table_info(tj)
            have = m.tables.get(name)
            if have is not None and have.slots != info.slots:
                raise ValueError(f"table {name!r}: worker {p.worker} wrote slots {info.slots}, "
                                 f"another worker {have.slots}")
            if have is not None and have.changes != info.changes:
                raise ValueError(f"table {name!r}: worker {p.worker} wrote "
                                 f"{'only its changes' if info.changes else 'all its rows'}, another worker the "
                                 f"opposite; an increment needs the same on every worker (save a full checkpoint)")
            if have is not None and (have.bucket_fn, have.num_rows, have.column_blocks, have.input_size,
                                     have.column_groups) != (info.bucket_fn, info.num_rows, info.column_blocks,
                                                             info.input_size, info.column_groups):
                raise ValueError(f"table {name!r}: worker {p.worker} saved it bucketed {info.bucket_fn!r} over "
                                 f"{info.num_rows} rows (input size {info.input_size}) with column blocks "
                                 f"{info.column_blocks} and groups {info.column_groups}, another worker "
                                 f"{have.bucket_fn!r} over {have.num_rows} rows (input size {have.input_size}) with "
                                 f"{have.column_blocks} and {have.column_groups}")
            m.tables[name] = info if have is None else replace(info, rows=info.rows + have.rows,
                                                                  removed=info.removed + have.removed)
        for rel, (size, crc) in p.files.items():
            m.files[rel] = FileInfo(size, crc)
        if p.io_state:
            m.io_state[p.worker] = p.io_state
        if p.step is not None:
            m.worker_steps[p.worker] = p.step
        m.dense = m.dense or p.dense
        m.extras = m.extras or p.extras
    # The workers' indexes, checked against the tables they describe (a version 4 index needs the slot
    # specs to know its column lengths).
    docs = [p.doc if p.doc is not None else index_from_json(p.index, f"worker {p.worker} index", m, worker=True)
            for p in parts]
    merged = IndexDoc.merge(docs)
    _check_column_blocks(storage, ckpt_id, m, docs)
    _check_row_ranges(storage, ckpt_id, m, docs, [p.worker for p in parts])
    m.digests = _merged_digests(parts, m)
    m.shard_bytes = sum(size for _, size in merged.files)   # listings show sizes without reading the index
    if len(parts) == 1 and parts[0].doc_bytes is not None:
        return m, merged, parts[0].doc_bytes   # one worker: the merge is its index, already serialised
    return m, merged, index_bytes(merged) if m.tables else b""


def _table_info(tj: dict) -> TableInfo:
    """A table of a worker's part as a collective carried it (`TableInfo.to_json`)."""
    blocks, groups = tj.get("column_blocks"), tj.get("column_groups")
    return TableInfo({k: SlotInfo(s["dtype"], tuple(s["shape"]), s["category"]) for k, s in tj["slots"]},
                     tj["rows"], tj.get("changes", False), tj.get("removed", 0), tj.get("bucket_fn", "hash"),
                     tj.get("num_rows", 0),
                     None if blocks is None else ColumnBlocks(tuple(blocks["slots"]), tuple(tuple(b) for b in blocks["blocks"])),
                     tj.get("input_size", 0),
                     None if groups is None else ColumnGroups(tuple(groups["slots"]), groups["width"]))


def _check_row_ranges(storage, ckpt_id: str, m: Manifest, docs: list[IndexDoc], workers: list[int]) -> None:
    """A row-range table stores each row once per column block: at most its `num_rows` rows a block, and
    row runs that never overlap (docs/FORMAT.md; the index's reader refuses either). Each worker's index
    passed alone; only the merge shows two workers writing the same rows: processes built with different
    sharding plans (a TorchRec planner or config that differs between ranks), whose checkpoint every
    reader would refuse."""
    for name, info in m.tables.items():
        if info.bucket_fn != "row_range":
            continue
        blocks = len(info.column_blocks.blocks) if info.column_blocks is not None else 1
        per_block = [0] * blocks
        runs = []   # (block, first row, end, worker)
        for d, w in zip(docs, workers):
            for seg in d.tables.get(name, ((), []))[1]:
                per_block[seg.block] += seg.rows
                if seg.is_run:
                    runs.append((seg.block, seg.id0, seg.id0 + seg.rows, w))
        runs.sort()
        clash = next(((a, b) for a, b in zip(runs, runs[1:]) if a[0] == b[0] and b[1] < a[2]), None)
        if clash is None and max(per_block) <= info.num_rows:
            continue
        what = (f"workers {clash[0][3]} and {clash[1][3]} both wrote rows [{clash[1][1]}, "
                f"{min(clash[0][2], clash[1][2])})" if clash is not None else
                f"its workers wrote {max(per_block)} rows of a table of {info.num_rows}")
        raise CheckpointSaveError(
            f"checkpoint {storage.describe(ckpt_id)} was not committed: table {name!r}: {what}; each row is "
            f"stored once. The processes disagree on which rows each holds: build every rank with the same "
            f"sharding plan (a planner or config that differs between ranks). Earlier checkpoints are intact",
            path=storage.describe(ckpt_id), table=name)


def _check_column_blocks(storage, ckpt_id: str, m: Manifest, docs: list[IndexDoc]) -> None:
    """Every column block of a column-split table holds every row (docs/FORMAT.md), which no single worker
    can check: workers of a column-wise plan that disagree on a table's rows would commit a checkpoint
    every reader refuses."""
    for name, info in m.tables.items():
        cb = info.column_blocks
        if cb is None:
            continue
        per_block = [0] * len(cb.blocks)
        for d in docs:
            for seg in d.tables.get(name, ((), []))[1]:
                per_block[seg.block] += seg.rows
        if any(x != info.rows for x in per_block):
            raise CheckpointSaveError(
                f"checkpoint {storage.describe(ckpt_id)} was not committed: table {name!r} was saved column-split "
                f"and its column blocks {list(cb.blocks)} hold {per_block} rows; every block must hold every "
                f"row (the processes holding its columns disagree on its rows: check the sharding plan)",
                path=storage.describe(ckpt_id), table=name)


def _merged_digests(parts: list[WorkerPart], m: Manifest) -> Digests:
    """The checkpoint's digests: per table the sum of every worker's part (a table some worker wrote
    without a digest has none), and the dense state's from the worker that wrote it."""
    out = Digests()
    for name, info in m.tables.items():
        slots = list(info.slots)
        found: list[TableDigest] | None = []
        for p in parts:
            d = (p.sums or {}).get(name) if p.sums is not None else (p.digests or {}).get(name)
            if d is None and name not in p.tables:
                continue          # this worker wrote nothing of the table
            if d is None:
                found = None      # a worker's share is unknown: so is the table's content
                break
            found.append(d if isinstance(d, TableDigest) else TableDigest.from_json(d, slots))
        if found is not None:
            out.tables[name] = TableDigest.total(slots, found)
    writer = next((p for p in parts if p.dense is not None), None)
    if writer is not None and writer.dense_digests is not None:
        out.dense = {k: DenseDigest(d["dtype"], tuple(d["shape"]), Digest.from_hex(d["digest"]))
                     for k, d in writer.dense_digests.items()}
    return out


class CheckpointReader:
    """One committed checkpoint. Every accessor verifies what it returns."""

    def __init__(self, storage: Storage, ckpt_dir: str, threads: int = 4, read_options: ReadOptions | None = None):
        self.storage, self.ckpt_dir, self.threads = storage, ckpt_dir, threads
        self.read_options = read_options or ReadOptions()
        self.manifest = catalog.read_manifest(storage, ckpt_dir)
        self._parsed: IndexDoc | None = None
        self._index_error: Exception | None = None
        self._index_sha256: bytes | None = None   # of the merged index's bytes, once read
        self._index: IndexDoc | None = None
        self._segments: SegmentReader | None = None

    def _rel(self, rel: str) -> str:
        return f"{self.ckpt_dir}/{rel}" if self.ckpt_dir else rel

    def describe(self, rel: str = "") -> str:
        return self.storage.describe(self._rel(rel) if rel else self.ckpt_dir)

    def read_file(self, rel: str, writable: bool = False) -> "bytes | np.ndarray":
        """A whole non-shard file, checked against the size and CRC the manifest recorded; with
        `writable`, a uint8 array read straight into (tensors may then view it)."""
        info = self.manifest.files.get(rel)
        where = self.describe(rel)
        if info is None:
            raise CorruptCheckpointError(f"{where}: not listed in the manifest", where)
        if writable and not self.storage.size_is_a_request and self.storage.engine_path(self._rel(rel)):
            return self._read_by_engine(rel, info.size, info.crc32c, where)
        if self.storage.size_is_a_request:
            # One request, not two: the read is bounded by what the store holds, so the size check
            # can follow it (an allocation still never exceeds what is really there).
            data = self._read_then_check_size(rel, info.size, where)
            if writable:
                data = np.frombuffer(data, np.uint8).copy()
        else:
            data = self._check_size_then_read(rel, info.size, where, writable)
        crc = _C.crc32c(data)
        if len(data) != info.size:
            raise CorruptCheckpointError(f"{where}: read {len(data)} bytes, the manifest recorded {info.size}; "
                                         f"the file changed while it was read", where)
        if crc != info.crc32c:
            raise CorruptCheckpointError(f"{where}: crc32c mismatch (recorded {info.crc32c:#010x}, computed "
                                         f"{crc:#010x}); the file is corrupt", where)
        return data

    def _read_by_engine(self, rel: str, size: int, crc: int, where: str) -> np.ndarray:
        """A local file (the dense tensors) read by the engine into new page-aligned memory and checked
        against its recorded CRC there: a cold load reads it past the page cache, as it reads the shard
        files (ReadOptions.direct_reads), with no second pass to check it."""
        self._check_size(rel, size, where)
        raw = np.empty(size + 4096, np.uint8)
        skip = -raw.ctypes.data % 4096
        data = raw[skip:skip + size]
        if size == 0:
            if crc != 0:
                raise CorruptCheckpointError(f"{where}: crc32c mismatch (recorded {crc:#010x}, computed "
                                             f"0x00000000); the file is corrupt", where)
            return data
        _, errors = _C.read_ranges([(self.storage.engine_path(self._rel(rel)), 0, size, size,
                                     np.array([crc], np.uint32), 0, size, data)], 1,
                                   direct=self.read_options.engine_direct)
        if errors:
            msg = errors[0][1]
            if msg.startswith("CRC mismatch"):
                raise CorruptCheckpointError(f"{where}: crc32c mismatch ({msg}); the file is corrupt", where)
            raise CorruptCheckpointError(f"{where}: {msg}", where)
        if self.storage.size(self._rel(rel)) != size:   # as a read of size + 1 bytes would have shown
            raise CorruptCheckpointError(f"{where}: the manifest recorded {size} bytes; the file changed while "
                                         f"it was read", where)
        return data

    def _check_size(self, rel: str, info_size: int, where: str) -> None:
        try:
            size = self.storage.size(self._rel(rel))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: file is missing from the checkpoint", where) from None
        if size != info_size:
            raise CorruptCheckpointError(f"{where}: {size} bytes, the manifest recorded {info_size}; the "
                                         f"file is truncated or replaced", where)
        catalog.check_inside(self.storage, self._rel(rel), self.ckpt_dir, where)

    def _read_then_check_size(self, rel: str, want: int, where: str) -> bytes:
        try:
            # A byte more than recorded, so that a file that is longer shows; never more than is there.
            data = self.storage.read_bytes(self._rel(rel), 0, want + 1)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: file is missing from the checkpoint", where) from None
        if len(data) != want:
            raise CorruptCheckpointError(f"{where}: {len(data)} bytes, the manifest recorded {want}; the "
                                         f"file is truncated or replaced", where)
        catalog.check_inside(self.storage, self._rel(rel), self.ckpt_dir, where)
        return data

    def _check_size_then_read(self, rel: str, info_size: int, where: str, writable: bool) -> "bytes | np.ndarray":
        self._check_size(rel, info_size, where)
        if writable:
            # One byte more than the manifest's size (which matched the file's above), so that a file
            # that grew since is caught by the length check below.
            data = np.empty(info_size + 1, np.uint8)
            return data[:self.storage.read_into(self._rel(rel), data)]
        return self.storage.read_bytes(self._rel(rel))

    def parsed_index(self) -> IndexDoc:
        """The index, checked field by field against the manifest, but not yet for how its blocks tile
        the shard files (`verify` wants every tiling finding; `index` stops at the first)."""
        if self._index_error is not None:
            raise self._index_error   # a large hostile index is read and refused once, not per caller
        if self._parsed is None:
            if self.manifest.index is None:
                self._parsed = IndexDoc(self.manifest.num_buckets, self.manifest.chunk_bytes)
            else:
                where = self.describe(self.manifest.index)
                try:
                    obj = self.index_object()
                    with gcpause.paused():
                        self._parsed = index_from_json(obj, where, self.manifest)
                except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
                    # A copy without the traceback, whose frames hold the file's bytes and parse.
                    self._index_error = e.retold(str(e))
                    raise
        return self._parsed

    def index_object(self) -> dict:
        """The index file's JSON object: its bytes checked against the manifest's size and CRC and parsed
        by the JSON rules, not yet validated as an index (`parsed_index` does that, or
        `recckpt.format.chain_index` for many links at once). Needs a manifest with an index."""
        where = self.describe(self.manifest.index)
        # The bytes are let go once decoded: a large index is held once as text, not twice.
        raw = self.read_file(self.manifest.index)
        if self.manifest.shard_num == 1 and len(raw) >= 256 << 10:   # only `same_as_merged_index` compares it
            # hashlib lets go of the GIL: the digest runs on another core while the bytes are decoded
            # (a 245 MB hostile index: 0.18 s of the refusal's ~1.8 s).
            with ThreadPoolExecutor(1) as pool:
                hashing = pool.submit(hashlib.sha256, raw)
                text = checked_json.ascii_text(raw, where)
            self._index_sha256 = hashing.result().digest()
        else:
            if self.manifest.shard_num == 1:
                self._index_sha256 = hashlib.sha256(raw).digest()
            text = checked_json.ascii_text(raw, where)
        del raw
        with gcpause.paused():
            return parse_index_bytes(text, where, self.manifest.format_version)

    @property
    def index_parsed(self) -> bool:
        """Whether the index was parsed and validated already (or found corrupt)."""
        return self._parsed is not None or self._index_error is not None

    def use_index(self, doc: IndexDoc) -> None:
        """Take `doc` as this reader's parsed index: the result of validating this checkpoint's index
        file against its manifest by every rule of `parsed_index`, done elsewhere
        (`recckpt.format.chain_index` validates the links of a chain together)."""
        if self.index_parsed:
            raise RuntimeError(f"{self.describe()}: the index was parsed already")
        self._parsed = doc

    def same_as_merged_index(self, data) -> bool:
        """Whether `data` (a worker index of a one-worker checkpoint) has the bytes of the merged index,
        which `parsed_index` parses and checks: then it need not be parsed again. False when the merged
        index cannot be read (its own check reports that)."""
        if self.manifest.shard_num != 1 or self.manifest.index is None:
            return False
        try:
            self.parsed_index()
        except (CorruptCheckpointError, IncompatibleCheckpointError):
            return False
        return self._index_sha256 is not None and hashlib.sha256(data).digest() == self._index_sha256

    @property
    def index(self) -> IndexDoc:
        """The fully validated index: fields, and blocks that tile every shard file exactly."""
        if self._index is None:
            doc = self.parsed_index()
            if doc.format_version < names.SEGMENT_DIR_SINCE:   # (version 4's parse checks it, segment by segment)
                structure.check_tiling(doc, self.describe)
            self._index = doc
        return self._index

    def verify_worker_indexes(self) -> None:
        """The per-worker indexes are not needed to read (index.json merges them) but are part of the
        checkpoint; check them so that no byte of a checkpoint goes unverified by a full load."""
        for rel in self.manifest.files:
            if rel.startswith(f"{names.SPARSE_DIR}/") and rel.endswith(".index.json"):
                data = self.read_file(rel)   # its size and CRC checked against the manifest
                if self.same_as_merged_index(data):
                    continue   # one worker: byte for byte the merged index, which `index` parses and checks
                with gcpause.paused():
                    parse_index_bytes(data, self.describe(rel), self.manifest.format_version)

    def files_problems(self, read_small_files: bool = True, rows_only: bool = False) -> list[str]:
        """What is wrong with this checkpoint's files short of reading its rows (empty when none): each file
        the manifest or the index records that is missing or of another size, and each file the manifest
        records (dense tensors, registered objects, IO state, indexes; not the shard files) whose CRC
        does not match (`read_small_files`; else by size only). Shard files are checked by size only (one
        size query each, a listing per directory on object stores): flipped bytes in them need `verify`.
        `rows_only`: only the files a load of a later link of its chain reads here (indexes and shards)."""
        problems = []
        rels = sorted(r for r in self.manifest.files
                      if not rows_only or r == self.manifest.index or r.startswith(f"{names.SPARSE_DIR}/"))
        try:
            have: list[int | str | None] = list(self.storage.sizes([self._rel(r) for r in rels]))
        except (OSError, CorruptCheckpointError):   # one is missing or not a file: ask each, to name it
            have = []
            for r in rels:
                try:
                    have.append(self.storage.size(self._rel(r)))
                except FileNotFoundError:
                    have.append(None)
                except (OSError, CorruptCheckpointError) as e:
                    have.append(f"{type(e).__name__}: {e}")
        for rel, n in zip(rels, have):
            want = self.manifest.files[rel].size
            if n is None:
                problems.append(f"{self.describe(rel)}: missing")
            elif isinstance(n, str):
                problems.append(f"{self.describe(rel)}: {n}")
            elif n != want:
                problems.append(f"{self.describe(rel)}: {n} bytes, the manifest recorded {want}")
            elif read_small_files:   # the files beside the shards (dense, extras, IO state, indexes): CRC
                try:
                    self.read_file(rel)
                except CorruptCheckpointError as e:
                    problems.append(str(e))
        if self.manifest.index is not None and not problems:   # (a damaged index is named above)
            try:
                self.segments   # sizes of every shard file against the index
            except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
                problems.append(str(e))
        return problems

    @property
    def segments(self) -> SegmentReader:
        if self._segments is None:
            seg = SegmentReader(self.storage, self.ckpt_dir, self.index, self.threads, self.read_options)
            # Every offset and length of the index lies inside the size it records for its file; checking
            # those sizes against the files now bounds every later allocation by what is really on disk.
            seg.check_sizes()
            self._segments = seg
        return self._segments

    def close(self) -> None:
        """Free what reading took beyond memory (local copies of an object store's shard files); the
        reader stays usable."""
        if self._segments is not None:
            self._segments.close()

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense tensors, as views of one buffer holding the whole verified file: keeping any of
        them keeps the whole buffer alive, so a caller that keeps some should copy them."""
        if self.manifest.dense is None:
            return {}
        # Views of the file's buffer: a load copies them into the parameters, once.
        tensors, _ = safetensors_io.read_views(self.read_file(self.manifest.dense, writable=True),
                                               self.describe(self.manifest.dense))
        return tensors

    def tree(self, rel: str, arrays: bool = False):
        """The verified tree (extras, IO state) stored in safetensors file `rel` of the checkpoint.
        arrays=True: its tensors as numpy arrays (BF16 as uint16 bits), without importing torch."""
        where = self.describe(rel)
        data = self.read_file(rel)
        tensors, meta = safetensors_io.read_arrays(data, where) if arrays else safetensors_io.read(data, where)
        if tree_codec.TREE_KEY not in meta:
            raise CorruptCheckpointError(f"{where}: no {tree_codec.TREE_KEY!r} metadata", where)
        return tree_codec.decode(meta[tree_codec.TREE_KEY], tensors, where)

    def extras(self, arrays: bool = False):
        return None if self.manifest.extras is None else self.tree(self.manifest.extras, arrays)

    def io_state(self, worker: int, arrays: bool = False):
        rel = self.manifest.io_state.get(worker)
        return None if rel is None else self.tree(rel, arrays)

    def dense_header(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{key: (dtype name, shape)} of the dense file, whose every byte is verified; no torch."""
        if self.manifest.dense is None:
            return {}
        entries, _ = safetensors_io.parse(self.read_file(self.manifest.dense), self.describe(self.manifest.dense))
        return {k: (dt, shape) for k, (dt, shape, _, _) in entries.items()}


__all__ = ["index_bytes", "parse_index_bytes", "WorkerPart", "write_worker_part", "copy_whole_files", "finalize",
           "CheckpointReader", "TableSource",
           "SparseWriteOptions"]
