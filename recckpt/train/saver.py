"""`Saver`: save a model's sparse tables, dense state, registered objects and per-worker IO state as one
checkpoint, and load all or part of it back."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..coordination import check_world, coordinator_for, resolve_shard
from ..errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    CommitOutcomeUnknownError,
    ConcurrentCommitError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RecckptError,
    os_error_hint,
)
from ..format import catalog, extras as extras_fmt, gcpause, recovery
from ..format.chain import walk_chain
from ..format.checkpoint import CheckpointReader, WorkerPart, finalize, write_worker_part
from ..format.names import MANIFEST, owner_file, validate_ckpt_id
from ..format.retention import META_EPHEMERAL
from ..format.schema import ParentRef
from ..format.sparse_io import ReadOptions
from ..format.sparse_write import SparseWriteOptions
from ..load.load_apply import LoadResult
from ..load.load_config import LoadConfig
from ..load.loader import LoadRequest, LoadTarget, load_checkpoint
from ..state import plugins
from ..state.eviction import EvictionPolicy
from ..state.optim_names import saved_param_names
from ..state.protocol import (
    ChangeTracking,
    implements,
    pieces_of,
    split_sparse_dense_state_dict,
)
from ..state.registry import Registry
from ..state.staging import StagingPool
from ..storage import location as storage_location, open_storage
from .events import save_line
from .options import SaveOptions
from .policies import CkptEntry, KeepPolicy
from .snapshot import CaptureFailed, HostBuffers, Snapshot, copy_snapshot
from .table_source import TableSources, step_for

log = logging.getLogger("recckpt")


@dataclass
class SaveStats:
    """What a committed save wrote (on the committing worker; the others report their own part)."""
    ckpt_id: str
    path: str
    sparse_rows: int
    bytes_written: int
    seconds: float
    parent: str | None = None       # the parent of an incremental checkpoint (None: a full one)
    full_reason: str | None = None  # why an incremental save wrote a full checkpoint instead
    committed: bool = True          # False: shards saved from one process, this part waits for the others


@dataclass(frozen=True)
class _ChainState:
    """The newest checkpoint this Saver committed or fully loaded, which an incremental save builds on:
    its id, the SHA-256 of its manifest (None: not known on this worker, checked at the next save) and
    each change-tracking table's mark at the time it was captured."""
    ckpt_id: str
    manifest_sha256: str | None
    marks: dict
    shard: tuple[int, int] | None = None
    """(worker, world) whose share of the rows the tables hold since that save or load: an increment
    written by another worker or world would fold onto rows this process never held."""


@dataclass(frozen=True)
class _LostOutcome:
    """A save this worker handed over whose commit it did not hear of (CommitOutcomeUnknownError). Rank 0
    may commit it after all and build its next increment on it; kept so that this worker then takes it as
    its parent too, and the ranks' parents stay equal."""
    ckpt_id: str
    marks: dict | None
    tables: list | None
    shard: tuple[int, int]


class Saver:
    """Saves and loads checkpoints of `model` (+ `sparse_optim`) under `output_dir`.

    Args:
        model: a module (or anything with `state_dict()`/`load_state_dict()`); its sparse tables are the
            `SparseState` values in its state_dict, everything else is dense.
        sparse_optim: optional sparse optimizer whose small scalar state (`state_dict()`) is saved with the
            optimizer slots under the 'sparse_opt' category.
        output_dir: a local path or an fsspec URL (e.g. 'memory://run1', 's3://bucket/run1').
        max_keep: keep the newest N committed checkpoints (default 1: each save deletes the older ones;
            None: keep all). Counted from what is on disk, applied only after a new checkpoint commits;
            it is `KeepPolicy(max_keep)` (`self.keep`, which a CheckpointManager replaces with its own).
        concurrency: writer threads (and shard files per worker) for sparse tables; reader threads on load.
        options: SaveOptions (bucket count, checksum chunk, segment size, fsync, storage timeout).
        read_options: ReadOptions (read batch size, kernel read-ahead, when an object store's shard files
            are fetched whole) for loads: tuning only.
        storage_options: passed to fsspec for an fsspec URL (endpoint_url, key/secret, profile, ...),
            and used for every other path this Saver opens unless a load names its own.
        eviction: an `EvictionPolicy` applied to every table with counters when a save captures the
            state (a sync save, or the snapshot of an async one, `capture_copy`): the selected rows
            leave the live table (`evict`), and an incremental save records them as removed.
        write_filter: an `EvictionPolicy` that only shapes what is written: rows it selects (in tables
            with `freq`/`last_step` slots) are left out of the checkpoint, the live table keeps them. In
            an increment, a row left out keeps the value earlier links hold for it.
    """

    def __init__(self, model, sparse_optim=None, output_dir: str | os.PathLike | None = None,
                 max_keep: int | None = 1, concurrency: int = 4, *, options: SaveOptions | None = None,
                 storage_options: dict | None = None, eviction: EvictionPolicy | None = None,
                 write_filter: EvictionPolicy | None = None, read_options: ReadOptions | None = None):
        if output_dir is None:
            raise InvalidArgumentError("Saver needs output_dir: a local directory or an fsspec URL")
        if max_keep is not None and (not isinstance(max_keep, int) or isinstance(max_keep, bool) or max_keep < 1):
            raise InvalidArgumentError(f"max_keep must be an integer >= 1 or None (keep all), got {max_keep!r}")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise InvalidArgumentError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.model = model
        self.sparse_optim = sparse_optim
        self.output_dir = storage_location(output_dir)
        self.options = options or SaveOptions()
        if read_options is not None and not isinstance(read_options, ReadOptions):
            raise InvalidArgumentError(f"read_options must be a recckpt.ReadOptions, got {type(read_options).__name__}")
        self.read_options = read_options or ReadOptions()
        self.storage_options = storage_options
        self.storage = self.open_storage(self.output_dir)
        self.keep = KeepPolicy(max_keep=max_keep)
        """Retention after each commit of `save()`; a CheckpointManager passes its own."""
        self.concurrency = concurrency
        self.registry = Registry()
        """Objects registered by name, and IO-state providers."""
        for what, pol in (("eviction", eviction), ("write_filter", write_filter)):
            if pol is not None and not isinstance(pol, EvictionPolicy):
                raise InvalidArgumentError(f"Saver {what} must be a recckpt.state.eviction.EvictionPolicy, got {pol!r}")
        self.eviction, self.write_filter = eviction, write_filter
        self._warned_no_counters: set[str] = set()
        # Host buffers that device tables are copied through on a save, kept across saves (pinned
        # memory is slow to allocate); bounded by SaveOptions.staging_bytes.
        self._staging = StagingPool(self.options.staging_bytes)
        self._recovered = False  # start-up recovery of output_dir done (first save on worker 0)
        self.last_save: SaveStats | None = None
        self._chain: _ChainState | None = None  # what the next incremental save is an increment on
        self._pending_forget: dict | None = None  # marks the live tables may forget up to (async saves)
        self._lost: _LostOutcome | None = None  # a handed-over save whose commit this worker did not hear of
        self._dropped: str | None = None  # why the last chain was dropped (the next save is full), if it was
        self._sources = TableSources(self.options.segment_bytes, self._staging)

    def open_storage(self, url, storage_options: dict | None = None):
        """The store at `url` with `storage_options` (default: this Saver's) and this Saver's timeout
        (model-bank sources, a `ckpt_path` given to load, ...)."""
        return open_storage(url, self.storage_options if storage_options is None else storage_options,
                            timeout_s=self.options.storage_timeout_s)

    @property
    def max_keep(self) -> int | None:
        return self.keep.max_keep

    # ------------------------------------------------------------------------------------ registry
    def register_for_checkpointing(self, name: str, obj: Any, *, allow_pickle: bool = False) -> None:
        """Save `obj` with every checkpoint under `name` (category 'extra'): an object with
        `state_dict()`/`load_state_dict()` (optimizer, LR scheduler, ...), or a plain value (numbers,
        strings, tensors, lists, dicts). After a load, plain values are available from `extra(name)`;
        dicts and lists are also updated in place, and so is a tensor (a Parameter too) of the saved shape
        and dtype; a tensor of another shape or dtype is replaced by the saved one.

        allow_pickle: state that cannot be stored without pickle is then stored with torch.save and
        loaded only with torch.load(weights_only=True) (register your own classes with
        torch.serialization.add_safe_globals). Off by default: a checkpoint from a stranger must not run
        code, and a load refuses pickled state unless the receiving object also allows it."""
        self.registry.add_object(name, obj, allow_pickle=allow_pickle)

    def register_io_state(self, name: str, obj: Any, *, optional: bool = False) -> None:
        """Save `obj.dump_io_state()` per worker under `name`; a load calls `obj.load_io_state(state)`.
        `optional`: a checkpoint without this state (saved before it was registered, or by a job that
        did not register it) loads under strict, leaving `obj` as it is; `LoadResult.io_state_dropped`
        names it."""
        self.registry.add_io_state(name, obj, optional=optional)

    def extra(self, name: str) -> Any:
        """Registered object `name` (after a load, the loaded value of a plain registered value)."""
        return self.registry.object(name)

    # ---------------------------------------------------------------------------------- listing
    def checkpoints(self) -> list[str]:
        """Committed checkpoint ids under output_dir, oldest first."""
        return [i for i, _ in catalog.committed(self.storage)]

    def chain_parent(self) -> str | None:
        """The checkpoint the next `save(incremental=True)` would build on (the newest this Saver
        committed or fully loaded), or None; the save still checks that it is committed."""
        self._adopt_lost_outcome()
        return self._chain.ckpt_id if self._chain is not None else None

    def latest_checkpoint(self) -> str | None:
        """The checkpoint `load()` without an id loads: the one of the highest global step (docs/SAFETY.md)."""
        return catalog.newest(self.storage)[1]

    # ------------------------------------------------------------------------------------- save
    def _write_options(self) -> SparseWriteOptions:
        o = self.options
        return SparseWriteOptions(o.num_buckets, o.chunk_bytes, self.concurrency, o.segment_bytes,
                                  o.max_inflight_bytes, o.fsync)

    def _objects(self) -> list:
        return [self.registry.object(n) for n in self.registry.object_names()]

    def _state(self):
        sparse, dense = split_sparse_dense_state_dict(plugins.model_state_dict(self.model, self._objects()))
        for k, v in dense.items():
            if not isinstance(v, torch.Tensor):
                if k.endswith("._extra_state") or k == "_extra_state":
                    raise CheckpointSaveError(
                        f"model state_dict entry {k!r} is a {type(v).__name__} that a module's get_extra_state() "
                        f"returns; recckpt stores a model's state_dict entries as tensors (no pickle). Have "
                        f"get_extra_state() return a tensor (or a SparseState), or keep that state in an object "
                        f"registered with register_for_checkpointing and leave get_extra_state undefined")
                raise CheckpointSaveError(
                    f"model state_dict entry {k!r} is a {type(v).__name__}, not a tensor or a SparseState; "
                    f"recckpt stores a model's state_dict entries as tensors (no pickle): keep that state in an "
                    f"object registered with register_for_checkpointing, outside the model's state_dict")
            if v.layout != torch.strided:
                raise CheckpointSaveError(
                    f"model state_dict entry {k!r} is a {v.layout} tensor; recckpt stores dense (strided) "
                    f"tensors: keep it dense in the state_dict (e.g. return t.to_dense() from a state_dict hook), "
                    f"or hold ids and rows in a recckpt.HashTable")
        return sparse, dense

    def save(self, ckpt_id: str, shard_id: int | None = None, shard_num: int | None = None, *,
             step: int | None = None, incremental: bool = False) -> str:
        """Write checkpoint `ckpt_id` and commit it; returns its location.

        With shard_num > 1 each worker writes its own shard files and IO state; worker 0 also writes the
        dense state and extras, and the checkpoint commits once all shards are written. Nothing is
        visible before the commit, and older checkpoints are untouched if anything fails.
        shard_id/shard_num default to this process's rank and world size in torch.distributed (every
        rank calls save; see docs/DISTRIBUTED.md), else RANK/WORLD_SIZE, else 0 of 1; explicit values
        that disagree with an initialised process group are an error. Without a process group, explicit
        values > 1 mean every shard is saved from this process: the checkpoint commits at the save of
        the last shard, and the earlier calls return the location it will have (with a warning;
        `last_save` is not set, `write()` reports `committed=False`); parts whose other shards are not
        saved within `SaveOptions.coordination_timeout_s` of the last one are dropped with a warning
        (nothing is committed). `step` (the
        training step) is recorded per worker and decides duplicate ids under duplicates='newest'.

        incremental=True writes only the sparse rows changed since the newest checkpoint this Saver
        committed or fully loaded (its *parent*), plus the ids removed since, and names the parent by id
        and manifest hash; dense state, registered objects and IO state are written in full. Tables that
        cannot tell their changes (no `ChangeTracking`) are written whole. With no such parent still
        committed it writes a full checkpoint and says why (a log line and `last_save.full_reason`).
        Under torch.distributed the workers compare their parents before writing, and all write a full
        checkpoint where they differ (docs/INCREMENTAL.md)."""
        if not isinstance(incremental, bool):
            raise InvalidArgumentError(f"save: incremental must be a bool, got {incremental!r}")
        return self.write(ckpt_id, shard_id=shard_id, shard_num=shard_num, step=step,
                          incremental=incremental).path

    def capture(self, shard_id: int = 0) -> Snapshot:
        """What a save of this worker writes, read from the live objects (no copies: the sync path).
        `recckpt.train.snapshot.copy_snapshot` freezes it into reused host buffers for async saves."""
        sparse, dense = self._state()
        first = shard_id == 0
        return Snapshot(tables=list(sparse.values()), dense=dense if first else None,
                        extras=_extras_tree(self.registry, self.sparse_optim, self.model) if first else None,
                        io_state=self.registry.io_tree())

    def capture_copy(self, bufs: HostBuffers, shard_id: int = 0, incremental: bool = False, *,
                     step: int | None = None) -> Snapshot:
        """A frozen copy of what a save of this worker writes, in `bufs` (reused across saves), for a
        write in the background (`write(ckpt_id, snapshot)`). With `incremental`, change-tracking tables
        are copied as their changes since the parent (what `chain_parent()` names) and their marks are
        taken now, so the increment holds exactly the changes up to this capture; without a parent the
        copy is whole and `full_reason` says why. The Saver's `eviction` applies here, at `step`, as a
        sync save applies it when it captures: the rows leave the live tables before the copy, and
        the next increment records them as removed. Call it from the training thread, with no save
        of this Saver in flight."""
        with gcpause.paused():   # on the training step: see write()
            return self._capture_copy(bufs, shard_id, incremental, step)

    def _capture_copy(self, bufs: HostBuffers, shard_id: int, incremental: bool, step: int | None) -> Snapshot:
        self._forget_written()
        chain, reason = (self._chain, None)
        if incremental:
            # What this process knows only: the store is not read on the training step. The write checks
            # the parent in the store before it writes (and fails, forgetting the chain, if it is gone).
            self._adopt_lost_outcome()
            chain, reason = self._usable_chain(self._chain, (shard_id, None))
            if reason is not None:
                log.warning("recckpt: incremental save requested, writing a full checkpoint: %s", reason)
        if self.eviction is not None:
            self._evict(step)
        live = self.capture(shard_id)
        live.marks = {t.sparse_meta().name: t.mark_changes() for t in live.tables if implements(t, ChangeTracking)}
        live.chain, live.full_reason = (chain, None) if incremental and chain is not None else (None, reason)
        return copy_snapshot(live, bufs, chain.marks if incremental and chain is not None else None, shard_id)

    def _forget_written(self) -> None:
        """Let the live tables drop the change records a committed checkpoint holds, for saves written
        from a snapshot (deferred to the training thread: the tables are not thread-safe)."""
        pending, self._pending_forget = self._pending_forget, None
        if pending is None:
            return
        for name, table in self._state()[0].items():
            mark = pending.get(name)
            if mark is not None and implements(table, ChangeTracking):
                table.forget_changes(mark)

    def write(self, ckpt_id: str, snapshot: Snapshot | None = None, *, shard_id: int | None = None,
              shard_num: int | None = None, metadata: dict[str, str] | None = None, step: int | None = None,
              keep: KeepPolicy | None = None, protect: str | None = None, incremental: bool = False) -> SaveStats:
        """Write `snapshot` (None: capture the live state now) as checkpoint `ckpt_id`, commit it, then
        apply retention; `save()` with everything spelled out. `metadata` goes into the manifest;
        `keep` (default `self.keep`) chooses what retention deletes after the commit, never `protect`
        (e.g. the checkpoint a run restored from) while it is the newest, nor a checkpoint a kept one's
        chain needs. `incremental`: as in `save()`; with a prepared `snapshot` it must come from
        `capture_copy(..., incremental=True)`, which decided the parent when it copied the changes.
        Returns what was written: on the committing worker the whole checkpoint, on the others their
        own part."""
        if snapshot is None:
            # A sync save holds the training step anyway: the cyclic collector is paused for all of it,
            # or the per-table work of a thousand tables triggers full collections, each walking every
            # object of the process. A write from a snapshot (maybe in the background, beside training)
            # pauses it only while it builds metadata.
            with gcpause.paused():
                return self._write(ckpt_id, None, shard_id, shard_num, metadata, step, keep, protect, incremental)
        return self._write(ckpt_id, snapshot, shard_id, shard_num, metadata, step, keep, protect, incremental)

    def _write(self, ckpt_id, snapshot, shard_id, shard_num, metadata, step, keep, protect, incremental) -> SaveStats:
        snap = snapshot
        keep = self.keep if keep is None else keep
        # An ephemeral checkpoint is deleted once a newer one commits: an increment built on it would keep
        # it (and a full copy with it) alive, and cut the regular chain short. The next increment builds on
        # the checkpoint before it, with the changes since then kept in the tables.
        becomes_parent = (metadata or {}).get(META_EPHEMERAL) != "1"
        validate_ckpt_id(ckpt_id)
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise InvalidArgumentError(f"save: step must be an integer (the training step) or None, got {step!r}")
        shard_id, shard_num = resolve_shard(shard_id, shard_num, saving=True)
        check_world(shard_id, shard_num, "Saver.save")
        t0 = time.perf_counter()
        coord = coordinator_for(shard_id, shard_num, self.options.coordination_timeout_s)
        key = (self.storage.describe(), ckpt_id)
        stats = None
        exists = self._exists_error(ckpt_id)
        # Where the workers exchange plans, a worker that finds the id taken says so there, and every worker
        # raises together (one that raised alone would leave the others waiting in `begin`, and meet them
        # at its next save with another id); elsewhere it raises now.
        shared_check = coord.world > 1 and not coord.defers_commit
        if exists is not None and not shared_check:
            raise exists
        if incremental and snap is not None and snap.marks is None:
            raise InvalidArgumentError("an incremental save from a prepared snapshot needs one taken with "
                             "Saver.capture_copy(..., incremental=True)")
        # The parent is chosen before `begin`, which shows every worker the others' choice before anything
        # is written (a worker that missed a commit's outcome builds on an older parent than rank 0).
        if snap is None:
            parent, full_reason = self._parent_for(incremental, shard=(shard_id, shard_num))
            chain = self._chain
        else:
            chain = snap.chain
            parent, full_reason, known = ((None, snap.full_reason, True) if chain is None else
                                          self._parent_verdict(chain, (shard_id, shard_num)))
        nonce, plans = coord.begin(key, {"parent": None if parent is None else parent.to_json(),
                                         "layout": self._layout(), "exists": exists is not None})
        # The store decides where a save writes: a staging directory, or the checkpoint's own keys.
        stage = self.storage.save_target(ckpt_id, catalog.new_staging_dir(ckpt_id, nonce))
        manifest = None
        claim = None
        handed_over = False  # this worker's part went to another worker, which commits from `stage`
        try:
            if isinstance(snap, CaptureFailed):
                raise snap.error   # after `begin`: the other workers hear of it and fail this save too
            if shared_check and plans is not None:
                self._raise_if_taken(ckpt_id, exists, [p["exists"] for p in plans])
            self.storage.prepare_for_save()
            # Claimed before anything is written: recovery in another process leaves a claimed target alone.
            claim = self.storage.claim(stage, owner_file(stage, shard_id))
            # Checked again under the claim: a rival that committed this id meanwhile released its claim
            # only after its commit, so it is seen here (stores that write in place would otherwise
            # write over its files).
            if shard_id == 0 and catalog.is_committed(self.storage, ckpt_id):
                raise ConcurrentCommitError(
                    f"checkpoint {self.storage.describe(ckpt_id)} was committed by another writer while this "
                    f"save was starting; committed checkpoints are never overwritten: choose another ckpt_id")
            if shard_id == 0 and not self._recovered:
                self._recover(coord, stage)
            live = snap is None
            if live:
                self._forget_written()
                if self.eviction is not None:
                    self._evict(step)
                snap = self.capture(shard_id)
                metas = [t.sparse_meta() for t in snap.tables]
                marks = {m.name: t.mark_changes() for t, m in zip(snap.tables, metas)
                         if implements(t, ChangeTracking)}
            else:
                metas = [t.sparse_meta() for t in snap.tables]
                marks = snap.marks
                if chain is not None and parent is None:
                    # The capture does not read the store. A chain found unusable (its parent gone or
                    # replaced, or not this save's worker or world) is forgotten, so that the next save is
                    # full and says why; a parent that could not be read is kept, and checked again then.
                    if known and self._chain is chain:
                        self._chain, self._dropped = None, full_reason
                    then = ("the next save writes a full checkpoint" if self._chain is not chain else
                            "the next incremental save checks its parent again")
                    raise CheckpointSaveError(
                        f"incremental checkpoint {ckpt_id!r} was not written: {full_reason}; its snapshot holds "
                        f"only the changes since {chain.ckpt_id!r}, so nothing was written: {then}")
            if plans is not None:
                self._check_layouts(ckpt_id, [p["layout"] for p in plans])
                parent, full_reason = self._agreed_parent(ckpt_id, parent, full_reason,
                                                          [p["parent"] for p in plans], not live)
            since = chain.marks if parent is not None else {}
            # a process holding several column ranges of a table writes each as its own column block
            sources = [self._sources.source(p, since.get(m.name), step, shard_id, m if p is t else None,
                                            self.write_filter)
                       for t, m in zip(snap.tables, metas) for p in pieces_of(t)]
            part = write_worker_part(
                self.storage, stage, shard_id, tables=[t for t, _ in sources],
                dense=snap.dense if shard_id == 0 else None,
                extras=snap.extras if shard_id == 0 else None,
                io_state=snap.io_state, opts=self._write_options(), step=step, parent=parent,
                removed=[r for _, r in sources if r is not None])
            # A world of one hands its part to nobody: it is not serialised only to be dropped (a thousand
            # tables' index and digests).
            parts = coord.submit(key, part.to_json() if coord.world > 1 else {"worker": part.worker})
            handed_over = parts is None
            if parts is not None:
                # this worker's own part as built here (its index not parsed back), the others' as received
                mine = [part if p["worker"] == part.worker else WorkerPart.from_json(p) for p in parts]
                manifest = finalize(self.storage, stage, ckpt_id, mine,
                                    opts=self._write_options(),
                                    metadata={**plugins.manifest_metadata(self.model), **(metadata or {})},
                                    visible_within_s=self.options.visibility_timeout_s)
                self._after_commit(ckpt_id, keep, protect, manifest)
                self.last_save = SaveStats(ckpt_id, self.storage.describe(ckpt_id),
                                           sum(t.rows for t in manifest.tables.values()),
                                           sum(f.size for f in manifest.files.values()) + sum(
                                               f["size"] for p in mine for f in p.index["files"]),
                                           time.perf_counter() - t0,
                                           parent.ckpt_id if parent is not None else None, full_reason)
                stats = self.last_save
            else:
                stats = SaveStats(ckpt_id, self.storage.describe(ckpt_id),
                                  sum(int(t.get("rows", 0)) for t in part.tables.values()),
                                  sum(size for size, _ in part.files.values()) + sum(
                                      f["size"] for f in part.index["files"]), time.perf_counter() - t0,
                                  parent.ckpt_id if parent is not None else None, full_reason)
            coord.end(key, None)   # other ranks learn the outcome (and raise if it was not committed)
            if handed_over and coord.defers_commit:
                # Only when all shards are saved from this one process (no process group): the part
                # waits for the remaining shards' save() calls, and nothing is committed yet.
                stats = dataclasses.replace(stats, committed=False)
                log.warning("recckpt: shard %d of %d of %s is written but not committed: with no "
                            "torch.distributed process group, the checkpoint commits when this process has "
                            "saved every shard", shard_id, shard_num, self.storage.describe(ckpt_id))
            if becomes_parent:
                self._committed_chain(ckpt_id, manifest, marks,
                                      [(t, m.name) for t, m in zip(snap.tables, metas)] if live else None,
                                      (shard_id, shard_num))
            if stats.committed:
                kind = "incremental" if parent is not None else "full" if becomes_parent else "ephemeral"
                log.info("%s", save_line(ckpt_id, step, stats.bytes_written, stats.seconds, stats.sparse_rows,
                                         kind=kind, rank=shard_id, whole=manifest is not None,
                                         stall_seconds=None if live else snap.stall_seconds))
        except BaseException as e:
            coord.abort(key, f"{type(e).__name__}: {e}")
            if parent is not None and snapshot is not None:
                # the next capture does not read the store: a parent gone meanwhile is found here, off the
                # training thread, so that the next save is full instead of failing again
                self._drop_chain_if_unusable()
            if handed_over:
                try:
                    stats = self._failed_after_handover(ckpt_id, e, t0)   # returns only when committed after all
                except CommitOutcomeUnknownError:
                    # rank 0 may commit it yet: then the other ranks build on it, and so must this one
                    if becomes_parent:
                        self._lost = _LostOutcome(ckpt_id, marks, [(t, m.name) for t, m in zip(snap.tables, metas)]
                                                  if live else None, (shard_id, shard_num))
                    raise
                # then it is the next increment's parent on this rank too, as on a rank that heard the outcome
                if not becomes_parent:
                    return stats
                try:
                    done = catalog.read_manifest(self.storage, ckpt_id)
                except (OSError, RecckptError):
                    done, marks = None, None   # the next incremental save writes a full checkpoint
                self._committed_chain(ckpt_id, done, marks,
                                      [(t, m.name) for t, m in zip(snap.tables, metas)] if live else None,
                                      (shard_id, shard_num))
                return stats
            committed = manifest is not None or self.is_committed(ckpt_id)
            # A private staging target (stage != ckpt_id) is this save's alone, even when a rival
            # committed the id; a target under the final keys may hold a rival's files.
            if stage != ckpt_id or (not committed and not isinstance(e, CheckpointExistsError)):
                try:
                    self.storage.discard(stage, ckpt_id, MANIFEST)   # never a committed checkpoint
                except OSError:
                    pass  # start-up recovery of the next Saver removes it
            if isinstance(e, (RecckptError, KeyboardInterrupt)) and not isinstance(e, CorruptCheckpointError):
                raise
            hint = os_error_hint(e)
            if manifest is None and _lost_commit_race(e) and committed:
                raise ConcurrentCommitError(
                    f"checkpoint {self.storage.describe(ckpt_id)} was committed by another writer while this "
                    f"save was writing it ({type(e).__name__}: {e}). This save's data was discarded; the "
                    f"checkpoint on disk is the other writer's, complete and loadable. Two jobs (or ranks that "
                    f"each think they are alone) are saving into one output_dir under the same ids: give each "
                    f"job its own output_dir, or run every rank in one process group.") from e
            if committed:
                # The commit (rename) happened and a step right after it (fsync of output_dir) failed.
                raise CheckpointSaveError(
                    f"checkpoint {self.storage.describe(ckpt_id)} was committed, but making the commit durable "
                    f"failed: {type(e).__name__}: {e}. It is listed and loadable, but may be lost if the machine "
                    f"loses power now.{hint}") from e
            raise CheckpointSaveError(
                f"saving checkpoint {ckpt_id!r} to {self.storage.describe()} failed: {type(e).__name__}: {e}. "
                f"Nothing was committed and earlier checkpoints are intact.{hint}") from e
        finally:
            if claim is not None:
                claim.release()
        return stats

    def _evict(self, step: int | None) -> None:
        """Apply the eviction policy to every table that can evict (a HashTable with counters). Tables
        without counters are left whole, with one warning each: refusing there, after other tables had
        already lost their rows, failed every later save too."""
        for name, table in self._state()[0].items():
            evict = getattr(table, "evict", None)
            if not callable(evict):
                log.info("recckpt: table %r has no evict(); eviction skipped", name)
                continue
            if not getattr(table, "has_counters", True):
                if name not in self._warned_no_counters:
                    self._warned_no_counters.add(name)
                    log.warning("recckpt: table %r keeps no freq/last_step counters, so the Saver's eviction "
                                "policy leaves it whole (create it with HashTable(..., counters=True) or call "
                                "enable_counters() to evict its rows)", name)
                continue
            n = evict(self.eviction, step_for(step, table))
            if n:
                log.info("recckpt: evicted %d rows of table %r (%s)", n, name, self.eviction)

    def _parent_for(self, incremental: bool, chain: _ChainState | None = None, shard: tuple | None = None
                    ) -> tuple[ParentRef | None, str | None]:
        """(parent of the increment to write, None) or (None, why a full checkpoint is written instead).
        `chain`: the parent state to check (default: this Saver's current one). `shard`: (worker, world)
        of the save, as far as known ((worker, None) when capturing a snapshot)."""
        if not incremental:
            return None, None
        if chain is None:
            self._adopt_lost_outcome()
        ref, reason, _ = self._parent_verdict(self._chain if chain is None else chain, shard)
        if ref is not None:
            return ref, None
        log.warning("recckpt: incremental save requested, writing a full checkpoint: %s", reason)
        return None, reason

    def _parent_verdict(self, chain: _ChainState | None, shard: tuple | None
                        ) -> tuple[ParentRef | None, str | None, bool]:
        """(the parent an increment on `chain` names, None, True), or (None, why not, whether that is known:
        False where the store did not answer, so the parent may well be there). This process's own state
        first (`_usable_chain`), then the parent in the store: committed, the same manifest, the same bucket
        count, its chain whole."""
        chain, reason = self._usable_chain(chain, shard)
        if chain is None:
            return None, reason, True
        try:
            have = catalog.read_manifest(self.storage, chain.ckpt_id)
        except FileNotFoundError:
            return None, f"its parent {chain.ckpt_id!r} is no longer committed", True
        except (OSError, RecckptError) as e:
            return (None, f"its parent {chain.ckpt_id!r} could not be read ({type(e).__name__}: {e})",
                    isinstance(e, CorruptCheckpointError))
        if have.num_buckets != self.options.num_buckets:
            reason = (f"SaveOptions.num_buckets ({self.options.num_buckets}) differs from its parent's "
                      f"({have.num_buckets}), and the links of a chain share one bucket count")
        elif chain.manifest_sha256 is not None and have.content_sha256 != chain.manifest_sha256:
            reason = f"checkpoint {chain.ckpt_id!r} was replaced since this Saver wrote or loaded it"
        else:
            reason = self._broken_chain(chain.ckpt_id, have)
            if reason is None:
                return ParentRef(chain.ckpt_id, have.content_sha256), None, True
        return None, reason, True

    def _usable_chain(self, chain: _ChainState | None, shard: tuple | None) -> tuple[_ChainState | None, str | None]:
        """(`chain`, None) where this process's own state allows an increment on it, else (None, why not):
        none committed or loaded (or the last one dropped), or the tables hold another worker's share. The
        store is not read."""
        if chain is None:
            return None, self._dropped or "this Saver has not committed or fully loaded a checkpoint to build an increment on"
        if chain.shard is not None and shard is not None and any(
                b is not None and a != b for a, b in zip(chain.shard, shard)):
            return None, (f"the tables hold worker {chain.shard[0]} of {chain.shard[1]}'s share of "
                          f"{chain.ckpt_id!r} (loaded or saved so), and this save is worker {shard[0]}"
                          f"{'' if shard[1] is None else f' of {shard[1]}'}: an increment would fold onto rows "
                          f"this process does not hold")
        return chain, None

    def _layout(self) -> dict:
        """The SaveOptions every worker's part must share: they lay out the rows of the whole checkpoint."""
        return {"num_buckets": self.options.num_buckets, "chunk_bytes": self.options.chunk_bytes}

    def _exists_error(self, ckpt_id: str) -> CheckpointExistsError | None:
        """The error a save of `ckpt_id` raises because that id is committed already (None: it is not)."""
        if not catalog.is_committed(self.storage, ckpt_id):
            return None
        broken = dict(catalog.damaged(self.storage, [ckpt_id], set()))
        if broken:
            return CheckpointExistsError(
                f"{self.storage.describe(ckpt_id)} holds a checkpoint whose manifest does not verify "
                f"({broken[ckpt_id]}): it is never loaded, but nothing is written over it. Delete it "
                f"(recckpt.delete({self.storage.describe()!r}, [{ckpt_id!r}])) to save under this id again",
                path=self.storage.describe(ckpt_id))
        return CheckpointExistsError(
            f"checkpoint {self.storage.describe(ckpt_id)} already exists; committed checkpoints are never "
            f"overwritten: choose another ckpt_id or delete it first", path=self.storage.describe(ckpt_id))

    def _raise_if_taken(self, ckpt_id: str, mine: CheckpointExistsError | None, found: list[bool]) -> None:
        """Raises on every worker alike where any worker found `ckpt_id` committed before `begin`."""
        if mine is not None:
            raise mine
        if any(found):
            ranks = ", ".join(str(r) for r, f in enumerate(found) if f)
            raise CheckpointExistsError(
                f"checkpoint {self.storage.describe(ckpt_id)} was not written: rank(s) {ranks} found it already "
                f"committed (another job saving into this output_dir?); committed checkpoints are never "
                f"overwritten: choose another ckpt_id or delete it first. Nothing was written by this save.",
                path=self.storage.describe(ckpt_id))

    def _check_layouts(self, ckpt_id: str, layouts: list[dict]) -> None:
        """Raises, on every worker alike, where the workers' `_layout()`s differ."""
        for name in layouts[0]:
            values = [lay[name] for lay in layouts]
            if any(v != values[0] for v in values):
                which = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise InvalidArgumentError(
                    f"checkpoint {ckpt_id!r} was not written: the ranks' SaveOptions.{name} differ ({which}); "
                    f"every rank must save with the same SaveOptions.{name}. Nothing was committed and earlier "
                    f"checkpoints are intact.")

    def _agreed_parent(self, ckpt_id: str, parent: ParentRef | None, full_reason: str | None,
                       proposed: list, from_snapshot: bool) -> tuple[ParentRef | None, str | None]:
        """(parent, why full) as every worker writes it: its own choice when all workers proposed the same
        parent (`proposed`, from `begin`); otherwise a full save. Every worker sees the same list, so
        all decide alike. A snapshot taken as changes cannot be written whole: then every worker raises
        and its next save writes a full checkpoint."""
        if all(p == proposed[0] for p in proposed):
            return parent, full_reason
        which = ", ".join(f"rank {r}: {p['ckpt_id']!r}" if p else f"rank {r}: none"
                          for r, p in enumerate(proposed))
        reason = (f"the workers would build on different parents ({which}), as after a save whose commit a "
                  f"worker did not hear of")
        if from_snapshot:
            self._chain, self._dropped = None, reason
            raise CheckpointSaveError(
                f"incremental checkpoint {ckpt_id!r} was not written: {reason}; some workers' snapshots hold "
                f"only their changes, so it cannot be written in full. Nothing was committed; the next save "
                f"writes a full checkpoint on every worker.")
        if parent is None:
            return None, full_reason
        log.warning("recckpt: incremental save requested, writing a full checkpoint: %s", reason)
        return None, reason

    def _broken_chain(self, parent_id: str, parent_manifest) -> str | None:
        """Why the chain under `parent_id` cannot carry an increment (a link deleted or replaced by hand,
        a loop), or None. Reads one manifest per link (walk_chain): an increment on a broken chain would
        commit and then fail every load."""
        if parent_manifest.parent is None:
            return None   # a full checkpoint: a chain of one
        try:
            walk_chain(CheckpointReader(self.storage, parent_id))
        except (OSError, RecckptError) as e:
            return f"the chain under its parent {parent_id!r} is broken: {str(e).split('; ')[0]}"
        return None

    def _committed_chain(self, ckpt_id: str, manifest, marks: dict | None,
                         tables: list[tuple[object, str]] | None, shard: tuple[int, int] | None = None) -> None:
        """Remember the checkpoint just committed as the parent of the next increment. `marks` None: it
        was saved from a prepared snapshot without marks, so the next incremental save writes a full
        one. `tables`: (live table, its name as this save's `sparse_meta()` gave it: asking each table again
        costs a thousand tables a few ms a save), each told to forget what the checkpoint holds; None
        (written from a snapshot, maybe in the background) defers that to the next capture on the training
        thread."""
        self._lost, self._dropped = None, None
        if marks is None:
            self._chain = None
            return
        self._chain = _ChainState(ckpt_id, manifest.content_sha256 if manifest is not None else None, marks, shard)
        if tables is None:
            self._pending_forget = marks
            return
        for t, name in tables:
            mark = marks.get(name)
            if mark is not None:
                t.forget_changes(mark)

    def _drop_chain_if_unusable(self) -> None:
        """After a failed write from a snapshot of changes: if the store says the chain's parent can no
        longer carry an increment, drop the chain, so that the next capture (which reads no store) is
        whole. A store that does not answer leaves it: the next write checks again."""
        chain = self._chain
        if chain is None:
            return
        ref, why, known = self._parent_verdict(chain, None)
        if ref is None and known and self._chain is chain:
            self._chain, self._dropped = None, why

    def _adopt_lost_outcome(self) -> None:
        """A save whose outcome this worker did not learn, seen committed now (rank 0 committed it after
        this worker gave up waiting) becomes the next increment's parent, as on the ranks that heard of it:
        otherwise the ranks' parents differ, and the next increment is written full (or, from snapshots of
        changes, not at all). Still not committed: asked again at the next save."""
        lost = self._lost
        if lost is None:
            return
        try:
            done = catalog.read_manifest(self.storage, lost.ckpt_id)
        except FileNotFoundError:
            return   # not committed (yet): asked again at the next save
        except (OSError, RecckptError) as e:
            # the store does not answer (or the checkpoint is damaged): given up, so that a frozen store
            # stalls at most this one step; the ranks' parents may then differ, which the next save sees
            self._lost = None
            log.warning("recckpt: could not tell whether %s, whose commit this worker did not hear of, is "
                        "committed (%s); the next save does not build on it", self.storage.describe(lost.ckpt_id), e)
            return
        log.warning("recckpt: checkpoint %s, whose commit this worker did not hear of, is committed: the next "
                    "increment builds on it", self.storage.describe(lost.ckpt_id))
        self._committed_chain(lost.ckpt_id, done, lost.marks, lost.tables, lost.shard)

    def _failed_after_handover(self, ckpt_id: str, e: BaseException, t0: float) -> SaveStats:
        """Error handling of a worker whose part the committing worker already holds. The staging
        directory is left alone: the committer may still be committing from it, and a removal racing
        its rename could commit a checkpoint with files missing (the committer or start-up recovery
        removes it). Only a lost outcome announcement is looked into: the checkpoint may exist."""
        if not isinstance(e, CommitOutcomeUnknownError):
            if isinstance(e, (RecckptError, KeyboardInterrupt)):
                raise e
            raise CheckpointSaveError(f"saving checkpoint {ckpt_id!r} to {self.storage.describe()} failed after "
                                      f"this worker handed its part over: {type(e).__name__}: {e}") from e
        if self.is_committed(ckpt_id):
            warnings.warn(f"{e}; but checkpoint {self.storage.describe(ckpt_id)} is committed, so this save "
                          f"succeeded", stacklevel=5)
            return SaveStats(ckpt_id, self.storage.describe(ckpt_id), 0, 0, time.perf_counter() - t0)
        raise CommitOutcomeUnknownError(
            f"{e}. Checkpoint {self.storage.describe(ckpt_id)} is not committed as seen from this worker, but "
            f"rank 0 may still commit it (or may have failed); the checkpoint will be complete or absent, "
            f"never partial: list the checkpoints later to find out. Earlier checkpoints are intact.") from e

    def is_committed(self, ckpt_id: str) -> bool:
        """Whether checkpoint `ckpt_id` is committed in output_dir (its manifest exists and verifies)."""
        try:
            catalog.read_manifest(self.storage, ckpt_id)
            return True
        except (OSError, RecckptError):
            return False

    def _recover(self, coord, stage: str) -> None:
        """Once per Saver, before its first save on worker 0: remove what crashed saves and deletes left in
        output_dir and fix the version file. Staging directories of saves this process has in flight
        (other workers of this save included) are kept."""
        keep = {stage} | {self.storage.save_target(i, catalog.new_staging_dir(i, n))
                          for i, n in coord.active_nonces(self.storage.describe()).items()}
        recovery.recover(self.storage, keep, self.options.fsync)
        self._recovered = True

    def _after_commit(self, ckpt_id: str, keep: KeepPolicy, protect: str | None, manifest=None) -> None:
        """Version file and retention, from one listing. The checkpoint is committed already; these are
        housekeeping that the next save (or start-up recovery) redoes, so a failure here is a warning,
        not a failed save. The version file stops listing what retention deletes before the deletes,
        so a crash in between never leaves it naming a deleted checkpoint."""
        try:
            with gcpause.paused():   # the catalog of many checkpoints: metadata only
                found = catalog.committed(self.storage, known={ckpt_id: manifest} if manifest is not None else None)
                entries = [CkptEntry.from_metadata(cid, m.metadata, m.worker_steps) for cid, m in found]
            doomed = [d for d in keep.doomed(entries, protect) if d != ckpt_id]
            # never a link that a kept checkpoint's chain of increments needs (docs/INCREMENTAL.md)
            doomed = catalog.without_needed_links(found, doomed)
            with catalog.links_lock(self.storage, bool(doomed)):
                doomed = catalog.unneeded_now(self.storage, found, doomed)
                gone = set(doomed)
                if doomed:
                    log.info("recckpt: retention (%s) deletes %s", keep, doomed)
                deleted = catalog.retire(self.storage, [e.ckpt_id for e in entries if e.ckpt_id not in gone],
                                         doomed, self.options.fsync, dict(found))
            if not doomed:
                catalog.write_version_file(self.storage, [e.ckpt_id for e in entries], self.options.fsync,
                                           dict(found))
            if len(deleted) < len(doomed):   # a leftover checkpoint costs disk, not correctness
                raise OSError(f"could not delete {sorted(gone - set(deleted))} (see the log; a link of one that "
                              f"stayed is kept with it)")
        except OSError as e:
            msg = (f"checkpoint {self.storage.describe(ckpt_id)} is committed, but updating the version file or "
                   f"deleting old checkpoints failed: {type(e).__name__}: {e}. The next save retries.{os_error_hint(e)}")
            log.warning("recckpt: %s", msg)
            warnings.warn(msg, stacklevel=4)

    # ------------------------------------------------------------------------------------- load
    def load_by_config(self, config: Mapping[str, Any]) -> LoadResult:
        """`load` from one dict: path keys (`ckpt_path` or `path`, `ckpt_id`, `direct_path`, `shard_id`,
        `shard_num`) plus any LoadConfig keys."""
        conf = dict(config)
        kwargs = {}
        if "path" in conf:
            conf["ckpt_path"] = conf.pop("path")
        for k in ("ckpt_path", "ckpt_id", "direct_path", "shard_id", "shard_num"):
            if k in conf:
                kwargs[k] = conf.pop(k)
        return self.load(load_conf=LoadConfig.coerce(conf), **kwargs)

    def load(self, ckpt_path: str | None = None, ckpt_id: str | None = None, load_conf=None,
             shard_id: int | None = None, direct_path: bool = False, *, shard_num: int | None = None,
             storage_options: dict | None = None) -> LoadResult:
        """Load a checkpoint into the registered model, optimizer, objects and IO state.

        Resolves `ckpt_path` (default output_dir) + `ckpt_id` (default: newest committed), or with
        `direct_path=True` takes `ckpt_path` as one checkpoint directory (model-bank warm start).
        Everything is read and verified before the model is touched except sparse rows, which stream
        table by table; if one fails mid-way the error names what was already applied.
        shard_id/shard_num (the loading world, any size) default like `save`'s; rank r loads the ids
        that `recckpt.partition(ids, shard_num) == r`, or that LoadConfig.ownership assigns to it.
        `storage_options` (default: this Saver's) open `ckpt_path`. A checkpoint deleted while it is
        read (retention in another process) raises CheckpointDeletedError. Not a collective: a failure one
        rank meets raises there only (docs/DISTRIBUTED.md); CheckpointManager.restore() agrees across ranks. The work is
        `recckpt.load.loader.load_checkpoint`'s; the Saver only keeps what the next incremental save needs."""
        shard_id, world = resolve_shard(shard_id, shard_num)
        storage = self.storage if ckpt_path is None else self.open_storage(ckpt_path, storage_options)
        target = LoadTarget(self.model, self.sparse_optim, self.registry, self.concurrency, self.read_options)
        if direct_path and ckpt_path is None:
            raise InvalidArgumentError("direct_path=True needs ckpt_path: the committed checkpoint directory")
        url = self.output_dir if ckpt_path is None else storage_location(ckpt_path)
        request = LoadRequest(storage, url, ckpt_id, direct_path, LoadConfig.coerce(load_conf), shard_id, world,
                              parent_storage=lambda url: self.open_storage(url, storage_options))
        outcome = load_checkpoint(target, request, before_apply=self._forget_chain)
        if outcome.result.metadata.get(META_EPHEMERAL) == "1":
            # as for a save (see _write): retention deletes it once a newer checkpoint commits
            self._dropped = (f"the checkpoint loaded, {outcome.result.ckpt_id!r}, is ephemeral: retention deletes it "
                             f"once a newer one commits, so no increment builds on it")
        elif storage is self.storage and outcome.replaced_whole_state:
            # a table without a mark is written whole by the next increment
            marks = {t.sparse_meta().name: t.mark_changes() for t in outcome.tables
                     if implements(t, ChangeTracking) and t.sparse_meta().name not in outcome.whole_next}
            if outcome.whole_next:
                log.info("recckpt: tables %s were loaded from column blocks; the next incremental checkpoint "
                         "holds them whole (docs/INCREMENTAL.md)", sorted(outcome.whole_next))
            self._chain = _ChainState(outcome.result.ckpt_id, outcome.manifest_sha256, marks, (shard_id, world))
        return outcome.result

    def _forget_chain(self) -> None:
        """The tables are about to change: the last checkpoint no longer describes them."""
        self._chain = None
        self._pending_forget = None
        self._lost = None
        self._dropped = None


def _extras_tree(registry: Registry, sparse_optim, model) -> dict:
    """The extras tree a save writes: every registered object's state plus the sparse optimizer's. A
    registered torch.optim optimizer also records its parameters' names in `model`, so that a load
    maps its state by name; an integration may leave out of an object's state what its tables' slots
    hold (a TorchRec data-parallel table's optimizer state)."""
    objects = {}
    for name, kind, state, allow_pickle in registry.object_states():
        names = saved_param_names(model, registry.object(name), state) if kind == "state_dict" else None
        if kind == "state_dict":
            state = plugins.saved_object_state(model, registry.object(name), state)
        objects[name] = extras_fmt.entry(name, kind, state, allow_pickle, names)
    return {"objects": objects, "sparse_optimizer": sparse_optim.state_dict() if sparse_optim is not None else None}


def _lost_commit_race(e: BaseException) -> bool:
    """Whether `e` says the commit's target already existed: another writer committed the id first."""
    import errno
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return True
        e = e.__cause__ or e.__context__
    return False
