"""`Saver`: save a model's sparse tables, dense state, registered objects and per-worker IO state as one
checkpoint, and load all or part of it back."""
from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..dist import coordinator_for, resolve_shard
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CheckpointSaveError,
                      CorruptCheckpointError, IncompatibleCheckpointError, InvalidCheckpointIdError,
                      RecckptError)
from ..format import catalog, dtypes, extras as extras_fmt, names as fmt_names, recovery
from ..format.checkpoint import CheckpointReader, WorkerPart, finalize, write_worker_part
from ..format.hashing import bucket_range
from ..format.names import validate_ckpt_id
from ..format.schema import SlotInfo
from ..format.sparse_io import SparseWriteOptions, TableSource
from ..state.protocol import SparseState, split_sparse_dense_state_dict
from ..storage import open_storage
from .load_config import LoadConfig
from .options import SaveOptions
from .row_filter import RowFilter
from .sparse_load import direct_load_possible, load_table_rows

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
    sparse_rows: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class Snapshot:
    """One worker's part of a save before it is written: sparse tables (anything with `sparse_meta()`
    and `export_chunks()`), dense tensors, the extras tree and the IO-state tree (None: not written
    by this worker)."""
    tables: list
    dense: dict[str, torch.Tensor] | None
    extras: Any
    io_state: Any


@dataclass
class SaveStats:
    ckpt_id: str
    path: str
    sparse_rows: int
    bytes_written: int
    seconds: float


def _row_bytes_view(t: torch.Tensor, n: int, row_bytes: int):
    """[n, *shape] tensor → zero-copy uint8 numpy [n, row_bytes] (contiguous copy only if needed)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(n, row_bytes)


class Saver:
    """Saves and loads checkpoints of `model` (+ `sparse_optim`) under `output_dir`.

    Args:
        model: a module (or anything with `state_dict()`/`load_state_dict()`); its sparse tables are the
            `SparseState` values in its state_dict, everything else is dense.
        sparse_optim: optional sparse optimizer whose small scalar state (`state_dict()`) is saved with the
            optimizer slots under the 'sparse_opt' category.
        output_dir: a local path or an fsspec URL (e.g. 'memory://run1', 's3://bucket/run1').
        max_keep: keep the newest N committed checkpoints (None: keep all). Counted from what is on disk,
            applied only after a new checkpoint commits.
        concurrency: writer threads (and shard files per worker) for sparse tables; reader threads on load.
        options: SaveOptions (bucket count, checksum chunk, segment size, fsync).
    """

    def __init__(self, model, sparse_optim=None, output_dir: str | os.PathLike | None = None,
                 max_keep: int | None = 1, concurrency: int = 4, *, options: SaveOptions | None = None):
        if output_dir is None:
            raise ValueError("Saver needs output_dir: a local directory or an fsspec URL")
        if max_keep is not None and (not isinstance(max_keep, int) or isinstance(max_keep, bool) or max_keep < 1):
            raise ValueError(f"max_keep must be an integer >= 1 or None (keep all), got {max_keep!r}")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.model = model
        self.sparse_optim = sparse_optim
        self.output_dir = os.fspath(output_dir)
        self.storage = open_storage(self.output_dir)
        self.max_keep = max_keep
        self.concurrency = concurrency
        self.options = options or SaveOptions()
        self._extras: dict[str, Any] = {}
        self._allow_pickle: set[str] = set()
        self._recovered = False  # start-up recovery of output_dir done (first save on worker 0)
        self._io: dict[str, Any] = {}
        self.last_save: SaveStats | None = None

    # ------------------------------------------------------------------------------------ registry
    def register_for_checkpointing(self, name: str, obj: Any, *, allow_pickle: bool = False) -> None:
        """Save `obj` with every checkpoint under `name` (category 'extra'): an object with
        `state_dict()`/`load_state_dict()` (optimizer, LR scheduler, ...), or a plain value (numbers,
        strings, tensors, lists, dicts). After a load, plain values are available from `extra(name)`;
        dicts and lists are also updated in place.

        allow_pickle: state that cannot be stored without pickle is then stored with torch.save and
        loaded only with torch.load(weights_only=True) (register your own classes with
        torch.serialization.add_safe_globals). Off by default: a checkpoint from a stranger must not run
        code, and a load refuses pickled state unless the receiving object also allows it."""
        self._check_name(name, self._extras, "register_for_checkpointing")
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"register_for_checkpointing({name!r}): allow_pickle must be a bool")
        self._extras[name] = obj
        if allow_pickle:
            self._allow_pickle.add(name)

    def register_io_state(self, name: str, obj: Any) -> None:
        """Save `obj.dump_io_state()` per worker under `name`; a load calls `obj.load_io_state(state)`."""
        self._check_name(name, self._io, "register_io_state")
        if not (callable(getattr(obj, "dump_io_state", None)) and callable(getattr(obj, "load_io_state", None))):
            raise TypeError(f"register_io_state({name!r}): {type(obj).__name__} needs dump_io_state() and "
                            f"load_io_state(state) methods")
        self._io[name] = obj

    def extra(self, name: str) -> Any:
        return self._extras[name]

    @staticmethod
    def _check_name(name, registry, what):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: name must be a non-empty string, got {name!r}")
        if name in registry:
            raise ValueError(f"{what}: {name!r} is already registered")

    # ---------------------------------------------------------------------------------- listing
    def checkpoints(self) -> list[str]:
        """Committed checkpoint ids under output_dir, oldest first."""
        return [i for i, _ in catalog.committed(self.storage)]

    def latest_checkpoint(self) -> str | None:
        ids = self.checkpoints()
        return ids[-1] if ids else None

    # ------------------------------------------------------------------------------------- save
    def _write_options(self) -> SparseWriteOptions:
        o = self.options
        return SparseWriteOptions(o.num_buckets, o.chunk_bytes, self.concurrency, o.segment_bytes,
                                  o.max_inflight_bytes, o.fsync)

    def _table_source(self, table: SparseState) -> TableSource:
        meta = table.sparse_meta()
        slots = {k: SlotInfo(dtypes.name_of(s.dtype), tuple(s.shape), s.category) for k, s in meta.slots.items()}
        names = list(slots)
        max_rows = max(1, self.options.segment_bytes // (8 + sum(s.row_bytes for s in slots.values())))

        def chunks():
            for ids, cols in table.export_chunks(names, max_rows):
                n = ids.shape[0]
                if ids.dtype != torch.int64 or ids.dim() != 1:
                    raise CheckpointSaveError(f"table {meta.name!r}: export_chunks gave ids of dtype {ids.dtype} "
                                              f"and shape {tuple(ids.shape)}; expected int64 [n]")
                out = []
                for k in names:
                    c, spec = cols[k], meta.slots[k]
                    if c.dtype != spec.dtype or tuple(c.shape) != (n, *spec.shape):
                        raise CheckpointSaveError(
                            f"table {meta.name!r}, slot {k!r}: export_chunks gave {c.dtype} {tuple(c.shape)}; "
                            f"the table's metadata says {spec.dtype} {(n, *spec.shape)}")
                    out.append(_row_bytes_view(c.detach().cpu(), n, slots[k].row_bytes))
                yield ids.detach().cpu().contiguous().numpy(), out

        return TableSource(meta.name, slots, meta.num_rows, chunks())

    def _extras_tree(self) -> dict:
        objects = {}
        for name, obj in self._extras.items():
            if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                objects[name] = extras_fmt.entry(name, "state_dict", obj.state_dict(), name in self._allow_pickle)
            else:
                objects[name] = extras_fmt.entry(name, "value", obj, name in self._allow_pickle)
        opt = self.sparse_optim.state_dict() if self.sparse_optim is not None else None
        return {"objects": objects, "sparse_optimizer": opt}

    def _state(self):
        sparse, dense = split_sparse_dense_state_dict(self.model.state_dict())
        for k, v in dense.items():
            if not isinstance(v, torch.Tensor):
                raise CheckpointSaveError(
                    f"model state_dict entry {k!r} is a {type(v).__name__}, not a tensor or a SparseState; "
                    f"register it with register_for_checkpointing instead")
        return sparse, dense

    def save(self, ckpt_id: str, shard_id: int | None = None, shard_num: int | None = None, *,
             step: int | None = None) -> str:
        """Write checkpoint `ckpt_id` and commit it; returns its location.

        With shard_num > 1 each worker writes its own shard files and IO state; worker 0 also writes the
        dense state and extras, and the checkpoint commits once all shards are written. Nothing is
        visible before the commit, and older checkpoints are untouched if anything fails.
        shard_id/shard_num default to this process's rank and world size in torch.distributed (every
        rank calls save; see docs/DISTRIBUTED.md), else RANK/WORLD_SIZE, else 0 of 1. `step` (the
        training step) is recorded per worker and decides duplicate ids under duplicates='newest'."""
        return self._write(ckpt_id, None, shard_id, shard_num, step=step)

    def _capture(self, shard_id: int = 0) -> Snapshot:
        """What a save of this worker writes, read from the live objects (no copies: the sync path).
        `recckpt.api.snapshot.capture_copy` makes the same thing from host buffers for async saves."""
        sparse, dense = self._state()
        io_tree = {name: obj.dump_io_state() for name, obj in self._io.items()} if self._io else None
        return Snapshot(tables=list(sparse.values()), dense=dense if shard_id == 0 else None,
                        extras=self._extras_tree() if shard_id == 0 else None, io_state=io_tree)

    def _write(self, ckpt_id: str, snap: "Snapshot | None", shard_id: int | None = None,
               shard_num: int | None = None, *, metadata: dict[str, str] | None = None,
               retention: bool = True, step: int | None = None) -> str:
        """Write `snap` (None: capture the live state now) as checkpoint `ckpt_id` and commit it.
        `metadata` goes into the manifest; `retention=False` leaves pruning to the caller (the
        CheckpointManager, which has its own keep policy)."""
        validate_ckpt_id(ckpt_id)
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValueError(f"save: step must be an integer (the training step) or None, got {step!r}")
        shard_id, shard_num = resolve_shard(shard_id, shard_num, saving=True)
        t0 = time.perf_counter()
        coord = coordinator_for(shard_id, shard_num, self.options.coordination_timeout_s)
        key = (self.storage.describe(), ckpt_id)
        if self.storage.exists(ckpt_id):
            raise CheckpointExistsError(
                f"checkpoint {self.storage.describe(ckpt_id)} already exists; committed checkpoints are never "
                f"overwritten: choose another ckpt_id or delete it first")
        nonce = coord.begin(key)
        stage = catalog.new_staging_dir(ckpt_id, nonce)
        manifest = None
        try:
            self.storage.makedirs("")
            if shard_id == 0 and not self._recovered:
                self._recover(coord, stage)
            if snap is None:
                snap = self._capture(shard_id)
            tables = [self._table_source(t) for t in snap.tables]
            part = write_worker_part(
                self.storage, stage, shard_id, tables=tables,
                dense=snap.dense if shard_id == 0 else None,
                extras=snap.extras if shard_id == 0 else None,
                io_state=snap.io_state, opts=self._write_options(), step=step)
            parts = coord.submit(key, part.to_json())
            if parts is not None:
                manifest = finalize(self.storage, stage, ckpt_id, [WorkerPart.from_json(p) for p in parts],
                                    opts=self._write_options(), metadata=metadata)
                self._after_commit(ckpt_id, retention)
                self.last_save = SaveStats(ckpt_id, self.storage.describe(ckpt_id),
                                           sum(t.rows for t in manifest.tables.values()),
                                           sum(f.size for f in manifest.files.values()) + sum(
                                               f["size"] for p in parts for f in p["index"]["files"]),
                                           time.perf_counter() - t0)
            coord.end(key, None)   # other ranks learn the outcome (and raise if it was not committed)
        except BaseException as e:
            coord.abort(key, f"{type(e).__name__}: {e}")
            try:
                if self.storage.exists(stage):
                    self.storage.remove_tree(stage)
            except OSError:
                pass
            if isinstance(e, (RecckptError, KeyboardInterrupt)) and not isinstance(e, CorruptCheckpointError):
                raise
            hint = _os_error_hint(e)
            if manifest is None and self._is_committed(ckpt_id):
                # The commit (rename) happened and a step right after it (fsync of output_dir) failed.
                raise CheckpointSaveError(
                    f"checkpoint {self.storage.describe(ckpt_id)} was committed, but making the commit durable "
                    f"failed: {type(e).__name__}: {e}. It is listed and loadable, but may be lost if the machine "
                    f"loses power now.{hint}") from e
            try:
                # Stores without atomic rename move the data to <ckpt_id>/ before writing the manifest; that
                # directory did not exist when this save started (checked above), so it is this save's.
                if manifest is None and self.storage.exists(ckpt_id):
                    self.storage.remove_tree(ckpt_id)
            except OSError:
                pass  # start-up recovery of the next Saver removes it
            raise CheckpointSaveError(
                f"saving checkpoint {ckpt_id!r} to {self.storage.describe()} failed: {type(e).__name__}: {e}. "
                f"Nothing was committed and earlier checkpoints are intact.{hint}") from e
        return self.storage.describe(ckpt_id)

    def _is_committed(self, ckpt_id: str) -> bool:
        try:
            catalog.read_manifest(self.storage, ckpt_id)
            return True
        except (OSError, RecckptError):
            return False

    def _recover(self, coord, stage: str) -> None:
        """Once per Saver, before its first save on worker 0: remove what crashed saves and deletes left in
        output_dir and fix the version file. Staging directories of saves this process has in flight
        (other workers of this save included) are kept."""
        keep = {stage} | {catalog.new_staging_dir(i, n)
                          for i, n in coord.active_nonces(self.storage.describe()).items()}
        recovery.recover(self.storage, keep, self.options.fsync)
        self._recovered = True

    def _after_commit(self, ckpt_id: str, retention: bool = True) -> None:
        """Version file and retention. The checkpoint is committed already; these are housekeeping that the
        next save (or start-up recovery) redoes, so a failure here is a warning, not a failed save."""
        try:
            ids = [i for i, _ in catalog.committed(self.storage)]
            catalog.write_version_file(self.storage, ids, self.options.fsync)
            if retention:
                self._apply_retention(ids, ckpt_id)
        except OSError as e:
            msg = (f"checkpoint {self.storage.describe(ckpt_id)} is committed, but updating the version file or "
                   f"deleting old checkpoints failed: {type(e).__name__}: {e}. The next save retries.{_os_error_hint(e)}")
            log.warning("recckpt: %s", msg)
            warnings.warn(msg, stacklevel=3)

    def _apply_retention(self, ids: list[str], newest: str) -> None:
        if self.max_keep is None or len(ids) <= self.max_keep:
            return
        doomed = [i for i in ids[:-self.max_keep] if i != newest]
        for i in doomed:
            log.info("recckpt: deleting %s (max_keep=%d)", self.storage.describe(i), self.max_keep)
            catalog.delete(self.storage, i)
        catalog.write_version_file(self.storage, [i for i in ids if i not in set(doomed)], self.options.fsync)

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

    def _resolve(self, ckpt_path, ckpt_id, direct_path):
        if direct_path:
            if ckpt_path is None:
                raise ValueError("direct_path=True needs ckpt_path: the committed checkpoint directory")
            storage = open_storage(ckpt_path)
            if not storage.exists("manifest.json"):
                raise CheckpointNotFoundError(
                    f"{storage.describe()} is not a committed checkpoint (no manifest.json); with "
                    f"direct_path=True pass the checkpoint directory itself, e.g. <output_dir>/<ckpt_id>")
            return storage, "", None
        storage = self.storage if ckpt_path is None else open_storage(ckpt_path)
        if not storage.isdir(""):
            raise CheckpointNotFoundError(f"checkpoint directory {storage.describe()} does not exist")
        if ckpt_id is None:
            found = catalog.committed(storage)
            if not found:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint in {storage.describe()} (version file "
                    f"{'missing' if catalog.read_version_file(storage) is None else 'lists none that exist'}); "
                    f"save one first, or pass ckpt_path/ckpt_id of an existing checkpoint")
            ckpt_id = found[-1][0]
        else:
            validate_ckpt_id(ckpt_id)
            if not storage.exists(f"{ckpt_id}/manifest.json"):
                raise CheckpointNotFoundError(
                    f"checkpoint {storage.describe(ckpt_id)} does not exist or was never committed; "
                    f"committed: {[i for i, _ in catalog.committed(storage)]}")
        return storage, ckpt_id, ckpt_id

    def load(self, ckpt_path: str | None = None, ckpt_id: str | None = None, load_conf=None,
             shard_id: int | None = None, direct_path: bool = False, *, shard_num: int | None = None
             ) -> LoadResult:
        """Load a checkpoint into the registered model, optimizer, objects and IO state.

        Resolves `ckpt_path` (default output_dir) + `ckpt_id` (default: newest committed), or with
        `direct_path=True` takes `ckpt_path` as one checkpoint directory (model-bank warm start).
        Everything is read and verified before the model is touched except sparse rows, which stream
        table by table; if one fails mid-way the error names what was already applied.
        shard_id/shard_num (the loading world, any size) default like `save`'s; rank r loads the ids
        that `recckpt.partition(ids, shard_num) == r`, or that LoadConfig.ownership assigns to it."""
        t0 = time.perf_counter()
        conf = LoadConfig.coerce(load_conf)
        shard_id, world = resolve_shard(shard_id, shard_num)
        storage, ckpt_dir, resolved_id = self._resolve(ckpt_path, ckpt_id, direct_path)
        reader = CheckpointReader(storage, ckpt_dir, threads=self.concurrency)
        result = LoadResult(reader.describe(), resolved_id)
        plan = _LoadPlan(self, reader, conf, result)
        plan.prepare(shard_id, world)
        plan.apply(shard_id, world)
        result.bytes_read = reader.segments.bytes_read if reader.manifest.index else 0
        result.seconds = time.perf_counter() - t0
        return result


def _os_error_hint(e: BaseException) -> str:
    """What to do about the storage error behind a failed save, if it is one we can name."""
    import errno
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    if e is None:
        return ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return " The disk or quota is full: free space (or lower max_keep) and save again."
    if e.errno == errno.EIO:
        return " The storage reported an I/O error: check the device or mount, then save again."
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return " The output directory is not writable: fix its permissions or mount, then save again."
    return ""


class _LoadPlan:
    """Matches a checkpoint against the live objects, checks everything that can be checked up front,
    then applies it."""

    def __init__(self, saver: Saver, reader: CheckpointReader, conf: LoadConfig, result: LoadResult):
        self.saver, self.reader, self.conf, self.result = saver, reader, conf, result
        self.m = reader.manifest
        self.problems_missing: list[str] = []
        self.problems_unexpected: list[str] = []
        self.incompatible: list[str] = []

    # ---------------------------------------------------------------------------------- prepare
    def prepare(self, shard_id: int, world: int):
        conf, m = self.conf, self.m
        sparse, dense = split_sparse_dense_state_dict(self.saver.model.state_dict())
        self.model_sparse, self.model_dense = sparse, dense
        self.sparse_jobs = []   # (ckpt name, table, [(slot, SlotInfo, SlotSpec)])
        want_sparse, want_opt = conf.wants("sparse"), conf.wants("sparse_opt")
        if want_sparse or want_opt:
            self.reader.verify_worker_indexes()
            if m.index is not None:
                _ = self.reader.segments  # parse the index and check every shard size before touching tables
            matched_model = set()
            for name, info in m.tables.items():
                if not conf.table_selected(name):
                    continue
                target = conf.renamed(name)
                table = sparse.get(target)
                if table is None:
                    self._not_in_model("sparse table", name, target)
                    continue
                matched_model.add(target)
                meta = table.sparse_meta()
                slots = []
                for slot, si in info.slots.items():
                    if not conf.slot_selected(slot):
                        continue
                    if (si.category == "sparse" and not want_sparse) or (si.category == "sparse_opt" and not want_opt):
                        continue
                    spec = meta.slots.get(slot)
                    if spec is None:
                        self.problems_unexpected.append(f"slot {slot!r} of table {name!r} is not in the model")
                        continue
                    self._check_compatible(f"table {name!r} slot {slot!r}", si.dtype, si.shape,
                                           spec.dtype, tuple(spec.shape))
                    slots.append((slot, si, spec))
                for slot, spec in meta.slots.items():
                    cat_on = (spec.category == "sparse" and want_sparse) or (spec.category == "sparse_opt" and want_opt)
                    if cat_on and conf.slot_selected(slot) and slot not in info.slots:
                        self.problems_missing.append(f"slot {slot!r} of model table {target!r} is not in the checkpoint")
                self.sparse_jobs.append((name, target, table, slots))
            for target in sparse:
                if target not in matched_model and conf.table_selected(target):
                    self.problems_missing.append(f"model sparse table {target!r} is not in the checkpoint")
        self.dense_out = {}
        if conf.wants("dense"):
            ckpt_dense = self.reader.dense()
            matched = set()
            for key, t in ckpt_dense.items():
                if not conf.dense_selected(key):
                    continue
                target = conf.renamed(key)
                cur = dense.get(target)
                if cur is None:
                    self._not_in_model("dense key", key, target)
                    continue
                self._check_compatible(f"dense key {key!r}", dtypes.name_of(t.dtype), tuple(t.shape),
                                       cur.dtype, tuple(cur.shape))
                self.dense_out[target] = t.to(cur.dtype) if t.dtype != cur.dtype else t
                matched.add(target)
            for key in dense:
                if key not in matched and conf.dense_selected(key):
                    self.problems_missing.append(f"model dense key {key!r} is not in the checkpoint")
        self.extras_tree = None
        if conf.wants("extra") or conf.wants("sparse_opt"):
            tree = self.reader.extras()
            if tree is None:
                self.extras_tree = {"objects": {}, "sparse_optimizer": None}
            else:
                where = self.reader.describe(self.m.extras)
                tree = extras_fmt.validate(tree, where)
                wanted = ({n: n in self.saver._allow_pickle for n in self.saver._extras}
                          if conf.wants("extra") else {})
                self.extras_tree = extras_fmt.unpickle_allowed(tree, wanted, where)
        if conf.wants("extra"):
            objs = self.extras_tree.get("objects", {})
            for name in self.saver._extras:
                if name not in objs:
                    self.problems_missing.append(f"registered object {name!r} is not in the checkpoint")
            for name in objs:
                if name not in self.saver._extras:
                    self.problems_unexpected.append(f"checkpoint object {name!r} is not registered")
        self.io_tree = None
        resized = conf.wants("io_state") and self.saver._io and self.m.io_state and world != self.m.shard_num
        if resized and conf.io_state_on_resize == "error":
            raise IncompatibleCheckpointError(
                f"checkpoint {self.reader.describe()} was saved by {self.m.shard_num} worker(s) and is loaded "
                f"on {world}: IO state (reader positions) is per worker and cannot be split or merged. Nothing "
                f"was loaded. Pass load_conf {{'io_state_on_resize': 'drop'}} to load everything else and "
                f"restart the readers, or exclude 'io_state'.")
        if resized:
            self.result.io_state_dropped = list(self.saver._io)
            log.warning("recckpt: IO state of %s not loaded: saved by %d worker(s), loading on %d "
                        "(io_state_on_resize='drop')", self.reader.describe(), self.m.shard_num, world)
        elif conf.wants("io_state") and self.saver._io:
            self.io_tree = self.reader.io_state(shard_id)
            if self.io_tree is None:
                self.problems_missing.append(f"IO state of worker {shard_id} is not in the checkpoint "
                                             f"(it was written by {self.m.shard_num} worker(s))")
            else:
                for name in self.saver._io:
                    if name not in self.io_tree:
                        self.problems_missing.append(f"IO state {name!r} is not in the checkpoint")
        if self.incompatible:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.reader.describe()} cannot be applied: " + "; ".join(self.incompatible)
                + ". Nothing was loaded.")
        problems = self.problems_missing + self.problems_unexpected
        self.result.missing, self.result.unexpected = self.problems_missing, self.problems_unexpected
        if problems:
            text = (f"checkpoint {self.reader.describe()} does not match the model: " + "; ".join(problems))
            if self.conf.strict:
                raise IncompatibleCheckpointError(text + ". Nothing was loaded. Use load_conf "
                                                  "{'strict': False} to load what matches, or 'rename'/'tables'.")
            warnings.warn(text, stacklevel=3)

    def _not_in_model(self, kind: str, name: str, target: str) -> None:
        renamed = f" (renamed {target!r})" if target != name else ""
        self.problems_unexpected.append(f"{kind} {name!r}{renamed} is not in the model")

    def _check_compatible(self, what: str, ck_dtype: str, ck_shape, dtype: torch.dtype, shape):
        if tuple(ck_shape) != tuple(shape):
            self.incompatible.append(f"{what}: checkpoint shape {tuple(ck_shape)} vs model shape {tuple(shape)}")
            return
        model_name = dtypes.name_of(dtype)
        if ck_dtype != model_name and not (self.conf.cast and dtypes.is_float(ck_dtype) and dtypes.is_float(model_name)):
            self.incompatible.append(
                f"{what}: checkpoint dtype {ck_dtype} vs model dtype {model_name}"
                + (" (casting is off: load_conf 'cast': False)" if not self.conf.cast else
                   " (only float-to-float casts are done)"))

    # ------------------------------------------------------------------------------------ apply
    def apply(self, shard_id: int, world: int):
        applied = []
        conf = self.conf
        lo, hi = bucket_range(shard_id, world, self.m.num_buckets)
        if conf.ownership is not None:   # a foreign ownership function: read everything, keep own rows
            lo, hi = 0, self.m.num_buckets
        for name, target, table, slots in self.sparse_jobs:
            if not slots:
                continue
            try:
                cleared = conf.wants("sparse") and not conf.merge and any(si.category == "sparse" for _, si, _ in slots)
                if cleared:
                    table.clear_rows()
                reserve = getattr(table, "reserve", None)
                if callable(reserve):  # optional protocol hint: allocate once, not grow per chunk
                    expected = (self.m.tables[name].rows // world if conf.ownership is not None else
                                self.m.tables[name].rows * (hi - lo) // self.m.num_buckets)
                    reserve(len(table) + expected + expected // 8)
                names = [s for s, _, _ in slots]
                rbs = [si.row_bytes for _, si, _ in slots]
                if conf.ownership is None and conf.duplicates == "error" and \
                        direct_load_possible(table, slots, cleared):
                    self.result.sparse_rows += load_table_rows(self.reader.segments, name, target, table,
                                                               slots, lo, hi, self.reader.describe())
                else:
                    rf = RowFilter(name, self.reader.describe(), rank=shard_id, world=world,
                                   ownership=conf.ownership, rule=conf.duplicates,
                                   files=self.reader.index.files, worker_steps=self.m.worker_steps)
                    for ids, cols, fi in self.reader.segments.iter_table(name, names, rbs, lo, hi, with_file=True):
                        keep = rf.keep(ids, fi)
                        if keep is not None:
                            ids, cols = ids[keep], [c[keep] for c in cols]
                        n = len(ids)
                        if n == 0:
                            continue
                        tensors = {}
                        for (slot, si, spec), raw in zip(slots, cols):
                            t = torch.from_numpy(raw).view(dtypes.torch_dtype(si.dtype)).reshape(n, *si.shape)
                            tensors[slot] = t.to(spec.dtype) if t.dtype != spec.dtype else t
                        table.import_rows(torch.from_numpy(ids), tensors)
                        self.result.sparse_rows += n
                    self.result.sparse_rows -= rf.replaced
                    rf.check()
            except (CorruptCheckpointError, OSError, IncompatibleCheckpointError) as e:
                done = ", ".join(applied) or "none"
                if isinstance(e, IncompatibleCheckpointError):
                    raise type(e)(f"{e}. Loading stopped in table {target!r}, which is partially loaded; "
                                  f"tables fully loaded before it: {done}; dense state, extras and IO state "
                                  f"were not applied") from e
                raise CorruptCheckpointError(
                    f"{e}. Loading stopped in table {target!r}, which is partially loaded; tables fully "
                    f"loaded before it: {done}; dense state, extras and IO state were not applied",
                    getattr(e, "path", None)) from e
            applied.append(target)
        self.result.tables = applied
        if self.dense_out:
            self.saver.model.load_state_dict(self.dense_out, strict=False)
            self.result.dense_keys = list(self.dense_out)
        if self.extras_tree is not None:
            if conf.wants("sparse_opt") and self.saver.sparse_optim is not None:
                st = self.extras_tree.get("sparse_optimizer")
                if st is not None:
                    self.saver.sparse_optim.load_state_dict(st)
            if conf.wants("extra"):
                for name, entry in self.extras_tree.get("objects", {}).items():
                    if name not in self.saver._extras:
                        continue
                    self._apply_extra(name, entry)
                    self.result.extras.append(name)
        if self.io_tree is not None:
            for name, obj in self.saver._io.items():
                if name in self.io_tree:
                    obj.load_io_state(self.io_tree[name])
                    self.result.io_state.append(name)

    def _apply_extra(self, name, entry):
        obj = self.saver._extras[name]
        state = entry["state"]
        if entry["kind"] == "state_dict" and callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(state)
        elif isinstance(obj, dict) and isinstance(state, dict):
            obj.clear()
            obj.update(state)
        elif isinstance(obj, list) and isinstance(state, list):
            obj[:] = state
        else:
            self.saver._extras[name] = state
