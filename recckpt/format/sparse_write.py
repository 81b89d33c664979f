"""Sparse tables to shard files, through the C++ engine: each table arrives as a stream of bounded chunks
(ids + one uint8 row-bytes array per slot); every chunk becomes one *segment*, sorted by bucket by the
engine, appended to whichever of the worker's shard files has the least queued work, and added to the
table's content digest while the engine writes it. Reading them back is `sparse_io`.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .. import _C
from ..storage import Storage
from . import gcpause, names
from .digest import TableDigest
from .geometry import TableGeometry
from .schema import Column, ColumnBlocks, ColumnGroups, IndexDoc, Segment, SlotInfo

log = logging.getLogger("recckpt")


class WriteReceipts:
    """What the writer has taken from one chunk stream, so that the stream can reuse its buffers.

    The writer keeps reading a chunk's arrays after taking it, until the chunk is written; a stream that
    fills the same memory again must first `wait` for the chunks that used it. Call sequence: the
    writer calls `taken` for every chunk as it queues it; the stream reads `len(receipts)` (chunks
    taken so far) after yielding the last chunk of a buffer, and later calls `wait(that count)` before
    filling the buffer again."""

    def __init__(self) -> None:
        self._writer = None
        self._segments: list[int] = []
        self._written = 0

    def __len__(self) -> int:
        return len(self._segments)

    def taken(self, writer: _C.ShardWriter, segment: int) -> None:
        """The writer queued the next chunk of the stream as segment `segment`."""
        if self._writer is not None and writer is not self._writer:
            raise ValueError("WriteReceipts: one stream is written by one writer")
        self._writer = writer
        self._segments.append(segment)

    def wait(self, count: int) -> None:
        """Block until the first `count` chunks taken are written (their arrays may then be reused);
        raises the writer's failure (OSError) instead."""
        for seg in self._segments[self._written:count]:
            self._writer.wait(seg)
        self._written = max(self._written, min(count, len(self._segments)))


@dataclass
class TableSource:
    """A table as the writer sees it: slot specs in column order and a stream of chunks, each
    `(ids int64[n], [uint8[n, row_bytes] per slot])`, C-contiguous numpy arrays. A stream that reuses
    its arrays passes `receipts` and waits on them (see WriteReceipts)."""
    name: str
    slots: dict[str, SlotInfo]
    rows: int
    chunks: Iterable[tuple[np.ndarray, list[np.ndarray]]]
    receipts: WriteReceipts | None = None
    digest: TableDigest | None = None   # set: the writer adds every chunk it takes to it
    num_rows: int = 0                    # > 0: a fixed-size table of N rows, bucketed "row_range"
    column_blocks: ColumnBlocks | None = None   # saved column-split: the table's blocks ...
    block: int = 0                       # ... and the one these chunks hold (split slots narrowed to it)
    input_size: int = 0                  # > 0: ids in [0, H) bucketed "id_range" (managed-collision tables)
    column_groups: ColumnGroups | None = None   # format version 5: split slots stored by column group

    @property
    def bucket_fn(self) -> str:
        return "row_range" if self.num_rows > 0 else "id_range" if self.input_size > 0 else "hash"

    @property
    def nbytes(self) -> int:
        return self.rows * (8 + sum(s.row_bytes for s in self.slots.values()))

    def geometry(self) -> TableGeometry:
        """Where the writer puts each slot among a segment's columns (a row_range table's segments may be
        row runs: format version 5)."""
        return self._geometry

    @functools.cached_property
    def _geometry(self) -> TableGeometry:   # asked for twice a save (the index, the writer's groups)
        return TableGeometry.shared(self.slots, self.column_blocks, self.column_groups, self.num_rows)

    def group_bytes(self) -> list[int]:
        """Per slot, the bytes of each row of one column group as the engine cuts them (0: one column)."""
        if self.column_blocks is None and self.column_groups is None:
            return [0] * len(self.slots)   # a thousand small hash tables: nothing to look up
        places = self.geometry().blocks[self.block]
        return [p.unit * (p.ranges[0][1] - p.ranges[0][0]) if p.count > 1 else 0 for p in places]


#: A worker writes a shard file (and keeps a writer thread busy) per this many bytes of rows, up to its
#: `concurrency`: a save of tens of megabytes is bucketed, checksummed and written by several threads.
FILE_BYTES = 8 << 20


@dataclass(frozen=True)
class SparseWriteOptions:
    num_buckets: int
    chunk_bytes: int
    concurrency: int
    segment_bytes: int
    max_inflight_bytes: int
    fsync: bool = True


def write_tables(storage: Storage, stage: str, worker: int, tables: list[TableSource],
                 opts: SparseWriteOptions, removed: list[TableSource] = ()) -> IndexDoc:
    """Write one worker's shard files under `stage`; returns that worker's index. `removed`: per table
    of an incremental checkpoint, its removed ids (a source with no slots, named like its table)."""
    doc = IndexDoc(opts.num_buckets, opts.chunk_bytes)
    for t in tables:
        doc.tables[t.name] = (list(t.slots), [])
        doc.geometry[t.name] = t.geometry()
        if t.column_blocks is not None:
            doc.blocked.add(t.name)
    for t in removed:
        if t.slots or t.name not in doc.tables:
            raise ValueError(f"removed ids of table {t.name!r}: need no slots and a table of that name")
        doc.removed[t.name] = []
    sources = list(tables) + list(removed)
    total = sum(t.nbytes for t in sources)
    if total == 0:
        return doc
    nfiles = max(1, min(opts.concurrency, -(-total // min(opts.segment_bytes, FILE_BYTES))))
    rels = [names.shard_file(worker, k) for k in range(nfiles)]
    storage.makedirs(f"{stage}/{names.SPARSE_DIR}")
    # The store says where the engine writes (the files themselves, or local files it uploads after).
    with storage.engine_outputs(stage, rels) as paths:
        # A save that fsyncs its local files starts their writeback as it writes (the engine's PwriteThread).
        writeback = opts.fsync and storage.engine_path(stage) is not None
        writer = _C.ShardWriter(paths, opts.num_buckets, opts.chunk_bytes, opts.max_inflight_bytes, writeback)
        try:
            _submit_all(writer, sources, len(tables), opts.concurrency)
            records = writer.finish(opts.fsync)
        except BaseException:
            writer.abort()
            raise
        with gcpause.paused():   # a segment of each of a thousand tables: metadata only
            _add_records(doc, rels, paths, records, tables, sources)
    return doc


#: Chunks smaller than this are handed to the writer, and digested, together (`_submit_all`) ...
SMALL_CHUNK_BYTES = 1 << 20
#: ... up to this many bytes of them, or this many chunks, at a time.
SMALL_BATCH_BYTES = 8 << 20
SMALL_BATCH_CHUNKS = 512


def _submit_all(writer: _C.ShardWriter, sources: list[TableSource], n_tables: int, threads: int) -> None:
    """Every chunk of `sources` (tables, then from `n_tables` on removed ids) to the writer, in order, each
    added to its source's digest while the writer threads write it. Small chunks (a model of many small
    tables) go in batches: one `submit_many` and one digest call for many tables instead of two calls per
    table. A stream that reuses its buffers (`receipts`) has each chunk handed over alone, so that its
    receipt is taken before the next."""
    pending, nbytes = [], 0

    def flush():
        nonlocal nbytes
        if pending:
            writer.submit_many([(ti, ids, cols, t.num_rows, t.input_size, groups, runs)
                                for ti, t, ids, cols, groups, runs in pending])
            TableDigest.update_many([(t.digest, ids, cols) for _, t, ids, cols, _, _ in pending
                                     if t.digest is not None], threads)
            pending.clear()
            nbytes = 0

    for ti, t in enumerate(sources):
        # column groups and row runs (format version 5): a table's segments; never removed ids
        groups, runs = (t.group_bytes(), t.num_rows > 0) if ti < n_tables else ([], False)
        for ids, cols in t.chunks:
            if len(ids) == 0:
                continue   # a segment holds at least one row
            size = ids.nbytes + sum(c.nbytes for c in cols)
            if t.receipts is None and size < SMALL_CHUNK_BYTES:
                pending.append((ti, t, ids, cols, groups, runs))
                nbytes += size
                if nbytes >= SMALL_BATCH_BYTES or len(pending) >= SMALL_BATCH_CHUNKS:
                    flush()
                continue
            flush()
            segment = writer.submit(ti, ids, cols, t.num_rows, t.input_size, groups, runs)
            if t.receipts is not None:
                t.receipts.taken(writer, segment)
            if t.digest is not None:   # while the writer threads write the chunk
                t.digest.update(ids, cols, threads)
    flush()


def _add_records(doc: IndexDoc, rels, paths, records, tables: list[TableSource], sources: list[TableSource]):
    """The engine's segment records, per file, into `doc`."""
    for fi, (rel, path, recs) in enumerate(zip(rels, paths, records)):
        doc.files.append((rel, os.path.getsize(path)))
        for r in recs:
            b = r["buckets"]
            ti = r["table"]
            run = r["id0"] >= 0   # a row run: no directory (and so no CRC of it), no ids
            seg = Segment(fi, r["rows"], Column(b["offset"], b["length"], () if run else (b["crc32c"],), b["length"]),
                          tuple(Column(c["offset"], c["length"], c["crc32c"], c["step"]) for c in r["columns"]),
                          r["dir"], r["first"], r["last"], bool(r["packed"]), sources[ti].block, r["id0"])
            if ti < len(tables):
                doc.tables[tables[ti].name][1].append(seg)
            else:
                doc.removed[sources[ti].name].append(seg)

