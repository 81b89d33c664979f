"""Applying a checkpoint to live objects: match it against the model, check everything that can be
checked before anything changes, then apply it (the load half of `Saver`)."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import (
    CorruptCheckpointError,
    DuplicateIdsError,
    IncompatibleCheckpointError,
    LoadApplyError,
    LoadConfigError,
    RecckptError,
)
from ..format import dtypes, extras as extras_fmt
from ..format.chain import open_chain, table_links
from ..format.checkpoint import CheckpointReader
from ..format.fold import fold_rows
from ..format.hashing import bucket_range, hash_ownership
from ..format.names import RNG_IO_NAME
from ..format.segment_groups import read_rows
from ..state import optim_names, plugins
from ..state.protocol import (
    Admission,
    FixedSize,
    RoutedRows,
    column_split_slots,
    implements,
    pieces_of,
    split_sparse_dense_state_dict,
)
from ..state.registry import Registry
from . import kept_rows
from .casting import cast_to
from .chain_load import load_chain_rows, plan_chain
from .fixed_rows import DirectRows, OwnedRows
from .load_config import LoadConfig
from .row_filter import RowFilter, owners_of
from .sparse_load import (
    direct_load_possible,
    lends_host_memory,
    load_table_rows,
    map_table_rows,
    mapped_load_possible,
    put_rows,
    slot_tensors,
)

#: A table with fewer bytes of rows than this (in the loading rank's buckets) is read with its neighbours
#: (`_prefetch_groups`): its cost is the engine calls, not its bytes.
SMALL_TABLE_BYTES = 1 << 20
#: Bytes of rows of small tables read ahead at once (held until their tables take them).
PREFETCH_BYTES = 16 << 20

log = logging.getLogger("recckpt")


@dataclass
class LoadResult:
    """What a load applied. `missing`/`unexpected` list what strict=False let through."""
    path: str
    ckpt_id: str | None
    tables: list[str] = field(default_factory=list)
    dense_keys: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    io_state: list[str] = field(default_factory=list)
    io_state_dropped: list[str] = field(default_factory=list)
    """Registered IO state not loaded: every name when the checkpoint was saved by another number of
    workers (`io_state_on_resize='drop'`), or the optional ones (`register_io_state(..., optional=True)`)
    the checkpoint does not hold."""
    sparse_rows: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0
    other_bytes_read: int = 0
    """Bytes of the dense, extras and IO-state files read (`bytes_read` counts the sparse shard files)."""
    bytes_mapped: int = 0
    """Of `bytes_read`, the bytes mapped into tables copy-on-write instead of copied (`LoadConfig.mmap`)."""
    tables_mapped: list[str] = field(default_factory=list)
    """Tables (model names) whose storage now maps part of the checkpoint (`LoadConfig.mmap`)."""
    seconds: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    """The checkpoint's manifest metadata (e.g. the CheckpointManager's global step)."""
    saved_by_workers: int = 0
    """How many workers saved the checkpoint (0: not known)."""
    admission: dict[str, dict] = field(default_factory=dict)
    """Per table that admits a bounded number of ids (`RoutedRows`: TorchRec's managed-collision tables,
    by model name): the ids `admitted` and `left_out` for want of room over the whole table, per reason
    the ids `refused` because the table cannot hold them (with strict=False), and the ids kept `here`."""



def io_state_resized(conf: LoadConfig, registry, manifest, world: int) -> bool:
    """Whether a load of `manifest` on `world` workers meets per-worker IO state it cannot apply: the load
    wants IO state, objects are registered for it, the checkpoint holds some, and another number of
    workers saved it (LoadConfig.io_state_on_resize then says what happens)."""
    return bool(conf.wants("io_state") and registry.io_names() and manifest.io_state and world != manifest.shard_num)


class LoadPlan:
    """Matches a checkpoint against the live objects, checks everything that can be checked up front,
    then applies it."""

    def __init__(self, model, sparse_optim, registry: Registry, reader: CheckpointReader, conf: LoadConfig,
                 result: LoadResult):
        self.model, self.sparse_optim, self.registry = model, sparse_optim, registry
        self.reader, self.conf, self.result = reader, conf, result
        self.m = reader.manifest
        self.problems_missing: list[str] = []
        self.problems_unexpected: list[str] = []
        self.incompatible: list[str] = []
        self.cast_tables: set[str] = set()   # checkpoint tables some slot of which is loaded with a cast
        self.skipped_objects: set[str] = set()   # registered objects whose saved state must not be applied
        self._fixed_tried: set[str] = set()   # fixed-size tables planned for a read with others (or found unfit)
        self._links: list[CheckpointReader] | None = None   # an incremental checkpoint's chain (`_chain_links`)

    # ---------------------------------------------------------------------------------- prepare
    def prepare(self, shard_id: int, world: int):
        conf, m = self.conf, self.m
        objects = [self.registry.object(n) for n in self.registry.object_names()]
        sparse, dense = split_sparse_dense_state_dict(plugins.model_state_dict(self.model, objects))
        self.model_sparse, self.model_dense = sparse, dense
        self.sparse_jobs = []   # (ckpt name, table, [(slot, SlotInfo, SlotSpec)])
        self.left_out: dict[str, list[str]] = {}   # ckpt name -> slots a replacing load resets (`_clear`)
        if conf.wants("sparse") or conf.wants("sparse_opt"):
            self.reader.verify_worker_indexes()
            if m.index is not None:
                _ = self.reader.segments  # parse the index and check every shard size before touching tables
            matched_model: dict[str, str] = {}   # model table → the checkpoint table loaded into it
            for name, info in m.tables.items():
                if not conf.table_selected(name):
                    continue
                target = conf.renamed(name)
                table = sparse.get(target)
                if table is None:
                    self._not_in_model("sparse table", name, target)
                    continue
                if self._claimed("sparse table", matched_model, name, target):
                    continue
                meta = table.sparse_meta()
                slots = []
                for slot, si in info.slots.items():
                    if not conf.slot_selected(slot):
                        continue
                    if not conf.wants(si.category):
                        continue
                    spec = meta.slots.get(slot)
                    if spec is None:
                        self.problems_unexpected.append(f"slot {slot!r} of table {name!r} is not in the model")
                        continue
                    self._check_compatible(f"table {name!r} slot {slot!r}", si.dtype, si.shape,
                                           spec.dtype, tuple(spec.shape))
                    if si.dtype != dtypes.name_of(spec.dtype):
                        self.cast_tables.add(name)
                    slots.append((slot, si, spec))
                if implements(table, FixedSize) and slots:
                    n = pieces_of(table)[0].row_layout().num_rows
                    if not conf.merge and m.parent is None and info.rows != n:   # (a chain's: _plan_chains)
                        self.incompatible.append(
                            f"table {name!r}: the checkpoint holds {info.rows} rows, model table {target!r} has "
                            f"{n} (a fixed-size table is replaced whole; load_conf 'merge': True loads it into a "
                            f"larger table)")
                    elif conf.merge and info.num_rows > n:
                        # Checked here, before anything is applied: the row paths refuse an id past the end.
                        self.incompatible.append(
                            f"table {name!r}: the checkpoint's table has {info.num_rows} rows, model table "
                            f"{target!r} {n}; a merge loads a fixed-size table into one at least as large (rows "
                            f"past the end are not dropped): build the model table with >= {info.num_rows} rows, "
                            f"or leave this table out with load_conf 'tables'")
                    if info.bucket_fn != "row_range" and m.parent is None and not self.incompatible:
                        self._check_row_ids(name, target, n, not conf.merge, (
                            ids for ids, _ in self.reader.segments.iter_table(name, [], [], 0, m.num_buckets)))
                if implements(table, RoutedRows) and slots and info.column_blocks is not None:
                    self.incompatible.append(
                        f"table {name!r} was saved column-split (a column-wise TorchRec plan): managed-collision "
                        f"table {target!r} cannot read it (it reads rows by id range); warm-start a TorchRec table or a "
                        f"HashTable from it instead")
                elif implements(table, RoutedRows) and slots and not self.incompatible:
                    self._plan_routed(name, target, table, info, slots)
                for slot, spec in meta.slots.items():
                    if conf.wants(spec.category) and conf.slot_selected(slot) and slot not in info.slots:
                        self.problems_missing.append(f"slot {slot!r} of model table {target!r} is not in the checkpoint")
                self._plan_left_out(name, target, table, meta, slots)
                self.sparse_jobs.append((name, target, table, slots))
            self._plan_chains(shard_id, world)
            # A model table the checkpoint holds under its own name but renames away (a copy of t0 into
            # t1) is not a target of this load: it is left as it is, not missing.
            moved_away = {n for n in m.tables if conf.table_selected(n) and conf.renamed(n) != n}
            for target in sparse:
                if target not in matched_model and conf.table_selected(target) and target not in moved_away:
                    self.problems_missing.append(f"model sparse table {target!r} is not in the checkpoint")
        self.dense_out = {}
        if conf.wants("dense"):
            ckpt_dense = self.reader.dense()
            matched: dict[str, str] = {}   # model key → the checkpoint key loaded into it
            for key, t in ckpt_dense.items():
                if not conf.dense_selected(key):
                    continue
                target = conf.renamed(key)
                cur = dense.get(target)
                if cur is None:
                    self._not_in_model("dense key", key, target)
                    continue
                if self._claimed("dense key", matched, key, target):
                    continue
                if cur.device.type == "meta":
                    # load_state_dict copies into storage a meta tensor has none of: a no-op, not a load
                    self.incompatible.append(
                        f"model dense key {target!r} is on the meta device (no storage to load into): "
                        f"materialize the model first (model.to_empty(device='cpu'), then load)")
                    continue
                # An uninitialized lazy parameter (LazyLinear before its first forward) has no shape yet:
                # the model's load_state_dict materializes it with the saved one, as torch's own load does.
                shape = optim_names.live_shape(cur)
                self._check_compatible(f"dense key {key!r}", dtypes.name_of(t.dtype), tuple(t.shape),
                                       cur.dtype, tuple(t.shape) if shape is None else shape)
                self.dense_out[target] = cast_to(t, cur.dtype, f"dense key {target!r}")
            moved_away = {k for k in ckpt_dense if conf.dense_selected(k) and conf.renamed(k) != k}
            for key in dense:
                if key not in matched and conf.dense_selected(key) and key not in moved_away:
                    self.problems_missing.append(f"model dense key {key!r} is not in the checkpoint")
        sparse_wanted = conf.wants("sparse") or conf.wants("sparse_opt")
        self.problems_unexpected += conf.unmatched(
            list(m.tables) if sparse_wanted else None,
            sorted({s for t in m.tables.values() for s in t.slots}) if sparse_wanted else None,
            list(ckpt_dense) if conf.wants("dense") else None)
        self.extras_tree = None
        if conf.wants("extra") or conf.wants("sparse_opt"):
            tree = self.reader.extras()
            if tree is None:
                self.extras_tree = {"objects": {}, "sparse_optimizer": None}
            else:
                where = self.reader.describe(self.m.extras)
                tree = extras_fmt.validate(tree, where)
                wanted = ({n: self.registry.allows_pickle(n) for n in self.registry.object_names()}
                          if conf.wants("extra") else {})
                self.extras_tree = extras_fmt.unpickle_allowed(tree, wanted, where)
        if conf.wants("extra"):
            objs = self.extras_tree.get("objects", {})
            for name in self.registry.object_names():
                if name not in objs:
                    self.problems_missing.append(f"registered object {name!r} is not in the checkpoint")
            for name in objs:
                if name not in self.registry.object_names():
                    self.problems_unexpected.append(f"checkpoint object {name!r} is not registered")
                elif not objs[name]["kind"].startswith(extras_fmt.PICKLED_PREFIX):
                    why = self.registry.refusal(name, objs[name]["kind"], objs[name]["state"])
                    if why is not None:
                        self.incompatible.append(why + " (exclude 'extra', or register it as the same type)")
            self._plan_optimizers(objs, ckpt_dense if conf.wants("dense") else None)
        self.io_tree = None
        resized = io_state_resized(conf, self.registry, self.m, world)
        if resized and conf.io_state_on_resize == "error":
            raise IncompatibleCheckpointError(
                f"checkpoint {self.reader.describe()} was saved by {self.m.shard_num} worker(s) and is loaded "
                f"on {world}: IO state (reader positions) is per worker and cannot be split or merged. Nothing "
                f"was loaded. Pass load_conf {{'io_state_on_resize': 'drop'}} to load everything else and "
                f"restart the readers, or exclude 'io_state'.")
        if resized:
            self.result.io_state_dropped = self.registry.io_names()
            log.warning("recckpt: IO state of %s not loaded: saved by %d worker(s), loading on %d "
                        "(io_state_on_resize='drop')", self.reader.describe(), self.m.shard_num, world)
        elif conf.wants("io_state") and self.registry.io_names():
            self.io_tree = self.reader.io_state(shard_id)
            absent = [n for n in self.registry.io_names() if self.io_tree is None or n not in self.io_tree]
            self.result.io_state_dropped = [n for n in absent if self.registry.io_optional(n)]
            required = [n for n in absent if not self.registry.io_optional(n)]
            if self.io_tree is None and required:
                self.problems_missing.append(f"IO state of worker {shard_id} is not in the checkpoint "
                                             f"(it was written by {self.m.shard_num} worker(s)): {required}")
            elif self.io_tree is not None:
                for name in required:
                    self.problems_missing.append(f"IO state {name!r} is not in the checkpoint")
                self._unexpected_io_state(self.io_tree, shard_id)
        elif conf.wants("io_state") and world == self.m.shard_num and shard_id in self.m.io_state:
            # Nothing registered, but this worker saved IO state: a reader the job forgot to register would
            # silently start over (its data seen twice).
            self._unexpected_io_state(self.reader.io_state(shard_id) or {}, shard_id)
        if conf.wants("sparse_opt") and self.extras_tree is not None:
            saved = self.extras_tree.get("sparse_optimizer") is not None
            if saved and self.sparse_optim is None and self.sparse_jobs_hold_optimizer_slots():
                self.problems_unexpected.append(
                    "the checkpoint holds a sparse optimizer's own state (its step counts), and this Saver has "
                    "no sparse optimizer (pass it as Saver(model, sparse_optim, ...))")
            elif (not saved and self.sparse_optim is not None and getattr(self.sparse_optim, "steps_matter", False)
                  and self.sparse_jobs_hold_optimizer_slots()):
                self.problems_missing.append(
                    f"the sparse optimizer's own state (its step counts) is not in the checkpoint: it was saved "
                    f"without a sparse optimizer, so {type(self.sparse_optim).__name__} would keep its live "
                    f"steps beside the loaded slots")
            elif saved and self.sparse_optim is not None and getattr(self.sparse_optim, "steps_matter", False):
                self._missing_step_counts(self.extras_tree["sparse_optimizer"])
        self._check_renames()
        if conf.ownership is not None and not self.incompatible:
            self._check_ownership(world)
        if self.incompatible:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.reader.describe()} cannot be applied: " + "; ".join(self.incompatible)
                + ". Nothing was loaded.")
        problems = self.problems_missing + self.problems_unexpected
        self.result.missing, self.result.unexpected = self.problems_missing, self.problems_unexpected
        if problems:
            text = (f"checkpoint {self.reader.describe()} does not match the model: " + "; ".join(problems))
            if self.conf.strict:
                raise IncompatibleCheckpointError(
                    text + ". Nothing was loaded. To load what matches, use load_conf {'strict': False}; to map "
                    "names, 'rename'/'tables'/'dense_keys'; when only optimizer slots differ (another sparse "
                    "optimizer), {'exclude': ['sparse_opt']}; for registered objects, {'exclude': ['extra']}.")
            warnings.warn(text, stacklevel=3)

    def _check_row_ids(self, name: str, target: str, n: int, replacing: bool, id_batches) -> None:
        """A hash-keyed checkpoint table (a HashTable's) into fixed-size model table `target` of `n` rows:
        its ids (`id_batches`: every id the load would apply, a chain's as folded) are row indices there,
        so every id must lie in [0, n), and a replacing load needs each row exactly once. Checked on the
        ids alone (8 bytes a row, a byte a row of memory) before anything is applied: found while applying,
        a bad id stopped the load with the table half written, and a row no id set kept its old values."""
        seen = np.zeros(n, dtype=bool) if replacing else None
        total = 0
        for ids in id_batches:
            ids = np.asarray(ids)
            total += len(ids)
            bad = ids[(ids < 0) | (ids >= n)]
            if bad.size:
                self.incompatible.append(
                    f"table {name!r}: id {int(bad[0])} (and {bad.size - 1} more in this part) is not a row of "
                    f"fixed-size model table {target!r}, whose ids are its row indices 0..{n - 1}; build the model "
                    f"table with more rows, or warm-start a HashTable instead")
                return
            if seen is not None:
                seen[ids] = True
        if seen is not None and not seen.all():
            covered = int(seen.sum())
            self.incompatible.append(
                f"table {name!r}: its ids do not cover rows 0..{n - 1} of fixed-size model table {target!r} "
                f"({n - covered} rows have none{', and some ids repeat' if total > covered else ''}; the "
                f"checkpoint holds {total} rows); a replacing load sets every row once (load_conf 'merge': True "
                f"writes only the rows it holds)")

    def _unexpected_io_state(self, tree, shard_id: int) -> None:
        """Entries of this worker's saved IO state that nothing registered takes (recckpt's own RNG entry
        aside: a manager may restore without saving RNG)."""
        for name in tree:
            if name not in self.registry.io_names() and name != RNG_IO_NAME:
                self.problems_unexpected.append(
                    f"IO state {name!r} of worker {shard_id} is not registered (register_io_state it, or exclude "
                    f"'io_state')")

    def sparse_jobs_hold_optimizer_slots(self) -> bool:
        """Whether this load writes any optimizer slot (what a sparse optimizer's step counts pair with)."""
        return any(si.category == "sparse_opt" for _, _, _, slots in self.sparse_jobs for _, si, _ in slots)

    def _check_renames(self) -> None:
        """Every `rename` key must name a table or dense key of the checkpoint, under any `strict`: strict is
        about the model, a rename names the checkpoint, and a typo there would load nothing for that name
        (docs/LOADING.md). The dense file's header is read only when a key names no table."""
        if not self.conf.rename:
            return
        unknown = self.conf.unknown_renames(self.m.tables)
        if unknown:
            unknown = self.conf.unknown_renames(list(self.m.tables) + list(self.reader.dense_header()))
        for k in unknown:
            self.incompatible.append(
                f"load_conf rename key {k!r} names no table or dense key of the checkpoint (tables: "
                f"{sorted(self.m.tables)[:20]}); a rename maps checkpoint names to model names")

    def _plan_routed(self, name: str, target: str, table, info, slots) -> None:
        """A table that routes ids itself and holds a bounded number of them (`RoutedRows`): let it see
        every id of the checkpoint's table (and the slots it ranks them by) and decide which it keeps,
        before anything is applied; a refusal (the ids do not fit) is one of the load's incompatibilities."""
        if self.conf.merge:
            self.incompatible.append(f"table {name!r} routes its ids itself and is replaced whole: load_conf "
                                     f"'merge' does not apply to it")
            return
        rows_of = self.reader.segments.iter_table   # (name, slots, row bytes, lo, hi) -> (ids, columns)
        if self.m.parent is not None:   # a chain: the table sees the ids and rows the links fold to
            try:
                tl = table_links(self._chain_links(), name)
            except IncompatibleCheckpointError as e:
                self.incompatible.append(str(e))
                return
            rows_of = lambda n, ss, _rbs, lo, hi: fold_rows(tl, n, ss, lo, hi, duplicates=self.conf.duplicates)  # noqa: E731
        rank_by = self.conf.admit_by
        if rank_by is not None and (rank_by not in info.slots or info.slots[rank_by].shape != ()):
            self.incompatible.append(
                f"table {name!r}: load_conf admit_by {rank_by!r} names no slot of the checkpoint's table with one "
                f"value per row (it has {sorted(info.slots)})")
            return
        want = [rank_by] if rank_by is not None else [s for s in table.plan_slots() if s in info.slots]
        rbs = [info.slots[s].row_bytes for s in want]
        sis = [info.slots[s] for s in want]

        mine = kept_rows.routed_bucket_ranges(self.m, name, table)

        def chunks():
            # The buckets of this process's ids with the ranking slots; every other bucket with its ids
            # only (8 bytes a row), so that the table counts every shard's ids exactly (its capacity check).
            for lo, hi in _complement(mine, self.m.num_buckets):
                for ids, _ in rows_of(name, [], [], lo, hi):
                    yield torch.from_numpy(ids), {}
            for lo, hi in mine:
                for ids, cols in rows_of(name, want, rbs, lo, hi):
                    n = len(ids)
                    yield torch.from_numpy(ids), {s: torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape)
                                                  for s, si, raw in zip(want, sis, cols)}
        admission = Admission(self.conf.overflow, rank_by, self.conf.strict)
        try:
            got = table.plan_rows(chunks(), [s for s, _, _ in slots], admission)
        except IncompatibleCheckpointError as e:
            self.incompatible.append(str(e))
            return
        self.result.admission[target] = got.as_dict()
        if got.refused:
            warnings.warn(f"checkpoint {self.reader.describe()}: table {name!r} -> {target!r}: ids the table cannot "
                          f"hold were left out: {dict(got.refused)}", stacklevel=4)

    def _plan_optimizers(self, objs: dict, ckpt_dense) -> None:
        """Registered optimizers get their saved state by parameter name (state layer, optim_names),
        never by position: each entry's state is replaced by what the live optimizer's load_state_dict
        is given, and mismatches join the load's report. A checkpoint that records no names (saved
        before they were recorded) applies positionally only where its dense keys and shapes are the
        model's exactly; otherwise the optimizer is left as it is, reported as missing."""
        shapes = None

        def dense_shapes() -> dict[str, tuple]:
            nonlocal shapes
            if shapes is None:
                shapes = ({k: tuple(t.shape) for k, t in ckpt_dense.items()} if ckpt_dense is not None else
                          {k: tuple(shape) for k, (_, shape) in self.reader.dense_header().items()})
            return shapes

        where = self.reader.describe(self.m.extras or "")
        for name in self.registry.object_names():
            entry = objs.get(name)
            obj = self.registry.object(name)
            if entry is None or entry["kind"] != "state_dict" or not optim_names.is_optimizer(obj):
                continue
            what = f"registered optimizer {name!r}"
            saved = entry["state"]
            names = entry.get(extras_fmt.PARAM_NAMES)
            if names is not None and optim_names.is_positional(saved):
                try:
                    saved = optim_names.to_named(saved, names, f"{where}: object {name!r}")
                except IncompatibleCheckpointError as e:
                    raise CorruptCheckpointError(str(e), where) from None
            elif optim_names.is_positional(saved):
                self._positional_optimizer(name, what, dense_shapes())
                continue
            # an integration's tables may hold some parameters' state (a TorchRec data-parallel table's): it
            # adds their live entries, also to a state left with no entry of its own (an optimizer of such
            # tables only)
            saved = plugins.loaded_object_state(self.model, obj, saved, self._opt_tables(), self._param_renamed)
            if not optim_names.is_named(saved):
                continue   # no parameters to map (an empty state): applied as it is
            try:
                m = optim_names.match_optimizer_state(
                    obj, self.model, saved, rename=self._param_renamed, selected=self.conf.dense_selected,
                    saved_shapes=dense_shapes())
            except RecckptError as e:
                self.incompatible.append(f"{what}: {e}")
                continue
            self.incompatible += [f"{what}: {c}" for c in m.conflicts]
            # A lazy parameter not yet run takes its shape from the dense state a load gives it: without
            # that, the state would fix a shape the module's first forward may contradict at the first step.
            unshaped = [n for n in m.matched if n not in self.dense_out and n in self.model_dense
                        and optim_names.live_shape(self.model_dense[n]) is None]
            if unshaped:
                self.incompatible.append(
                    f"{what}: parameters {unshaped[:5]} are uninitialized (lazy modules before their first forward) "
                    f"and this load does not give them their dense state, so their saved optimizer state cannot be "
                    f"checked against a shape: load 'dense' with it, run a forward before loading, or leave the "
                    f"optimizer out (exclude 'extra')")
            missing, unexpected = m.problems(what)
            self.problems_missing += missing
            self.problems_unexpected += unexpected
            objs[name] = dict(entry, state=m.state_dict)
            if list(m.group_sources) != list(range(len(m.group_sources))):
                self._reorder_schedulers(objs, obj, m.group_sources)

    def _reorder_schedulers(self, objs: dict, optimizer, sources) -> None:
        """The registered LR schedulers of `optimizer`, whose param groups the load matched by name in another
        order than saved: their per-group lists (base_lrs, ...) follow, or a closed-form schedule (LambdaLR)
        would give each group another's learning rate at its next step."""
        for name in self.registry.object_names():
            sched, entry = self.registry.object(name), objs.get(name)
            if (entry is not None and entry["kind"] == "state_dict" and isinstance(entry["state"], dict)
                    and getattr(sched, "optimizer", None) is optimizer and callable(getattr(sched, "state_dict", None))):
                objs[name] = dict(entry, state=optim_names.scheduler_state(entry["state"], sched.state_dict(), sources))

    def _param_renamed(self, name: str) -> str:
        """A saved optimizer's parameter name under `rename`: as a dense key; else, a parameter of a table
        the rename names exactly (a TorchRec data-parallel table's weight, which a torch.optim optimizer
        steps) follows its table, as the table's rows do."""
        got = self.conf.renamed(name)
        if got != name:
            return got
        table = max((t for t in self.conf.rename if t in self.m.tables and name.startswith(t + ".")), key=len,
                    default=None)
        return name if table is None else self.conf.rename[table] + name[len(table):]

    def _missing_step_counts(self, st) -> None:
        """Tables whose optimizer slots this load applies but whose step counts the saved optimizer state
        lacks: only worker 0's sparse optimizer state is saved, so a table no table of worker 0 was (one
        only some ranks hold) has none, and its slots would be stepped from the live count."""
        saved = st.get("tables") if isinstance(st, dict) else None
        live = self.sparse_optim.state_dict().get("tables")
        if not isinstance(saved, dict) or not isinstance(live, dict):
            return
        lost = sorted(name for name, target in self._opt_tables().items() if target in live and name not in saved)
        if lost:
            self.problems_missing.append(
                f"the sparse optimizer's step counts of tables {lost} are not in the checkpoint (its optimizer "
                f"state is worker 0's, and worker 0 did not hold them when it saved), so "
                f"{type(self.sparse_optim).__name__} would step their loaded optimizer slots from its live counts; "
                f"give worker 0 every table, or load with strict=False to accept that")

    def _opt_tables(self) -> dict[str, str]:
        """Checkpoint table -> model table, for the tables whose optimizer slots this load applies."""
        return {name: target for name, target, _, slots in self.sparse_jobs
                if any(si.category == "sparse_opt" for _, si, _ in slots)}

    def _positional_optimizer(self, name: str, what: str, ckpt_shapes: dict[str, tuple]) -> None:
        """An optimizer's numbered state without names (older checkpoints): safe only when the
        parameters are the same, which the dense state shows: same keys (after renames), same shapes."""
        renamed = {self.conf.renamed(k): v for k, v in ckpt_shapes.items()}
        # (an uninitialized lazy parameter takes the saved shape)
        model_shapes = {k: renamed.get(k) if shape is None else shape
                        for k, shape in ((k, optim_names.live_shape(v)) for k, v in self.model_dense.items())}
        if renamed == model_shapes:
            return
        diff = sorted(set(renamed) ^ set(model_shapes)) or sorted(
            k for k in renamed if renamed[k] != model_shapes.get(k))
        self.skipped_objects.add(name)
        self.problems_missing.append(
            f"{what}: the checkpoint records no parameter names (written before they were recorded) and its "
            f"dense keys or shapes differ from the model's ({', '.join(map(repr, diff[:5]))}"
            f"{', ...' if len(diff) > 5 else ''}), so its state, numbered by position, could go to the wrong "
            f"parameters: not applied (the optimizer keeps its own state)")

    def _plan_chains(self, shard_id: int, world: int) -> None:
        """For an incremental checkpoint: open and check every link of its chain, and decide which rows of
        which link each table keeps (reading the ids), all before the model is touched."""
        self.chain_plans = {}
        if self.m.parent is None:
            return
        links = self._chain_links()
        lo, hi = bucket_range(shard_id, world, self.m.num_buckets)
        if self.conf.ownership is not None:
            lo, hi = 0, self.m.num_buckets
        for name, target, table, slots in self.sparse_jobs:
            if not slots:
                continue
            try:
                tl = table_links(links, name)
            except IncompatibleCheckpointError as e:   # (a chain no fold can read: refused before applying)
                self.incompatible.append(str(e))
                continue
            if implements(table, FixedSize):
                n = pieces_of(table)[0].row_layout().num_rows
                if self.m.tables[name].bucket_fn != "row_range":
                    # hash-keyed rows (a HashTable's chain): the ids the chain folds to are row indices there,
                    # checked as a full checkpoint's are, before anything is applied
                    if not self.incompatible:
                        folded = (ids for ids, _ in fold_rows(tl, name, [], duplicates=self.conf.duplicates))
                        self._check_row_ids(name, target, n, not self.conf.merge, folded)
                elif not self.conf.merge and tl[0].manifest.tables[name].rows != n:
                    self.incompatible.append(
                        f"table {name!r}: the chain's base {tl[0].describe()} holds {tl[0].manifest.tables[name].rows} "
                        f"rows, model table {target!r} has {n} (a fixed-size table is replaced whole; load_conf "
                        f"'merge': True loads it into a larger table)")
            if len(tl) > 1:
                t_lo, t_hi, keep = lo, hi, None
                if implements(table, RoutedRows):
                    # the buckets that can hold its ids, and the ids it planned to keep (`_plan_routed`)
                    ranges = kept_rows.routed_bucket_ranges(self.m, name, table)
                    t_lo, t_hi = min(a for a, _ in ranges), max(b for _, b in ranges)
                    keep = lambda ids, t=table: t.keep(torch.from_numpy(ids)).numpy()  # noqa: E731
                elif implements(table, FixedSize):
                    # the buckets of its owned rows ("row_range"; every bucket under "hash"); OwnedRows keeps
                    # exactly its rows and columns of what the fold gives
                    ranges = [r for p in pieces_of(table) for r in kept_rows.fixed_bucket_ranges(self.m, name,
                                                                                                 p.row_layout())]
                    t_lo, t_hi = (min(a for a, _ in ranges), max(b for _, b in ranges)) if ranges else (0, 0)
                self.chain_plans[name] = plan_chain(tl, name, t_lo, t_hi, rank=shard_id, world=world,
                                                    ownership=self.conf.ownership,
                                                    duplicates=self.conf.duplicates, keep=keep)

    def _chain_links(self) -> list[CheckpointReader]:
        """The links of this incremental checkpoint's chain, base first (opened and checked once)."""
        if self._links is None:
            self._links = open_chain(self.reader)
        return self._links

    def replaced_whole_state(self) -> bool:
        """Whether this load replaced every sparse table of the model with the checkpoint's, all slots,
        under the same names: then the checkpoint can be the parent of the next incremental save."""
        c = self.conf
        # A table loaded with a cast holds other slot dtypes than the checkpoint: an increment on it could
        # never be folded onto its parent (a chain's links share each table's slots). A slot the load left
        # out restarted at its initial value, which a fold onto the parent would bring back (slots filter).
        every_slot = all({slot for slot, _, _ in slots} == set(table.sparse_meta().slots)
                         for _, _, table, slots in self.sparse_jobs)
        return (c.wants("sparse") and c.wants("sparse_opt") and not c.merge and not self.problems_missing
                and not self.problems_unexpected and not self.cast_tables and every_slot
                and all(name == target for name, target, _, _ in self.sparse_jobs)
                and set(self.result.tables) == set(self.model_sparse))

    def _check_ownership(self, world: int) -> None:
        """Call the user's ownership function on every id it will be given, before anything is applied:
        a function that fails or returns wrong ranks must not leave a table emptied (the apply pass
        calls it again on the same ids; reading the ids twice is the price, 8 bytes a row)."""
        for name, _, _, slots in self.sparse_jobs:
            if not slots:
                continue
            for ids, _ in self.reader.segments.iter_table(name, [], [], 0, self.m.num_buckets):
                try:
                    owners_of(self.conf.ownership, ids, world, name, self.reader.describe())
                except LoadConfigError as e:
                    raise LoadConfigError(f"{e}. Nothing was loaded.") from e.__cause__

    def _claimed(self, kind: str, matched: dict[str, str], name: str, target: str) -> bool:
        """Record that checkpoint `name` loads into model `target`; two sources for one target (a
        rename onto a name the checkpoint also has) would silently overwrite each other: refuse."""
        other = matched.setdefault(target, name)
        if other != name:
            first, second = sorted((other, name))
            self.incompatible.append(f"checkpoint {kind}s {first!r} and {second!r} both map to model {kind} "
                                     f"{target!r} (check load_conf 'rename' and 'tables'/'dense_keys')")
            return True
        return False

    def _not_in_model(self, kind: str, name: str, target: str) -> None:
        renamed = f" (renamed {target!r})" if target != name else ""
        self.problems_unexpected.append(f"{kind} {name!r}{renamed} is not in the model")

    def _check_compatible(self, what: str, ck_dtype: str, ck_shape, dtype: torch.dtype, shape):
        if tuple(ck_shape) != tuple(shape):
            self.incompatible.append(f"{what}: checkpoint shape {tuple(ck_shape)} vs model shape {tuple(shape)} "
                                     f"(build the model with the checkpoint's shape, or leave this out of the load "
                                     f"with load_conf 'tables', 'slots', 'dense_keys' or 'exclude')")
            return
        model_name = dtypes.name_of(dtype)
        if ck_dtype != model_name and not (self.conf.cast and dtypes.is_float(ck_dtype) and dtypes.is_float(model_name)):
            self.incompatible.append(
                f"{what}: checkpoint dtype {ck_dtype} vs model dtype {model_name}"
                + (" (casting is off: load_conf 'cast': False)" if not self.conf.cast else
                   " (only float-to-float casts are done)"))

    # ------------------------------------------------------------------------------------ apply
    def _apply_objects(self) -> None:
        """The sparse optimizer's scalar state and the registered objects. Their load_state_dict can
        refuse what it is given, and nothing can check that beforehand, so they go first: a refusal
        leaves the model's tables and dense state untouched and the error says what was applied."""
        self._opt_loaded = False
        if self.extras_tree is None:
            return
        conf, done, what = self.conf, [], None
        try:
            if conf.wants("sparse_opt") and self.sparse_optim is not None:
                st = self.extras_tree.get("sparse_optimizer")
                if st is not None:
                    what = "the sparse optimizer"
                    self._load_sparse_optimizer(st)
                    done.append(what)
                    self._opt_loaded = True
            if conf.wants("extra"):
                for name, entry in self.extras_tree.get("objects", {}).items():
                    if name in self.registry.object_names() and name not in self.skipped_objects:
                        what = f"registered object {name!r}"
                        self._apply_extra(name, entry)
                        done.append(what)
                        self.result.extras.append(name)
        except Exception as e:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.reader.describe()}: loading {what} failed: {type(e).__name__}: {e}. "
                f"Applied before it: {', '.join(done) or 'nothing'}; sparse tables, dense state and IO state "
                f"were not touched. Exclude the category ('extra' or 'sparse_opt') to load the rest.") from e

    def _load_sparse_optimizer(self, st) -> None:
        """recckpt's sparse optimizers keep per-table scalars under 'tables': pass only the tables this
        load applies, under their model names, so a warm start of some tables (or renamed ones) works.
        Their hyper-parameters (one set for every table) come from the checkpoint only when the load
        applies the optimizer state of all the optimizer's tables (a resume): a warm start of some tables
        keeps the new run's (lr, an accumulator's initial value for new rows, ...), and says so where the
        checkpoint's differ. Other optimizers get their state as saved."""
        opt = self.sparse_optim
        tables = st.get("tables") if isinstance(st, dict) else None
        if not isinstance(tables, dict):
            opt.load_state_dict(st)
            return
        loaded = self._opt_tables()
        narrowed = dict(st, tables={loaded[n]: v for n, v in tables.items() if n in loaded})
        live = opt.state_dict()
        left_out = sorted(set(live.get("tables", {})) - set(narrowed["tables"]))
        if left_out and isinstance(live.get("hyperparams"), dict):
            if st.get("hyperparams") != live["hyperparams"]:
                warnings.warn(
                    f"checkpoint {self.reader.describe()}: the sparse optimizer keeps its own hyper-parameters "
                    f"{live['hyperparams']}, not the checkpoint's {st.get('hyperparams')}: this load applies the "
                    f"optimizer state of tables {sorted(narrowed['tables'])} only, not of {left_out}, which "
                    f"train on with the live settings", stacklevel=4)
            narrowed["hyperparams"] = live["hyperparams"]
        opt.load_state_dict(narrowed, strict=False)

    def _small(self, name: str, slots, lo: int, hi: int) -> bool:
        """Whether checkpoint table `name` has under SMALL_TABLE_BYTES of rows in buckets [lo, hi)."""
        rbs = [si.row_bytes for _, si, _ in slots]
        return self.m.tables[name].rows * (8 + sum(rbs)) * (hi - lo) // self.m.num_buckets <= SMALL_TABLE_BYTES

    def _runs(self, jobs, lo: int, hi: int) -> dict[str, list[tuple[str, list[str], list[int]]]]:
        """`jobs` ((name, slots) pairs, in load order) in runs of about PREFETCH_BYTES of rows in [lo, hi),
        keyed by their first table: (table, slot names, row bytes) each; runs of one table are left out."""
        groups, run, nbytes = {}, [], 0
        for name, slots in jobs:
            rbs = [si.row_bytes for _, si, _ in slots]
            size = self.m.tables[name].rows * (8 + sum(rbs)) * (hi - lo) // self.m.num_buckets
            if run and nbytes + size > PREFETCH_BYTES:
                groups[run[0][0]] = run
                run, nbytes = [], 0
            run.append((name, [s for s, _, _ in slots], rbs))
            nbytes += size
        if run:
            groups[run[0][0]] = run
        return {k: v for k, v in groups.items() if len(v) > 1}

    def _direct_groups(self, lo: int, hi: int, world: int) -> dict[str, list[tuple[str, list[str], list[int]]]]:
        """Runs of consecutive small tables that a replace-load reads straight into host memory lent by the
        table (`direct_load_possible`, `lends_host_memory`), keyed by their first table: each run is read
        in one pass before any of them changes (`segment_groups.read_rows`), then put into its tables one
        by one (`put_rows`). Whatever needs more than that (chains, fixed-size or routed tables, ownership
        functions, duplicate rules, mapped loads, buckets other than recckpt's hash on several ranks) is
        left to the per-table path."""
        conf = self.conf
        if self.reader.manifest.index is None or conf.ownership is not None or conf.duplicates != "error" \
                or conf.mmap or not conf.wants("sparse") or conf.merge:
            return {}
        jobs = []
        for name, _, table, slots in self.sparse_jobs:
            info = self.m.tables[name]
            if not slots or name in self.chain_plans or implements(table, FixedSize) or implements(table, RoutedRows) \
                    or info.column_blocks is not None or (world > 1 and info.bucket_fn != "hash") \
                    or not any(si.category == "sparse" for _, si, _ in slots) or not self._small(name, slots, lo, hi):
                continue
            if direct_load_possible(table, slots, True) and lends_host_memory(table, [s for s, _, _ in slots]):
                jobs.append((name, slots))
        return self._runs(jobs, lo, hi)

    def _prefetch_groups(self, lo: int, hi: int, exclude=()) -> dict[str, list[tuple[str, list[str], list[int]]]]:
        """Runs of consecutive small tables (under SMALL_TABLE_BYTES of rows in [lo, hi)), about
        PREFETCH_BYTES each, keyed by their first table: `SegmentReader.prefetch` reads each run in two
        engine calls instead of two per table. Chain loads and fixed-size or routed tables read their
        own way and are left out, and so, in a mapped load, are tables with unpacked segments (which it
        maps instead of reading), and the tables in `exclude` (read by `_direct_groups`)."""
        groups, run, nbytes = {}, [], 0
        if self.reader.manifest.index is None:
            return groups
        index = self.reader.index
        for name, _, table, slots in self.sparse_jobs:
            if not slots or name in exclude or name in self.chain_plans or implements(table, FixedSize) \
                    or implements(table, RoutedRows) or self.m.tables[name].column_blocks is not None:
                continue
            if self.conf.mmap and not all(seg.packed for seg in index.tables.get(name, ((), ()))[1]):
                continue
            rbs = [si.row_bytes for _, si, _ in slots]
            size = self.m.tables[name].rows * (8 + sum(rbs)) * (hi - lo) // self.m.num_buckets
            if size > SMALL_TABLE_BYTES:
                continue
            if run and nbytes + size > PREFETCH_BYTES:
                groups[run[0][0]] = run
                run, nbytes = [], 0
            run.append((name, [s for s, _, _ in slots], rbs))
            nbytes += size
        if len(run) > 1:
            groups[run[0][0]] = run
        return {k: v for k, v in groups.items() if len(v) > 1}

    def apply(self, shard_id: int, world: int):
        applied = []
        conf = self.conf
        lo, hi = bucket_range(shard_id, world, self.m.num_buckets)
        if conf.ownership is not None:   # a foreign ownership function: read everything, keep own rows
            lo, hi = 0, self.m.num_buckets
        if self.reader.manifest.index is not None:
            # Every row of (nearly) every column of a shard file on an object store: fetch the file whole,
            # in one request, and read it locally (the caller closes the reader's segments after). Before
            # anything is applied, so that a failure here leaves the model as it was.
            self.reader.segments.fetch_whole_files(
                [(name, [s for s, _, _ in slots]) for name, _, _, slots in self.sparse_jobs
                 if slots and name not in self.chain_plans], lo, hi)
        self._apply_objects()
        groups = self._direct_groups(lo, hi, world)
        prefetch = self._prefetch_groups(lo, hi, {t for run in groups.values() for t, _, _ in run})
        ready = {}   # table -> its rows, read with its group and not yet put into it
        fixed_read: dict[str, int] = {}   # table -> rows written, read with its run (`_read_fixed_together`)
        for k, (name, target, table, slots) in enumerate(self.sparse_jobs):
            if not slots:
                continue
            if name in fixed_read:
                self.result.sparse_rows += fixed_read.pop(name)
                applied.append(target)
                continue
            if name in groups:   # the first of a run of small tables: read them all, then fill them one by one
                ready = read_rows(self.reader.segments, groups[name], lo, hi) or {}
            if name in prefetch:   # the first of a run of small tables: their reads in one engine pass
                self.reader.segments.prefetch(prefetch[name], lo, hi)
            left = "partially loaded"
            try:
                cleared = self._clears(slots)
                if cleared:
                    self._clear(name, table)
                expected = (self.m.tables[name].rows // world if conf.ownership is not None else
                            self.m.tables[name].rows * (hi - lo) // self.m.num_buckets)
                names = [s for s, _, _ in slots]
                rbs = [si.row_bytes for _, si, _ in slots]
                if name in self.chain_plans:
                    plan = self.chain_plans[name]
                    reserve = getattr(table, "reserve", None)
                    if callable(reserve):
                        reserve(len(table) + plan.out_rows)
                    if implements(table, FixedSize):
                        sink = OwnedRows.of_pieces(pieces_of(table), target, self.reader.describe())
                        load_chain_rows(plan, name, target, sink, slots, False)
                        self.result.sparse_rows += sink.rows
                        applied.append(target)
                        continue
                    direct = conf.ownership is None and direct_load_possible(table, slots, cleared)
                    self.result.sparse_rows += load_chain_rows(plan, name, target, table, slots, direct)
                    applied.append(target)
                    continue
                if name not in ready and implements(table, RoutedRows):   # (a ready table is neither)
                    self.result.sparse_rows += kept_rows.load_routed(self.reader, name, table, slots)
                    applied.append(target)
                    continue
                if name not in ready and implements(table, FixedSize):
                    run = [] if name in self._fixed_tried else self._fixed_run(k)
                    if len(run) > 1:
                        left = "not yet written (its reads were being planned)"
                        planned = self._plan_fixed_run(run)
                        others = ", ".join(repr(self.sparse_jobs[j][1]) for j, _, _ in planned
                                           if self.sparse_jobs[j][0] != name)
                        left = (f"partially loaded, as may be {others}, read with it"
                                if any(self.sparse_jobs[j][0] == name for j, _, _ in planned) else
                                f"not yet written; {others}, read ahead of it together, may be partly written")
                        fixed_read.update(self._read_fixed_together(planned, table))
                        left = "partially loaded"
                    rows = fixed_read.pop(name, None)
                    if rows is None:
                        rows = kept_rows.load_fixed(self.reader, name, target, table, slots)
                    self.result.sparse_rows += rows
                    applied.append(target)
                    continue
                t_lo, t_hi, ownership = lo, hi, conf.ownership
                if world > 1 and ownership is None and self.m.tables[name].bucket_fn != "hash":
                    # buckets by row or id range are not recckpt's ownership (hash buckets): read every bucket
                    # and keep the ids recckpt.partition gives this rank
                    t_lo, t_hi, ownership = 0, self.m.num_buckets, hash_ownership(self.m.num_buckets)
                if self.m.tables[name].column_blocks is not None:   # a column-wise save into a hash-keyed table
                    self.result.sparse_rows += self._load_joined(name, table, slots, ownership, shard_id, world)
                    applied.append(target)
                    continue
                simple = ownership is None and conf.duplicates == "error"
                if simple and conf.mmap and mapped_load_possible(table, slots, cleared,
                                                                 self.reader.segments.storage.engine_path("") is not None):
                    left = "left empty (a mapped load adopts a table's rows all at once)"
                    rows, mapped = map_table_rows(self.reader.segments, name, target, table, slots, t_lo, t_hi,
                                                  expected, self.reader.describe())
                    self.result.sparse_rows += rows
                    self.result.bytes_mapped += mapped
                    if mapped:
                        self.result.tables_mapped.append(target)
                    applied.append(target)
                    continue
                reserve = getattr(table, "reserve", None)
                if callable(reserve):  # optional protocol hint: allocate once, not grow per chunk
                    reserve(len(table) + expected + expected // 8)
                if name in ready:   # read with its group (`_direct_groups`)
                    left = "left empty (rows read into host memory are committed all at once)"
                    self.result.sparse_rows += put_rows(table, ready.pop(name), names, target,
                                                        self.reader.describe(), name)
                elif simple and direct_load_possible(table, slots, cleared):
                    if lends_host_memory(table, names):
                        left = "left empty (rows read into host memory are committed all at once)"
                    self.result.sparse_rows += load_table_rows(self.reader.segments, name, target, table,
                                                               slots, t_lo, t_hi, self.reader.describe())
                else:
                    rf = RowFilter(name, self.reader.describe(), rank=shard_id, world=world,
                                   ownership=ownership, rule=conf.duplicates,
                                   files=self.reader.index.files, worker_steps=self.m.worker_steps)
                    for ids, cols, fi in self.reader.segments.iter_table(name, names, rbs, t_lo, t_hi, with_file=True):
                        keep = rf.keep(ids, fi)
                        if keep is not None:
                            ids, cols = ids[keep], [c[keep] for c in cols]
                        n = len(ids)
                        if n == 0:
                            continue
                        table.import_rows(torch.from_numpy(ids), slot_tensors(slots, cols, n, target))
                        self.result.sparse_rows += n
                    self.result.sparse_rows -= rf.replaced
                    rf.check()
            except Exception as e:  # noqa: BLE001 - whatever stops it (a disk error, memory, the table), say what was applied
                objects = ", ".join(self.result.extras + (["the sparse optimizer"] if self._opt_loaded else []))
                msg = (f"{e}. Loading stopped in table {target!r}, which is {left}; tables fully "
                       f"loaded before it: {', '.join(applied) or 'none'}; already applied: "
                       f"{objects or 'no registered objects'}; dense state and IO state were not applied")
                if isinstance(e, DuplicateIdsError) and getattr(e, "proven", False) and self.m.shard_num == 1:
                    # One worker wrote it, so no routing between workers explains a repeat: its own files are
                    # damaged (a writer stores each id once), and restore() takes an older checkpoint
                    raise CorruptCheckpointError(
                        f"checkpoint {self.reader.describe()}: {e.__cause__ or e}. The checkpoint was saved "
                        f"by one worker, whose own files then repeat an id, which no save writes: it is damaged "
                        f"(`recckpt verify` checks it); load an older one. Loading stopped in table {target!r}, "
                        f"which is {left}; tables fully loaded before it: {', '.join(applied) or 'none'}; already "
                        f"applied: {objects or 'no registered objects'}; dense state and IO state were not applied",
                        e.path, table=target, rank=e.rank) from e
                if isinstance(e, (IncompatibleCheckpointError, LoadConfigError)):
                    raise type(e)(msg, path=e.path, table=target, rank=e.rank) from e
                if isinstance(e, (CorruptCheckpointError, OSError)):
                    raise CorruptCheckpointError(msg, getattr(e, "path", None), table=target,
                                                 rank=getattr(e, "rank", None)) from e
                raise LoadApplyError(f"{type(e).__name__}: {msg}", table=target) from e
            applied.append(target)
        self.result.tables = applied
        objects = ", ".join(self.result.extras + (["the sparse optimizer"] if self._opt_loaded else []))
        before = f"sparse tables {', '.join(applied) or 'none'}; {objects or 'no registered objects'}"
        if self.dense_out:
            try:
                plugins.load_dense(self.model, self.dense_out)
            except Exception as e:  # noqa: BLE001 - the model's own load_state_dict: say what was applied
                raise LoadApplyError(
                    f"checkpoint {self.reader.describe()}: the model's load_state_dict refused the dense state "
                    f"({type(e).__name__}: {e}). Already applied: {before}; the dense keys it accepted may "
                    f"be loaded (torch copies every key it can before raising); IO state was not applied. "
                    f"Exclude 'dense' (or choose dense_keys) to load the rest") from e
            self.result.dense_keys = list(self.dense_out)
        if self.io_tree is not None:
            for name, obj in self.registry.io_items():
                if name in self.io_tree:
                    try:
                        obj.load_io_state(self.io_tree[name])
                    except Exception as e:  # noqa: BLE001 - the object's own code: say what was applied
                        raise LoadApplyError(
                            f"checkpoint {self.reader.describe()}: IO state object {name!r} refused its saved "
                            f"state ({type(e).__name__}: {e}). Already applied: {before}; dense state "
                            f"{'loaded' if self.dense_out else 'not selected'}; IO state of "
                            f"{self.result.io_state or 'no other object'}. Exclude 'io_state' to load the "
                            f"rest") from e
                    self.result.io_state.append(name)

    def _clears(self, slots) -> bool:
        """Whether this load replaces a table holding `slots` ((slot, SlotInfo, SlotSpec) triples): its rows
        are cleared before the checkpoint's go in."""
        conf = self.conf
        return conf.wants("sparse") and not conf.merge and any(si.category == "sparse" for _, si, _ in slots)

    def _plan_left_out(self, name: str, target: str, table, meta, slots) -> None:
        """The slots a replacing load of a table that keeps its rows leaves out (`left_out`): they must start
        over (docs/LOADING.md), so such a table needs `reset_slots`; refused before anything is applied
        where it has none."""
        if not self._clears(slots) or not (implements(table, FixedSize) or implements(table, RoutedRows)):
            return
        loaded = {s for s, _, _ in slots}
        left = [s for s in meta.slots if s not in loaded]
        if not left:
            return
        if not callable(getattr(table, "reset_slots", None)):
            self.incompatible.append(
                f"table {name!r}: model table {target!r} keeps its rows through a replacing load, and this load "
                f"leaves its slots {left} out, which it cannot reset (it has no reset_slots); load those slots "
                f"too, or load with 'merge': True to keep their values")
            return
        self.left_out[name] = left

    def _clear(self, name: str, table) -> None:
        """Empty `table` for checkpoint table `name`'s rows. A table that keeps its rows (fixed-size, or
        routed: TorchRec's) then starts the slots this load leaves out over (`prepare` found them), as an
        emptied table's new rows would."""
        table.clear_rows()
        left_out = self.left_out.get(name)
        if left_out:
            table.reset_slots(left_out)

    def _fixed_run(self, k: int) -> list[int]:
        """Indexes into `sparse_jobs`, from k on, of the run of fixed-size tables (TorchRec's) that load the
        plain way (no chain, no routing) and were not yet tried for `_plan_fixed_run`."""
        run = []
        for j in range(k, len(self.sparse_jobs)):
            name, _, table, slots = self.sparse_jobs[j]
            if not slots:
                continue
            if name in self.chain_plans or not implements(table, FixedSize) or implements(table, RoutedRows):
                break
            if name not in self._fixed_tried:
                run.append(j)
        return run

    def _load_joined(self, name: str, table, slots, own, shard_id: int, world: int) -> int:
        """A table saved column-split (a column-wise TorchRec plan) into a hash-keyed table: whole rows, its
        blocks joined, RowWiseAdagrad's per-block values by their width-weighted mean (docs/TORCHREC.md); each
        process keeps the ids ownership `own` gives it (None: all)."""
        where = self.reader.describe()
        keep = None if own is None else (lambda ids: owners_of(own, ids, world, name, where) == shard_id)
        reserve = getattr(table, "reserve", None)
        if callable(reserve):
            reserve(len(table) + self.m.tables[name].rows // world)
        return kept_rows.load_blocks(self.reader, name, table, slots, [(0, self.m.tables[name].num_rows)], None,
                                     keep)

    def _plan_fixed_run(self, run: list[int]) -> list[tuple[int, DirectRows, list]]:
        """Of the tables at `run`, those whose owned rows all go straight into the storage they lend
        (`DirectRows`: no column blocks or column window, row ids in runs): (index, DirectRows, the planned
        reads of every batch). Only stored ids are read; nothing is written. Each table is tried once. A table
        whose planning fails ends the run: the tables after it are tried again later, and it fails again,
        with its own name and what was applied before it, when the loop loads it its own way."""
        out = []
        segments, where = self.reader.segments, self.reader.describe()
        for j in run:
            name, target, table, slots = self.sparse_jobs[j]
            self._fixed_tried.add(name)
            if len(pieces_of(table)) > 1:
                continue   # several column ranges: column blocks, read by kept_rows.load_fixed
            layout = table.row_layout()
            names = [s for s, _, _ in slots]
            if (not layout.owned_rows or self.m.tables[name].column_blocks is not None
                    or kept_rows.column_window(self.m, name, layout, set(column_split_slots(table.sparse_meta())),
                                               names) is not None):
                continue
            direct = DirectRows.of(table, slots, lambda si: dtypes.torch_dtype(si.dtype))
            if direct is None:
                continue
            rbs, plans = [si.row_bytes for _, si, _ in slots], []
            try:
                for b_lo, b_hi in kept_rows.fixed_bucket_ranges(self.m, name, layout):
                    for batch in segments.batches(name, names, rbs, b_lo, b_hi):
                        plans.append(direct.plan_batch(segments, batch, name, target, where))
            except Exception:  # noqa: BLE001 - raised again, naming this table, when it loads its own way
                break
            if all(p is not None for p in plans):
                out.append((j, direct, plans))
        return out

    def _read_fixed_together(self, planned: list[tuple[int, DirectRows, list]], at) -> dict[str, int]:
        """Make the planned reads of several fixed-size tables (`_plan_fixed_run`) in one engine call per kind
        of request, so that a cold load goes through each shard file once (a table-wise plan puts several
        tables in each file); rows written, by checkpoint table. Fewer than two tables: nothing is read
        here (each loads its own way)."""
        if len(planned) < 2:
            return {}
        for j, _, _ in planned:   # the loop has cleared the table it is at (`at`)
            name, _, table, slots = self.sparse_jobs[j]
            if table is not at and self._clears(slots):
                self._clear(name, table)
        self.reader.segments.read_together([(p.table, p.reqs, p.dsts) for _, _, plans in planned for p in plans])
        return {self.sparse_jobs[j][0]: sum(direct.loaded(p) for p in plans) for j, direct, plans in planned}

    def _apply_extra(self, name, entry):
        obj = self.registry.object(name)
        if entry["kind"] == "state_dict" and optim_names.is_optimizer(obj):
            # a load at start-up, before the first step: TorchRec's KeyedOptimizer needs its state first
            optim_names.init_state_for_load(obj, entry["state"])
        self.registry.apply_object(name, entry["kind"], entry["state"])


def _complement(ranges: list[tuple[int, int]], num_buckets: int) -> list[tuple[int, int]]:
    """The bucket ranges of [0, num_buckets) outside the sorted, disjoint `ranges`."""
    out, pos = [], 0
    for lo, hi in ranges:
        if lo > pos:
            out.append((pos, lo))
        pos = hi
    if pos < num_buckets:
        out.append((pos, num_buckets))
    return out
