"""Folding a chain of checkpoint links into the rows of one state, a bucket range at a time.

The one home of the chain rule of docs/FORMAT.md ("Incremental checkpoints"): for every id the newest
event wins, a row in a later link replacing the id's row from earlier links, a removed id in a later
link deleting it. Loads (recckpt.load.chain_load), compaction (recckpt.tools.compaction) and the
model-free reader all fold through this module.

A fold has two steps, both without per-row Python:

1. `plan_fold` reads the ids of the bucket range in every link (and each increment's removed ids),
   verifying their checksums, and lets the engine (`_C.fold_links`, one hash table, GIL released)
   decide where every winning row goes. The output layout: positions [0, base_rows) are the base's
   rows in read order, so the base can be read there whole, straight from the shard files; the
   winning rows of ids the base lacks follow. Base rows replaced by a later link are overwritten in
   place; base rows whose id ends removed are "holes" the caller drops.
2. `fill_fold` reads the base into the output and every later link's rows into a reused scratch
   buffer, from which the engine copies only the winning rows into their positions (`_C.copy_rows`).
   Each output row is written once from the base and at most once more, by its winner.

`fold_rows` puts both together for a reader that wants the folded rows as arrays, in bucket groups
of bounded size. Every byte read is verified as in a full load.

A link may bucket a table differently from the newest link (a fixed-size table whose older links were
saved with "hash" buckets, its newer ones by "row_range"): bucket ranges are always those of the newest
link, and such a link is read over all its buckets, keeping the ids whose bucket under the newest link's
function lies in the range (`read_range`). Slower for that link, but every link folds by id alike.

Within one link an id appears once (docs/FORMAT.md). If it does not (two workers stored it), the
`duplicates` rule of loads decides, as for a full checkpoint: 'error' raises DuplicateIdsError;
'newest' keeps the copy of the worker that recorded the highest step in that link's manifest, and
raises if the steps of the copies are equal or not recorded. So the result never depends on the
order in which copies happen to be read.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .. import _C
from ..errors import DuplicateIdsError
from .chain import table_links
from .checkpoint import CheckpointReader
from .link_reads import LinkRead, batch_read, read_across
from .names import shard_file_worker
from .sparse_io import ReadBatch

#: Default bound of one bucket group of `fold_rows` / `fold_groups`: bytes of chain rows (ids and
#: slots, every link) planned and held at once.
GROUP_BYTES = 256 << 20


@dataclass(frozen=True)
class FoldPlan:
    """Where the rows of buckets [lo, hi) of `table` come from, for a chain `links` (base first).

    The folded rows occupy `out_rows` positions: [0, base_rows) the base's rows in read order, then
    `new_rows` rows of ids the base lacks. `src[j]`/`dst[j]` (j >= 1): the rows of link j, by index
    in read order (ascending), that win, and their positions. `holes`: positions of base rows that do
    not survive (their id ends removed, or the row was left out), with their ids in `hole_ids`.
    `link_rows[j]`: the rows link j holds in the range (checked again when the rows are read).
    `ranges[j]`: the buckets of link j that are read (see `read_range`)."""
    table: str
    lo: int
    hi: int
    links: tuple[CheckpointReader, ...]
    link_rows: tuple[int, ...]
    new_rows: int
    src: tuple[np.ndarray, ...]
    dst: tuple[np.ndarray, ...]
    holes: np.ndarray
    hole_ids: np.ndarray
    base_skipped: int     # base rows left out before folding (ownership, or the losing copy of a duplicate)
    ranges: tuple[tuple[int, int], ...]

    @property
    def base_rows(self) -> int:
        return self.link_rows[0]

    @property
    def out_rows(self) -> int:
        return self.link_rows[0] + self.new_rows

    @property
    def rows(self) -> int:
        """Rows of the folded state in the range."""
        return self.out_rows - len(self.holes)


def _bucketing(link: CheckpointReader, table: str) -> tuple[str, int, int]:
    t = link.manifest.tables[table]
    return t.bucket_fn, t.num_rows, t.input_size


def read_range(links: Sequence[CheckpointReader], j: int, table: str, lo: int, hi: int) -> tuple[int, int]:
    """The buckets of link j to read for buckets [lo, hi) of the newest link: the same ones when it buckets
    `table` as the newest does, else all of them (its ids are then kept by the newest one's function)."""
    if j == len(links) - 1 or _bucketing(links[j], table) == _bucketing(links[-1], table):
        return lo, hi
    return 0, links[j].manifest.num_buckets


def _in_newest_range(links: Sequence[CheckpointReader], table: str, lo: int, hi: int, ids: np.ndarray) -> np.ndarray:
    info = links[-1].manifest.tables[table]
    b = np.asarray(_C.bucket_of(ids, links[-1].manifest.num_buckets, **info.bucket_args()))
    return (b >= lo) & (b < hi)


def _one_batch(batches) -> ReadBatch | None:
    return next(iter(batches), None)


def _read_ids(links: Sequence[CheckpointReader], table: str, ranges: Sequence[tuple[int, int]]
              ) -> tuple[list[np.ndarray], list[ReadBatch | None], list[np.ndarray], list[np.ndarray]]:
    """The verified ids of `table`'s rows in each link's bucket range, in read order (and the batch that
    read them, whose `row_files` gives each row's shard file when duplicates must be resolved), and the
    ids each increment records as removed with the shard file of each. Read across links: one engine
    call for the bucket directories the reads need, one for the ids."""
    segments = [link.segments for link in links]
    dir_jobs, kept = [], []
    for j, seg in enumerate(segments):
        lists = [seg.table_segments(table, ids_only=True)[1]] + ([links[j].index.removed.get(table, [])] if j else [])
        for segs in lists:
            need, reqs = seg.dir_requests(table, segs, *ranges[j])
            if need:
                job = LinkRead(seg, table, reqs, [np.empty(r.nbytes, dtype=np.uint8) for r in reqs])
                dir_jobs.append(job)
                kept.append((seg, need, job.dsts))
    read_across(dir_jobs)
    for seg, need, raws in kept:
        seg.keep_dirs(table, need, raws)
    # the reads below find every directory kept (unless too many for a reader's cache: then it reads them)
    row_batches = [_one_batch(seg.batches(table, [], [], *ranges[j], batch_bytes=math.inf))
                   for j, seg in enumerate(segments)]
    removed_batches = [seg.removed_batch(table, *ranges[j]) if j else None for j, seg in enumerate(segments)]
    bufs, jobs = [], []
    for seg, batch in zip(segments * 2, row_batches + removed_batches):
        buf = np.empty(8 * (batch.rows if batch is not None else 0), dtype=np.uint8)
        bufs.append(buf.view("<i8"))
        if batch is not None:
            jobs.append(batch_read(seg, batch, [buf]))
    read_across(jobs)
    L = len(links)
    removed_files = [b.row_files() if b is not None else np.empty(0, dtype=np.int64) for b in removed_batches]
    return bufs[:L], row_batches, bufs[L:], removed_files


def _steps_of(link: CheckpointReader, files: np.ndarray) -> np.ndarray:
    """The step each row's worker recorded in `link`'s manifest (-1 where unknown), from file indexes."""
    steps = link.manifest.worker_steps
    per_file = np.array([steps.get(w, -1) if (w := shard_file_worker(rel)) is not None else -1
                         for rel, _ in link.index.files] or [-1], dtype=np.int64)
    return per_file[files] if len(files) else np.empty(0, dtype=np.int64)


def _resolve_duplicates(link: CheckpointReader, table: str, rows: np.ndarray, row_files: np.ndarray,
                        removed: np.ndarray, removed_files: np.ndarray, dup_ids: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Skip masks (rows, removed ids) of `link` that keep, of every id in `dup_ids`, only the copy of the
    worker with the highest recorded step; DuplicateIdsError if that copy is not unique."""
    ids = np.concatenate([rows, removed])
    steps = np.concatenate([_steps_of(link, row_files), _steps_of(link, removed_files)])
    pos = np.nonzero(np.isin(ids, dup_ids))[0]
    order = pos[np.lexsort((steps[pos], ids[pos]))]        # by id, then step: the winner is last per id
    last = np.ones(len(order), dtype=bool)
    last[:-1] = ids[order[1:]] != ids[order[:-1]]
    runner_up = np.zeros(len(order), dtype=bool)           # the copy just before each id's last one
    runner_up[:-1] = last[1:] & ~last[:-1]
    win, second = order[last], order[runner_up]
    if np.any(steps[order] < 0) or np.any(steps[win] == steps[second]):
        bad = order[steps[order] < 0] if np.any(steps[order] < 0) else win[steps[win] == steps[second]]
        raise DuplicateIdsError(
            f"{link.describe()}: table {table!r}: id {int(ids[bad[0]])} is stored more than once in this link "
            f"of the chain (by two workers) and load_conf duplicates='newest' cannot pick one: the workers' "
            f"steps are equal or were not recorded ({link.manifest.worker_steps or 'none'}; save with "
            f"Saver.save(..., step=...))", path=link.describe(), table=table)
    skip = np.zeros(len(ids), dtype=bool)
    skip[order[~last]] = True
    return skip[:len(rows)], skip[len(rows):]


def plan_fold(links: Sequence[CheckpointReader], table: str, lo: int, hi: int, *, duplicates: str = "error",
              keep: Callable[[np.ndarray], np.ndarray] | None = None) -> FoldPlan:
    """Plan the fold of buckets [lo, hi) of `table` over `links` (a chain as `open_chain` returns it,
    or the links `table_links` chose; base first). Reads and verifies ids only.

    `duplicates`: 'error' or 'newest' (see the module docstring). `keep`: optional function of an int64
    id array returning a bool array, True for ids to keep (a loading rank's ownership function);
    ids it rejects are left out of every link. Raises CorruptCheckpointError naming a damaged link and
    DuplicateIdsError naming the link that stores an id twice."""
    if duplicates not in ("error", "newest"):
        raise ValueError(f"plan_fold: duplicates must be 'error' or 'newest', got {duplicates!r}")
    links = tuple(table_links(list(links), table))
    ranges = tuple(read_range(links, j, table, lo, hi) for j in range(len(links)))
    rows, row_batches, removed, removed_files = _read_ids(links, table, ranges)
    skip_rows: list[np.ndarray | None] = [None] * len(links)
    skip_removed: list[np.ndarray | None] = [None] * len(links)
    for j in range(len(links)):
        masks = []
        if keep is not None:
            masks.append((np.asarray(keep(rows[j]), dtype=bool).reshape(-1),
                          np.asarray(keep(removed[j]), dtype=bool).reshape(-1)))
        if ranges[j] != (lo, hi):
            masks.append((_in_newest_range(links, table, lo, hi, rows[j]),
                          _in_newest_range(links, table, lo, hi, removed[j])))
        if masks:
            skip_rows[j] = ~np.logical_and.reduce([m[0] for m in masks])
            skip_removed[j] = ~np.logical_and.reduce([m[1] for m in masks])
    threads = links[-1].threads
    r = _C.fold_links(rows, removed, skip_rows, skip_removed, threads=threads)
    if len(r["dup_ids"]):
        dup_link = r["dup_link"]
        if duplicates == "error":
            j = int(dup_link[0])
            raise DuplicateIdsError(
                f"{links[j].describe()}: table {table!r}: id {int(r['dup_ids'][0])} is stored more than once in "
                f"this link of the chain (by two workers); load_conf duplicates='newest' keeps the copy of the "
                f"worker that saved at the highest step", path=links[j].describe(), table=table)
        for j in np.unique(dup_link):
            j = int(j)
            files = row_batches[j].row_files() if row_batches[j] is not None else np.empty(0, dtype=np.int64)
            sr, sg = _resolve_duplicates(links[j], table, rows[j], files, removed[j], removed_files[j],
                                         np.unique(r["dup_ids"][dup_link == j]))
            skip_rows[j] = sr if skip_rows[j] is None else skip_rows[j] | sr
            skip_removed[j] = sg if skip_removed[j] is None else skip_removed[j] | sg
        r = _C.fold_links(rows, removed, skip_rows, skip_removed, threads=threads)
        if len(r["dup_ids"]):  # cannot happen: every duplicate kept one copy
            raise RuntimeError(f"table {table!r}: duplicates left after resolving them")
    base_skipped = int(skip_rows[0].sum()) if skip_rows[0] is not None else 0
    return FoldPlan(table, lo, hi, links, tuple(len(x) for x in rows), int(r["new_rows"]), tuple(r["src"]),
                    tuple(r["dst"]), r["holes"], r["hole_ids"], base_skipped, ranges)


class Scratch:
    """The buffer into which `fill_fold` reads later links, kept by a caller that folds many bucket
    groups: fresh memory faults on every first touch, so each call allocating its own costs a fault
    per page read."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self._buf.size < nbytes:
            self._buf = np.empty(nbytes, dtype=np.uint8)
        return self._buf[:nbytes]


def fill_fold(plan: FoldPlan, slots: Sequence[str], row_bytes: Sequence[int], ids_out: np.ndarray,
              cols_out: Sequence[np.ndarray], scratch: Scratch | None = None) -> None:
    """Write the folded rows of `plan` into `ids_out` (`8 * out_rows` bytes) and `cols_out` (one buffer
    of `row_bytes[k] * out_rows` bytes per slot in `slots`): writable, C-contiguous uint8 arrays (for
    instance a table's `append_views`). Positions in `plan.holes` are left holding the base's rows; the
    caller drops them. Every byte read is verified. `scratch`: reuse one read buffer across calls."""
    slots, row_bytes = list(slots), list(row_bytes)
    table = plan.table
    widths = [8] + row_bytes
    outs = [ids_out] + list(cols_out)
    for w, o in zip(widths, outs):
        if o.dtype != np.uint8 or o.ndim != 1 or o.size != w * plan.out_rows:
            raise ValueError(f"fill_fold: table {table!r}: expected flat uint8 buffers of {plan.out_rows} rows")
    base = plan.links[0]
    pos = 0
    # straight into the output: no scratch to bound, so one batch (the engine's threads span it)
    for batch in base.segments.batches(table, slots, row_bytes, *plan.ranges[0], batch_bytes=math.inf):
        n = batch.rows
        if pos + n > plan.base_rows:
            _changed(base, table, pos + n, plan.base_rows)
        base.segments.read_batch(batch, [o[w * pos:w * (pos + n)] for w, o in zip(widths, outs)])
        pos += n
    if pos != plan.base_rows:
        _changed(base, table, pos, plan.base_rows)
    # Later links are read into one reused buffer, the batches of many links in one engine call, and only
    # their winning rows are copied out of it.
    scratch = Scratch() if scratch is None else scratch
    limit = base.segments.options.batch_bytes
    pending, nbytes = [], 0
    for j in range(1, len(plan.links)):
        link = plan.links[j]
        pos = 0
        for batch in link.segments.batches(table, slots, row_bytes, *plan.ranges[j]):
            pending.append((j, pos, batch))
            nbytes += batch.nbytes
            pos += batch.rows
            if nbytes >= limit:
                _copy_winners(plan, pending, widths, outs, scratch)
                pending, nbytes = [], 0
        if pos != plan.link_rows[j]:
            _changed(link, table, pos, plan.link_rows[j])
    if pending:
        _copy_winners(plan, pending, widths, outs, scratch)


def _copy_winners(plan: FoldPlan, pending: list[tuple[int, int, ReadBatch]], widths: list[int],
                  outs: list[np.ndarray], scratch: Scratch) -> None:
    """Read `pending` ((link, its first row, batch) of later links) into the scratch buffer, column by
    column with the batches' rows one after another, and copy their winning rows to their places."""
    rows = sum(b.rows for _, _, b in pending)
    buf = scratch.take(rows * sum(widths))
    cols, off = [], 0
    for w in widths:
        cols.append(buf[off:off + rows * w])
        off += rows * w
    jobs, srcs, dsts = [], [], []
    at = 0
    for j, pos, batch in pending:
        n = batch.rows
        jobs.append(batch_read(plan.links[j].segments, batch, [c[w * at:w * (at + n)] for c, w in zip(cols, widths)]))
        src, dst = plan.src[j], plan.dst[j]
        a, b = np.searchsorted(src, [pos, pos + n])
        srcs.append(src[a:b] - pos + at)
        dsts.append(dst[a:b])
        at += n
    read_across(jobs)
    src, dst = np.concatenate(srcs), np.concatenate(dsts)
    if not len(src):
        return
    new = dst >= plan.base_rows          # a row replacing a base row lands where that id already is
    _C.copy_rows(cols[0], src[new], outs[0], dst[new], widths[0])
    for c, o, w in zip(cols[1:], outs[1:], widths[1:]):
        _C.copy_rows(c, src, o, dst, w)


def _changed(link: CheckpointReader, table: str, got: int, want: int):
    raise RuntimeError(f"{link.describe()}: table {table!r}: the rows read changed between planning and "
                       f"reading a chain fold ({got} vs {want})")


def bucket_groups(links: Sequence[CheckpointReader], table: str, lo: int, hi: int,
                  group_bytes: int = GROUP_BYTES) -> list[tuple[int, int]]:
    """Split buckets [lo, hi) into ranges each holding about `group_bytes` of the links' rows of `table`
    (estimated from the manifests' row counts, rows spread evenly over buckets)."""
    nb = links[-1].manifest.num_buckets
    total = 0
    for link in links:
        t = link.manifest.tables.get(table)
        if t is not None:
            total += t.rows * (8 + sum(s.row_bytes for s in t.slots.values())) + 8 * t.removed
    est = total * (hi - lo) // max(1, nb)
    groups = max(1, min(hi - lo, -(-est // max(1, group_bytes))))
    return [(lo + g * (hi - lo) // groups, lo + (g + 1) * (hi - lo) // groups) for g in range(groups)
            if (g * (hi - lo) // groups) != ((g + 1) * (hi - lo) // groups)]


def fill_live(plan: FoldPlan, slots: Sequence[str], row_bytes: Sequence[int], ids_out: np.ndarray,
              cols_out: Sequence[np.ndarray], scratch: Scratch | None = None) -> int:
    """`fill_fold`, then the surviving rows moved to the front of the buffers in their order (the holes
    dropped in place, no new memory); returns how many rows survive."""
    fill_fold(plan, slots, row_bytes, ids_out, cols_out, scratch)
    if not len(plan.holes):
        return plan.out_rows
    live = np.ones(plan.out_rows, dtype=bool)
    live[plan.holes] = False
    keep = np.flatnonzero(live)
    first = int(plan.holes.min())              # rows before the first hole stay where they are
    src, dst = keep[first:], np.arange(first, len(keep), dtype=np.int64)
    for w, o in zip([8, *row_bytes], [ids_out, *cols_out]):
        _C.copy_rows(o, src, o, dst, w)        # forward, src[k] > dst[k]: never reads a row it wrote
    return len(keep)


def folded_arrays(plan: FoldPlan, slots: list[str], row_bytes: list[int], scratch: Scratch | None = None
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rows of `plan` read into new arrays: `(ids int64[n], [uint8[n, row_bytes] per slot])`, the
    holes (base rows that do not survive) left out."""
    ids = np.empty(plan.out_rows, dtype="<i8")
    cols = [np.empty((plan.out_rows, rb), dtype=np.uint8) for rb in row_bytes]
    n = fill_live(plan, slots, row_bytes, ids.view(np.uint8), [c.reshape(-1) for c in cols], scratch)
    return ids[:n], [c[:n] for c in cols]


def fold_rows(links: Sequence[CheckpointReader], table: str, slots: Sequence[str] | None = None,
              lo: int = 0, hi: int | None = None, *, duplicates: str = "error",
              group_bytes: int = GROUP_BYTES) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """The rows of `table` in the state of the newest of `links`, buckets [lo, hi) (default: all).

    `links`: the chain, base first, as `recckpt.format.chain.open_chain(reader)` returns it (a full
    checkpoint is a chain of one). `slots`: slot names to return (default: all, in manifest order).
    Yields, per bucket group of about `group_bytes` of chain rows, `(ids int64[n], [uint8[n, row_bytes]
    per slot])`: new arrays the caller owns, ids unique, in no promised order. Ids and rows are verified
    as read. `duplicates`: 'error' or 'newest' (module docstring)."""
    links = table_links(list(links), table)
    info = links[-1].manifest.tables[table]
    slots = list(info.slots) if slots is None else list(slots)
    row_bytes = [info.slots[s].row_bytes for s in slots]
    hi = links[-1].manifest.num_buckets if hi is None else hi
    scratch = Scratch()
    for g_lo, g_hi in bucket_groups(links, table, lo, hi, group_bytes):
        plan = plan_fold(links, table, g_lo, g_hi, duplicates=duplicates)
        if plan.rows == 0:
            continue
        yield folded_arrays(plan, slots, row_bytes, scratch)
