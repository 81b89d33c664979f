"""One load, start to end: resolve which checkpoint a request names, open it, match it against the
live objects and apply it (`LoadPlan`). `Saver.load` and the manager's restore delegate here."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CheckpointDeletedError, CheckpointNotFoundError, RecckptError
from ..format import catalog, gcpause
from ..format.chain import split_path
from ..format.checkpoint import CheckpointReader
from ..format.names import MANIFEST, validate_ckpt_id
from ..format.retention import recorded_step
from ..format.sparse_io import ReadOptions
from ..state.registry import Registry
from ..storage import Storage
from .load_apply import LoadPlan, LoadResult
from .load_config import LoadConfig

log = logging.getLogger("recckpt")


@dataclass(frozen=True)
class LoadTarget:
    """The live objects a load applies to."""
    model: Any
    sparse_optim: Any
    registry: Registry
    threads: int
    """Reader threads."""
    read_options: ReadOptions


@dataclass(frozen=True)
class LoadRequest:
    """Which checkpoint to load, and onto which worker of which world."""
    storage: Storage
    """An output directory, or with `direct_path` one checkpoint directory."""
    url: str
    """The path or URL `storage` was opened from, as the user gave it."""
    ckpt_id: str | None
    """None: the newest committed checkpoint of the output directory."""
    direct_path: bool
    conf: LoadConfig
    shard_id: int
    world: int
    parent_storage: Callable[[str], Storage]
    """Opens the output directory above a `direct_path` increment (its parents are its siblings)."""


@dataclass(frozen=True)
class LoadOutcome:
    result: LoadResult
    replaced_whole_state: bool
    """Whether every table was replaced from the checkpoint (so it describes the live tables now)."""
    manifest_sha256: str
    tables: tuple
    """The model's sparse tables, as the load saw them."""
    whole_next: frozenset = frozenset()
    """Tables the checkpoint holds as column blocks: an increment on it must hold them whole, since a
    chain's fold reads whole rows and cannot join blocks with later row changes (docs/FORMAT.md)."""


def _require_dir(storage: Storage) -> None:
    if not storage.isdir(""):
        raise CheckpointNotFoundError(f"checkpoint directory {storage.describe()} does not exist",
                                      path=storage.describe())


def resolve(request: LoadRequest) -> tuple[Storage, str, str | None]:
    """(storage, checkpoint directory within it, resolved id or None for a direct path)."""
    storage, ckpt_id = request.storage, request.ckpt_id
    if request.direct_path:
        if not storage.exists(MANIFEST):
            raise CheckpointNotFoundError(f"direct_path=True: {catalog.not_a_checkpoint(storage)}",
                                          path=storage.describe())
        if catalog.read_manifest(storage, "").parent is not None:
            # An increment's parents are its sibling directories: open it from its output directory
            # (split_path: a bare relative name such as "c2" is one below the working directory).
            head, name = split_path(request.url)
            return request.parent_storage(head), name, None
        return storage, "", None
    # No isdir up front: on an object store it costs as much as a listing. A named checkpoint is one
    # request (its manifest); a missing directory is told apart only when the answer is "not found".
    if ckpt_id is None:
        top = storage.listdir("")
        if not top:
            _require_dir(storage)
        found, newest = catalog.newest(storage, top)
        if not found and storage.exists(MANIFEST):
            raise CheckpointNotFoundError(
                f"{storage.describe()} is one checkpoint directory, not an output directory: pass "
                f"direct_path=True to load it, or its parent directory as ckpt_path",
                path=storage.describe())
        if not found:
            raise CheckpointNotFoundError(
                f"no committed checkpoint in {storage.describe()} (version file "
                f"{'missing' if catalog.read_version_file(storage) is None else 'lists none that exist'}); "
                f"save one first, or pass ckpt_path/ckpt_id of an existing checkpoint", path=storage.describe())
        # the highest global step, not merely the last committed (docs/SAFETY.md, "Which checkpoint is
        # the newest")
        ckpt_id = newest
    else:
        validate_ckpt_id(ckpt_id)
        if not catalog.is_committed(storage, ckpt_id):
            _require_dir(storage)
            listed = [i for i, _ in catalog.committed(storage)]
            if ckpt_id in listed:   # the catalog still has it: its manifest went after (by hand, a bad copy)
                raise CheckpointNotFoundError(
                    f"checkpoint {storage.describe(ckpt_id)} has no manifest.json, though the output directory's "
                    f"catalog still lists it: it was removed or damaged after its commit. Run `recckpt gc "
                    f"{storage.describe()}` to bring the catalog in line; committed now: "
                    f"{[i for i in listed if i != ckpt_id]}", path=storage.describe(ckpt_id))
            raise CheckpointNotFoundError(
                f"checkpoint {storage.describe(ckpt_id)} does not exist or was never committed; "
                f"committed: {listed}", path=storage.describe(ckpt_id))
    return storage, ckpt_id, ckpt_id


def load_checkpoint(target: LoadTarget, request: LoadRequest,
                    before_apply: Callable[[], None] = lambda: None) -> LoadOutcome:
    """Resolve, read, check and apply one checkpoint. `before_apply` runs once everything that can be
    checked up front has been, just before the live objects change."""
    # A load runs at start-up or restore, with training stopped: the cyclic collector is paused for it,
    # or the metadata and per-table work of a thousand tables trigger full collections that each walk
    # every object of the process (recckpt.format.gcpause).
    with gcpause.paused(), catalog.manifests_remembered():
        return _load_checkpoint(target, request, before_apply)


def _load_checkpoint(target: LoadTarget, request: LoadRequest, before_apply: Callable[[], None]) -> LoadOutcome:
    t0 = time.perf_counter()
    storage, ckpt_dir, resolved_id = resolve(request)
    reader = None
    try:
        reader = CheckpointReader(storage, ckpt_dir, threads=target.threads, read_options=target.read_options)
        result = LoadResult(reader.describe(), resolved_id)
        result.metadata = dict(reader.manifest.metadata)
        result.saved_by_workers = reader.manifest.shard_num
        plan = LoadPlan(target.model, target.sparse_optim, target.registry, reader, request.conf, result)
        plan.prepare(request.shard_id, request.world)
        before_apply()
        plan.apply(request.shard_id, request.world)
    except (RecckptError, OSError) as e:
        # A checkpoint deleted under the load (retention in another process) shows up as missing or
        # short files; tell it apart from a corrupt one by its commit marker.
        try:
            committed = storage.exists(f"{ckpt_dir}/{MANIFEST}" if ckpt_dir else MANIFEST)
        except (RecckptError, OSError):
            committed = True   # the store does not answer (it failed the load too): the error above says
            # what was applied, which an error of this check would hide
        if committed:
            raise
        raise CheckpointDeletedError(
            f"checkpoint {storage.describe(ckpt_dir)} was deleted while it was being loaded (by retention "
            f"in another process, or by hand): {e}. Everything is read and verified before the model is "
            f"touched, except sparse rows, which the message above names if any were applied. Load again "
            f"to get the newest checkpoint.") from e
    finally:
        if reader is not None:
            reader.close()   # local copies of an object store's shard files, if any
    result.bytes_read = reader.segments.bytes_read if reader.manifest.index else 0
    result.seconds = time.perf_counter() - t0
    m, conf = reader.manifest, request.conf
    read = [(m.dense, conf.wants("dense")), (m.extras, conf.wants("extra") or conf.wants("sparse_opt")),
            (m.io_state.get(request.shard_id), bool(result.io_state))]
    result.other_bytes_read = sum(m.files[rel].size for rel, wanted in read if rel is not None and wanted
                                  and rel in m.files)
    step = recorded_step(m.metadata, m.worker_steps)
    nbytes = result.bytes_read + result.other_bytes_read
    rate = nbytes / result.seconds / 1e6 if result.seconds > 0 else 0.0
    log.info("recckpt: loaded %s (step %s) on rank %d of %d: %.1f MB read, %d rows in %.3f s (%.1f MB/s)",
             result.path, "-" if step is None else step, request.shard_id, request.world,
             nbytes / 1e6, result.sparse_rows, result.seconds, rate)
    return LoadOutcome(result, plan.replaced_whole_state(), reader.manifest.content_sha256,
                       tuple(plan.model_sparse.values()),
                       frozenset(n for n, t in m.tables.items() if t.column_blocks is not None))


__all__ = ["LoadTarget", "LoadRequest", "LoadOutcome", "resolve", "load_checkpoint"]
