"""`recckpt.diff(a, b)`: what differs between two checkpoints: tables, slots, dense keys and registered
objects added, removed or changed.

Without values, row contents are compared by the content digests the manifests record (docs/FORMAT.md
"Content digests"): no row is read, and the answer does not depend on either checkpoint's world size,
bucket count or packing. A table whose digest one side lacks (a checkpoint older than digests, or an
incremental checkpoint holding only the table's changes) is reported as not compared, and the
checkpoints are then not called the same. Nor are they when either side's files are missing or of another
size than its manifest and index record (checked by size only, so a diff stays cheap; `verify` reads every
byte). With values=True the rows are read and compared too (ids only
in one, rows changed, and the largest absolute difference per slot), bucket range by bucket range so
memory stays bounded. Neither imports torch."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, DuplicateIdsError
from .reader import CheckpointView, open as open_checkpoint, unless_damaged

#: Rows of both checkpoints held at once by a value diff are about this many bytes.
GROUP_BYTES = 64 << 20

#: Fields that say how a checkpoint was written, not what it holds: shown, never a difference.
LAYOUT_FIELDS = ("workers", "num_buckets", "format_version", "kind", "parent")


@dataclass
class SlotValues:
    changed_rows: int = 0
    max_abs_diff: float = 0.0     # over ids in both; inf when a NaN/inf differs


@dataclass
class TableValues:
    only_a: int = 0               # ids in A only (removed in B)
    only_b: int = 0               # ids in B only (added)
    common: int = 0
    changed_rows: int = 0         # common ids with any compared slot differing (bit for bit)
    slots: dict[str, SlotValues] = field(default_factory=dict)


@dataclass
class DiffReport:
    a: str
    b: str
    metadata: dict[str, tuple[Any, Any]] = field(default_factory=dict)      # field -> (a, b), differing only
    layout: dict[str, tuple[Any, Any]] = field(default_factory=dict)        # LAYOUT_FIELDS that differ: not content
    tables: dict[str, list[str]] = field(default_factory=lambda: {"added": [], "removed": [], "changed": []})
    slots: dict[str, dict[str, list[str]]] = field(default_factory=dict)     # table -> added/removed/changed
    contents: dict[str, list[str]] = field(default_factory=dict)
    """Table -> what its digests say differs: "ids" (the set of ids) and the slots whose rows differ."""
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)           # table -> rows (a, b), by digest
    not_compared: dict[str, str] = field(default_factory=dict)
    """Table -> why its rows could not be compared without values (no digest on a side)."""
    dense: dict[str, list[str]] = field(default_factory=lambda: {"added": [], "removed": [], "changed": []})
    objects: dict[str, list[str]] = field(default_factory=lambda: {"added": [], "removed": [], "changed": []})
    sparse_optimizer: str | None = None
    """The sparse optimizer's own state (hyper-parameters, step): "added", "removed", "changed" or None."""
    io_state: dict[str, list[str]] = field(default_factory=lambda: {"added": [], "removed": [], "changed": []})
    """IO state (readers' positions, RNG) by "worker W"."""
    values: dict[str, TableValues] | None = None
    digests_disagree: dict[str, list[str]] = field(default_factory=dict)
    """Table -> what its recorded digests said differs although its rows, compared by value (values=True),
    are equal bit for bit: a manifest records a wrong digest. Not a difference of contents, and the two
    are not called the same."""
    damaged: dict[str, list[str]] = field(default_factory=dict)
    """"a"/"b" -> that checkpoint's files found missing or of another size than recorded (by their sizes
    alone: `verify` reads every byte). Such a checkpoint cannot be loaded, so the two are never called the
    same, whatever their manifests record."""

    @property
    def differs(self) -> bool:
        """True when a difference was found."""
        structural = (any(self.tables.values()) or any(any(v.values()) for v in self.slots.values())
                      or any(self.dense.values()) or any(self.objects.values()) or any(self.io_state.values())
                      or self.sparse_optimizer is not None)
        rows = self.values is not None and any(v.only_a or v.only_b or v.changed_rows for v in self.values.values())
        return bool(self.metadata or structural or self.contents or rows)

    @property
    def same(self) -> bool:
        """True only when the checkpoints are known to hold the same state: nothing differs, and every
        table's rows were compared (by digest, or by value with values=True)."""
        return (not self.differs and not self.damaged and not self.digests_disagree
                and not (self.not_compared and self.values is None))


def _added_removed_changed(a: Mapping, b: Mapping, same) -> dict[str, list[str]]:
    return {"added": sorted(set(b) - set(a)), "removed": sorted(set(a) - set(b)),
            "changed": sorted(k for k in set(a) & set(b) if not same(a[k], b[k]))}


def _tree_equal(x, y) -> bool:
    """State trees (numpy arrays for tensors) equal bit for bit."""
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_tree_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_tree_equal(p, q) for p, q in zip(x, y))
    if type(x) is not type(y):
        return False
    if isinstance(x, (float, np.floating)):   # by bits, as arrays are: -0.0 differs from 0.0, a NaN equals itself
        return np.asarray(x).tobytes() == np.asarray(y).tobytes()
    return bool(x == y)


def diff(a: str | CheckpointView, b: str | CheckpointView, *, values: bool = False,
         storage_options: Mapping[str, Any] | None = None) -> DiffReport:
    va = a if isinstance(a, CheckpointView) else open_checkpoint(a, storage_options)
    vb = b if isinstance(b, CheckpointView) else open_checkpoint(b, storage_options)
    r = DiffReport(va.path, vb.path)
    for side, view in (("a", va), ("b", vb)):
        problems = view.files_problems()
        if problems:
            r.damaged[side] = problems
    for f in ("step", *LAYOUT_FIELDS):
        if getattr(va, f) != getattr(vb, f):
            (r.layout if f in LAYOUT_FIELDS else r.metadata)[f] = (getattr(va, f), getattr(vb, f))
    # The step each worker saved at decides which copy of an id two workers stored a load keeps
    # (duplicates='newest'), which the digests, sums over the stored copies, cannot show
    if "step" not in r.metadata and dict(va.worker_steps) != dict(vb.worker_steps) and \
            any(len(set(v.worker_steps.values())) > 1 for v in (va, vb)):   # (one step for all: no copy wins)
        r.metadata["worker_steps"] = (dict(va.worker_steps), dict(vb.worker_steps))
    r.tables = _added_removed_changed(va.schema, vb.schema, lambda x, y: x == y)
    for t in r.tables["changed"]:
        r.slots[t] = _added_removed_changed(
            va.schema[t], vb.schema[t], lambda x, y: (x.dtype, x.shape) == (y.dtype, y.shape))
    # Identical manifests describe identical files: known equal without any digest (e.g. `diff a a`).
    identical = va.manifest_sha256 is not None and va.manifest_sha256 == vb.manifest_sha256
    if not identical:
        for t in sorted(set(va.schema) & set(vb.schema)):
            _compare_table(va, vb, t, r)
    r.dense = _compare_dense(va, vb)
    oa = unless_damaged(r.damaged.get("a"), lambda: va.objects(arrays=True))
    ob = unless_damaged(r.damaged.get("b"), lambda: vb.objects(arrays=True))
    if oa is not None and ob is not None:   # (one side unreadable: not compared, never "added")
        r.objects = _added_removed_changed(oa["objects"], ob["objects"], _tree_equal)
        sa, sb = oa.get("sparse_optimizer"), ob.get("sparse_optimizer")
        if (sa is None) != (sb is None):
            r.sparse_optimizer = "added" if sa is None else "removed"
        elif sa is not None and not _tree_equal(sa, sb):
            r.sparse_optimizer = "changed"
    ia, ib = _io_states(r, "a", va), _io_states(r, "b", vb)
    unreadable = {w for w, v in (*ia.items(), *ib.items()) if v is _UNREADABLE}
    r.io_state = _added_removed_changed({w: v for w, v in ia.items() if w not in unreadable},
                                        {w: v for w, v in ib.items() if w not in unreadable}, _tree_equal)
    if values:
        r.values = {t: _table_values(va, vb, t) for t in sorted(set(va.schema) & set(vb.schema))}
        # the rows themselves decide: a digest verdict they contradict is the manifests' fault, not a change
        for t, v in r.values.items():
            if t in r.contents and not (v.only_a or v.only_b or v.changed_rows):
                r.digests_disagree[t] = r.contents.pop(t)
                r.rows.pop(t, None)
    return r


#: An IO state a damaged side could not give: that worker's state is compared on neither side.
_UNREADABLE = object()


def _io_states(r: DiffReport, side: str, view: CheckpointView) -> dict[str, Any]:
    """Each worker's saved IO state, by "worker W" (workers that saved none left out; a worker's state
    that a damaged side cannot give is `_UNREADABLE`)."""
    out = {}
    for w in view.io_state_workers:
        got = unless_damaged(r.damaged.get(side), lambda w=w: view.io_state(w, arrays=True))
        out[f"worker {w}"] = _UNREADABLE if got is None and side in r.damaged else got
    return out


def _compare_table(va: CheckpointView, vb: CheckpointView, table: str, r: DiffReport) -> None:
    """Contents of `table` by digest: the slots both sides have with one dtype and shape, and the ids."""
    da, why_a = va.table_digest(table)
    db, why_b = vb.table_digest(table)
    if da is None or db is None:
        r.not_compared[table] = why_a or why_b
        return
    if va.digest_hash != vb.digest_hash:
        r.not_compared[table] = _other_functions(va, vb)
        return
    r.rows[table] = (da.rows, db.rows)
    sa, sb = va.schema[table], vb.schema[table]
    common = [s for s in sa if s in sb and (sa[s].dtype, sa[s].shape) == (sb[s].dtype, sb[s].shape)]
    differ = (["ids"] if (da.rows, da.ids) != (db.rows, db.ids) else []) + \
        [s for s in common if da.slot_digests[s] != db.slot_digests[s]]
    if differ:
        r.contents[table] = differ
        return
    blind = _per_block_slots(va, vb, table, common)
    if blind:
        r.not_compared[table] = (f"slots {blind} keep one value a row per column block (a column-wise plan's "
                                 f"per-row optimizer state) and the digests cover block 0's alone")


def _other_functions(va: CheckpointView, vb: CheckpointView) -> str:
    return (f"{va.ckpt_id} and {vb.ckpt_id} record content digests of different functions ({va.digest_hash} "
            f"vs {vb.digest_hash}: written by different recckpt versions), which do not compare")


def _per_block_slots(va: CheckpointView, vb: CheckpointView, table: str, slots) -> list[str]:
    """The slots of `slots` that a side keeps one value a row per column block of (`block_values`): the
    digests and whole-row reads show block 0's value only."""
    return [s for s in slots if any(_blocks(v, table, s) for v in (va, vb))]


def _blocks(view: CheckpointView, table: str, slot: str) -> bool:
    cb = view.column_blocks(table)
    return cb is not None and len(cb.blocks) > 1 and slot not in cb.slots


def _compare_dense(va: CheckpointView, vb: CheckpointView) -> dict[str, list[str]]:
    """Dense keys added, removed or changed: by the manifests' digests where both record them, else by
    reading both dense files (dense state is small beside the tables)."""
    da, db = va.dense_digests, vb.dense_digests
    if da is not None and db is not None and va.digest_hash == vb.digest_hash:
        return _added_removed_changed(da, db, lambda x, y: x == y)
    return _added_removed_changed(va.dense_arrays(), vb.dense_arrays(), _tree_equal)


def _read_range(view: CheckpointView, table: str, slots: list[str], lo: int, hi: int):
    chunks = list(view.iter_rows(table, slots, chunk_rows=1 << 20, buckets=(lo, hi)))
    if not chunks:
        desc = view.tables[table].slots
        return np.empty(0, np.int64), {s: np.empty((0, *desc[s].shape), desc[s].numpy_dtype) for s in slots}
    ids = np.concatenate([c[0] for c in chunks])
    order = np.argsort(ids, kind="stable")
    return ids[order], {s: np.concatenate([c[1][s] for c in chunks])[order] for s in slots}


def _table_values(va: CheckpointView, vb: CheckpointView, table: str) -> TableValues:
    ta, tb = va.tables[table], vb.tables[table]
    slots = [s for s in ta.slots if s in tb.slots and (ta.slots[s].dtype, ta.slots[s].shape)
             == (tb.slots[s].dtype, tb.slots[s].shape)]
    out = TableValues(slots={s: SlotValues() for s in slots})
    per_block = set(_per_block_slots(va, vb, table, slots))
    # Same bucket count: bucket range k of A and of B hold the same ids, so ranges compare one at a time.
    if va.num_buckets == vb.num_buckets:
        row = 8 + sum(ta.slots[s].row_bytes for s in slots)
        groups = int(min(va.num_buckets, max(1, (ta.rows + tb.rows) * row // GROUP_BYTES + 1)))
        nb = va.num_buckets
        ranges = [(g * nb // groups, (g + 1) * nb // groups) for g in range(groups)]
    else:  # different bucketing: both whole (documented as needing memory for both tables)
        ranges = [None]
    for rng in ranges:
        lo_hi_a = rng or (0, va.num_buckets)
        lo_hi_b = rng or (0, vb.num_buckets)
        ia, ca = _read_range(va, table, slots, *lo_hi_a)
        ib, cb = _read_range(vb, table, slots, *lo_hi_b)
        _refuse_repeated_ids(va, table, ia)
        _refuse_repeated_ids(vb, table, ib)
        common, xa, xb = np.intersect1d(ia, ib, assume_unique=True, return_indices=True)
        out.only_a += len(ia) - len(common)
        out.only_b += len(ib) - len(common)
        out.common += len(common)
        if len(common) == 0:   # (an empty table, or no id in both: nothing to compare, and no row shape to infer)
            continue
        changed = np.zeros(len(common), dtype=bool)
        for s in slots:
            if s in per_block:   # every block's value, column range by column range of both sides' blocks
                x, y = _by_columns(va, vb, table, s, lo_hi_a, lo_hi_b, (ia, ca[s], xa), (ib, cb[s], xb))
            else:
                x, y = ca[s][xa].reshape(len(common), -1), cb[s][xb].reshape(len(common), -1)
            bits = x.view(np.uint8).reshape(len(common), -1) != y.view(np.uint8).reshape(len(common), -1)
            row_changed = bits.any(axis=1) if bits.size else np.zeros(len(common), bool)
            changed |= row_changed
            sv = out.slots[s]
            sv.changed_rows += int(row_changed.sum())
            if row_changed.any():
                d = np.abs(x[row_changed].astype(np.float64) - y[row_changed].astype(np.float64))
                m = float(np.max(np.where(np.isfinite(d), d, np.inf))) if d.size else 0.0
                sv.max_abs_diff = max(sv.max_abs_diff, m)
        out.changed_rows += int(changed.sum())
    return out


def _refuse_repeated_ids(view: CheckpointView, table: str, ids: np.ndarray) -> None:
    """Values compare one row an id: a checkpoint whose workers stored an id twice (ids routed
    inconsistently, docs/DISTRIBUTED.md) has no one value to compare until a load picks a copy."""
    s = np.sort(ids)
    rep = np.nonzero(s[1:] == s[:-1])[0]
    if len(rep):
        raise DuplicateIdsError(
            f"diff --values: checkpoint {view.path}: table {table!r} stores id {int(s[rep[0]])} more than once "
            f"({len(rep)} repeated ids in this bucket range), so its rows have no one value to compare; its "
            f"workers routed ids inconsistently. A load with load_conf {{'duplicates': 'newest'}} keeps one copy "
            f"(the worker that saved at the highest step); save that state again and diff the new checkpoint",
            path=view.path, table=table)


def _by_columns(va: CheckpointView, vb: CheckpointView, table: str, slot: str, buckets_a, buckets_b, side_a, side_b):
    """Per-block values of `slot` of the common rows as [n, k] of each side: column k of the finest split of
    both sides' blocks holds, per side, the value of its block covering those columns (a side without blocks:
    the row's one value). Equal exactly when both sides give every column the same value."""
    got = []
    for view, buckets, (ids, whole, at) in ((va, buckets_a, side_a), (vb, buckets_b, side_b)):
        blocks = view.block_values(table, slot, buckets)
        if blocks is None:
            got.append([((0, None), whole[at])])
            continue
        bids, values = blocks
        if not np.array_equal(bids, ids):
            raise CorruptCheckpointError(f"{view.path}: table {table!r}: its column blocks hold other rows than "
                                         f"its whole-row read; run recckpt verify", view.path)
        got.append([(rng, v[at]) for rng, v in values])
    edges = sorted({c for side in got for (c0, c1), _ in side for c in (c0, c1) if c is not None})
    starts = edges[:-1] or [0]

    def pick(side, c):
        return next(v for (c0, c1), v in side if c0 <= c and (c1 is None or c < c1))
    n = len(side_a[2])
    return tuple(np.concatenate([pick(side, c).reshape(n, -1) for c in starts], axis=1) for side in got)


__all__ = ["DiffReport", "SlotValues", "TableValues", "diff"]
