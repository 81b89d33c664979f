"""`compact(src, dst)`: fold a chain of incremental checkpoints into one full checkpoint, offline.

The result holds exactly what loading `src` gives (every table's surviving rows with all their slots,
and `src`'s dense state, registered objects and per-worker IO state, copied verified), written with the
same layout and commit protocol as a save. Memory is bounded: each table is folded a group of buckets
at a time into one of two reused buffer sets of about `memory_bytes / 2` each (one being folded while
the writer writes the other), and rows stream from the links in bounded batches.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    CheckpointDeletedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RecckptError,
    raw_os_errors_named,
)
from ..format import catalog
from ..format.chain import open_chain, table_links
from ..format.checkpoint import CheckpointReader, copy_whole_files, finalize, write_worker_part
from ..format.fold import Scratch, bucket_groups, fill_live, plan_fold
from ..format.layout import row_granule, segment_rows
from ..format.names import MANIFEST, owner_file, validate_ckpt_id
from ..format.retention import META_COMPACTED_FROM, recorded_step
from ..format.sparse_write import SparseWriteOptions, TableSource, WriteReceipts
from ..storage import location, open_storage

log = logging.getLogger("recckpt")

SEGMENT_BYTES = 64 << 20   # rows of one written segment, as SaveOptions.segment_bytes' default


@dataclass
class CompactStats:
    src: str
    dst: str
    links: int
    rows: int
    seconds: float


def _split(path: str) -> tuple[str, str]:
    path = location(path).rstrip("/")
    head, _, name = path.rpartition("/")
    if not head or not name:
        raise InvalidArgumentError(f"compact: {path!r} must be <output_dir>/<ckpt_id>, e.g. out/ckpt_1000",
                                   path=path)
    return head, name


def _same_dir(a, b) -> bool:
    pa, pb = a.engine_path(""), b.engine_path("")
    if pa is not None and pb is not None:
        return os.path.realpath(pa) == os.path.realpath(pb)
    return a.describe() == b.describe()


def _warn_live_dir(store, src_id: str, dst_id: str, step: int | None) -> None:
    """Compacting into the source's own output directory (a training job's, perhaps live): the result is
    one of its checkpoints from now on. Say what that means; nothing needs a flag, since a restart picks
    the highest step, not the checkpoint committed last."""
    found = catalog.committed(store)
    steps = [(recorded_step(e.metadata, e.worker_steps), cid) for cid, e in found]
    top = max(((s, cid) for s, cid in steps if s is not None), default=None)
    newer = "" if top is None or step is None or top[0] <= step else (
        f"; it holds step {step}, older than {top[1]!r} (step {top[0]}), which restore() and load() still "
        f"resume from")
    log.warning("recckpt: compact: writing %s into the output directory of its source %s, where a training job "
                "lists it among its checkpoints%s; that job's retention may delete it like any other, and its "
                "id must not be one the job will save. To keep it apart, compact into another directory",
                store.describe(dst_id), src_id, newer)


class _GroupBuffers:
    """Two sets of flat uint8 buffers (ids, then one per slot), filled by turns: a bucket group is folded
    into one while the writer still writes the previous group from the other. Reused memory is what
    makes this fast: fresh pages fault on first touch, and a fold touches every byte it writes."""

    def __init__(self, widths: list[int], receipts: WriteReceipts):
        self.widths = widths
        self.receipts = receipts
        self.sets: list[list[np.ndarray]] = [[], []]
        self.free_after = [0, 0]   # chunks taken when each set was last yielded from
        self.turn = 0
        self.scratch = Scratch()   # where later links are read before their winning rows are copied

    def next(self, rows: int) -> list[np.ndarray]:
        """Buffers of `rows` rows that the writer no longer reads (waits for it)."""
        self.free_after[self.turn] = len(self.receipts)   # the set just filled: all its chunks are taken
        self.turn = 1 - self.turn
        self.receipts.wait(self.free_after[self.turn])     # the chunks of the group before last
        bufs = self.sets[self.turn]
        if not bufs or len(bufs[0]) < 8 * rows:
            rows += rows // 8                                  # headroom: groups differ a little in size
            bufs = self.sets[self.turn] = [np.empty(w * rows, dtype=np.uint8) for w in self.widths]
        return bufs


def _pieces(links, table: str, slots: list[str], row_bytes: list[int], seg_rows: int, granule: int,
            group_bytes: int, receipts: WriteReceipts):
    """The folded rows of `table`, bucket group by bucket group, as segments of `seg_rows` rows (views of
    buffers reused every other group: `receipts` says when the writer is done with them). Every segment
    but the last holds whole granules (`row_granule`), which keeps slot rows page-aligned for mapped
    loads; each group's short rest (fewer than `granule` rows) is copied aside and written last, as one
    segment."""
    buffers = _GroupBuffers([8, *row_bytes], receipts)
    rest_ids, rest_cols = [], []
    for lo, hi in bucket_groups(links, table, 0, links[-1].manifest.num_buckets, group_bytes):
        plan = plan_fold(links, table, lo, hi)
        if plan.rows == 0:
            continue
        flat = buffers.next(plan.out_rows)
        n = fill_live(plan, slots, row_bytes, flat[0][:8 * plan.out_rows],
                      [b[:rb * plan.out_rows] for b, rb in zip(flat[1:], row_bytes)], buffers.scratch)
        ids = flat[0][:8 * n].view("<i8")
        cols = [b[:rb * n].reshape(n, rb) for b, rb in zip(flat[1:], row_bytes)]
        whole = n - n % granule
        for k in range(0, whole, seg_rows):
            end = min(k + seg_rows, whole)
            yield ids[k:end], [c[k:end] for c in cols]
        if whole < n:
            rest_ids.append(ids[whole:].copy())
            rest_cols.append([c[whole:].copy() for c in cols])
    if rest_ids:
        yield np.concatenate(rest_ids), [np.concatenate(parts) for parts in zip(*rest_cols)]


@raw_os_errors_named("compact")
def compact(src: str | os.PathLike, dst: str | os.PathLike, *, concurrency: int = 4, fsync: bool = True,
            memory_bytes: int = 256 << 20, storage_options: Mapping[str, Any] | None = None) -> CompactStats:
    """Write checkpoint `dst` (`<output_dir>/<new_id>`, local path or fsspec URL) as one full checkpoint
    holding the state of checkpoint `src` (`<output_dir>/<ckpt_id>`, any link of a chain; a full
    checkpoint is simply copied). `dst` may be in the same output directory as `src` (the version file
    then lists it) or another one. Every link of `src`'s chain is checked first and every byte read is
    verified; nothing is visible at `dst` until its commit, and `src`'s chain is never modified. Raises
    CheckpointExistsError if `dst` exists, CorruptCheckpointError naming a missing or damaged link,
    CheckpointDeletedError if `src` is deleted while it is read (retention in another process).
    `storage_options` go to fsspec for both `src` and `dst` (endpoint, credentials)."""
    src_root, src_id = _split(src)
    src_store = open_storage(src_root, storage_options)
    try:
        return _compact(src, src_store, src_id, dst, concurrency, fsync, memory_bytes, storage_options)
    except (CheckpointExistsError, CheckpointNotFoundError):
        raise
    except (CorruptCheckpointError, OSError) as e:
        # The source deleted under the compaction (retention of the run that saves into the output directory
        # deletes a chain with its newest link) shows up as missing or short files: tell it apart from a
        # corrupt one by its commit marker, as a load does. (A parent missing under a committed link is a
        # broken chain: corrupt.)
        try:
            committed = src_store.exists(f"{src_id}/{MANIFEST}")
        except (OSError, RecckptError):
            committed = True   # the store does not answer: the error above says why
        if committed:
            raise
        raise CheckpointDeletedError(
            f"compact: {src_store.describe(src_id)} was deleted while it was being compacted (by retention in "
            f"another process, or by hand): {e}. Nothing was committed at {dst}; compact a checkpoint the run "
            f"still keeps (`recckpt ls`)", path=src_store.describe(src_id)) from e


def _compact(src, src_store, src_id: str, dst, concurrency: int, fsync: bool, memory_bytes: int,
             storage_options) -> CompactStats:
    """`compact`'s work, once `src` is open."""
    t0 = time.perf_counter()
    dst_root, dst_id = _split(dst)
    validate_ckpt_id(dst_id)
    if not src_store.exists(f"{src_id}/manifest.json"):
        # why, as every other verb says it (a missing bucket, an output directory, no manifest)
        raise CheckpointNotFoundError(f"compact: {catalog.not_a_checkpoint(open_storage(src, storage_options))}",
                                      path=src_store.describe(src_id))
    links = open_chain(CheckpointReader(src_store, src_id, threads=concurrency))
    newest = links[-1]
    m = newest.manifest
    store = open_storage(dst_root, storage_options)
    if store.exists(dst_id):
        raise CheckpointExistsError(f"compact: {store.describe(dst_id)} already exists; choose another id")
    if _same_dir(src_store, store):
        _warn_live_dir(store, src_id, dst_id, recorded_step(m.metadata, m.worker_steps))
    opts = SparseWriteOptions(m.num_buckets, m.chunk_bytes, concurrency, SEGMENT_BYTES, 256 << 20, fsync)
    # The store decides where a save's files go (a staging directory, or the final keys of an object
    # store, where the manifest written last is the commit).
    stage = store.save_target(dst_id, catalog.new_staging_dir(dst_id, uuid.uuid4().hex))
    rows = 0
    claim = None
    try:
        store.prepare_for_save()
        # Claimed before anything is written, as a save claims its target: start-up recovery and `gc` in
        # another process leave a claimed target alone (docs/SAFETY.md, "Claims").
        claim = store.claim(stage, owner_file(stage, 0))
        if catalog.is_committed(store, dst_id):   # committed by another writer meanwhile: never overwrite
            raise CheckpointExistsError(f"compact: {store.describe(dst_id)} was committed by another writer; "
                                        f"choose another id", path=store.describe(dst_id))
        sources = []
        for name, info in m.tables.items():
            tl = table_links(links, name)
            slots = list(info.slots)
            rbs = [s.row_bytes for s in info.slots.values()]
            upper = sum(link.manifest.tables[name].rows for link in tl)   # rows before removals win
            seg_rows = segment_rows(SEGMENT_BYTES, rbs)
            receipts = WriteReceipts()
            # Two bucket groups are held at once (one folding, one being written): half the memory each.
            rows_iter = _pieces(tl, name, slots, rbs, seg_rows, row_granule(rbs), memory_bytes // 2, receipts)
            # a fixed-size table keeps its "row_range" buckets (and column groups), an MCH table its "id_range"
            # ones: loads stay bounded by the shard, rows and columns, after compaction
            args = info.bucket_args()
            sources.append(TableSource(name, dict(info.slots), upper, rows_iter, receipts,
                                       num_rows=args["num_rows"], input_size=args["id_range"],
                                       column_groups=info.column_groups))
        parts = []
        for w in range(m.shard_num):
            part = write_worker_part(store, stage, w, tables=sources if w == 0 else [], dense=None, extras=None,
                                     io_state=None, opts=opts, step=m.worker_steps.get(w))
            copy_whole_files(newest, store, stage, part, fsync)
            parts.append(part)
        rows = sum(t["rows"] for t in parts[0].tables.values())
        # Its step (the source's `recckpt.global_step`, copied with the rest of its metadata; worker steps
        # are copied above) and its source: a restart picks the highest step, never this copy of an older
        # link just because it was committed last (retention.restore_order).
        meta = {k: v for k, v in m.metadata.items() if k != "compacted_from"}
        meta[META_COMPACTED_FROM] = src_id
        finalize(store, stage, dst_id, parts, opts=opts, metadata=meta)
    except BaseException:
        if claim is not None:   # only what this compaction claimed: in place, unclaimed files are a rival's
            try:
                store.discard(stage, dst_id, MANIFEST)   # never a committed checkpoint
            except OSError:
                pass
        raise
    finally:
        if claim is not None:
            claim.release()   # after the commit (or the discard): a rival sees it committed, or nothing
    try:
        found = catalog.committed(store)
        catalog.write_version_file(store, [i for i, _ in found], fsync, dict(found))
    except (OSError, RecckptError) as e:  # committed already; the next save or recovery redoes the list
        log.warning("recckpt: compacted %s, but updating the version file failed: %s", store.describe(dst_id), e)
    out = CompactStats(newest.describe(), store.describe(dst_id), len(links), rows, time.perf_counter() - t0)
    log.info("recckpt: compacted %s (%d links) into %s: %d rows in %.2fs", out.src, out.links, out.dst, rows,
             out.seconds)
    return out
