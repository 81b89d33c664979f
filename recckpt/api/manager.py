"""`CheckpointManager`: recckpt in the training loop.

    manager = CheckpointManager(saver, save_interval=1000, async_save=True)
    manager.register_for_checkpointing("dense_opt", dense_opt)
    manager.load_model_bank([...])       # optional warm start
    manager.restore()                    # resume from output_dir; takes precedence over the bank
    for batch in reader:
        ...train...
        manager.step()                   # saves ckpt_<step> when a policy says so
    manager.wait()

The global step, RNG state (as per-worker IO state) and which checkpoints are ephemeral are saved with
every checkpoint; retention is the manager's KeepPolicy, applied after each commit.
"""
from __future__ import annotations

import logging
import re
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

from ..errors import CheckpointNotFoundError, CommitOutcomeUnknownError, CorruptCheckpointError, RecckptError
from ..format import catalog
from ..storage import open_storage
from .async_save import FAILED, AsyncWriter, SaveHandle
from .load_config import LoadConfig
from .policies import (EPHEMERAL, CkptEntry, EveryNSteps, KeepPolicy, SavePolicy, SaveSchedule)
from .preemption import PreemptionHandler
from .rng import RNGState
from .saver import LoadResult, Saver
from .snapshot import HostBuffers, capture_copy

log = logging.getLogger("recckpt")

RNG_IO_NAME = "__rng__"
META_STEP = "recckpt.global_step"
META_EPHEMERAL = "recckpt.ephemeral"
#: Categories a model-bank source loads unless it says otherwise: the model, not another run's
#: reader positions, RNG state or registered objects.
BANK_DEFAULT_LOAD = ("sparse", "sparse_opt", "dense")
_FROM_SAVER = object()  # default of `keep`: the saver's max_keep


def _dist_world():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _rank0_decides(value: bool) -> bool:
    """Rank 0's decision, on every rank (a broadcast when a process group is initialised)."""
    dist = _dist_world()
    if dist is None:
        return value
    import torch
    t = torch.tensor([1 if value else 0], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return bool(t.item())


def _any_rank(value: bool) -> bool:
    """True on every rank when it is true on any (a signal reaches one worker, all must save)."""
    dist = _dist_world()
    if dist is None:
        return value
    import torch
    t = torch.tensor([1 if value else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class CheckpointManager:
    """Saves `saver`'s checkpoints on a schedule, keeps what the keep policy says, and restores.

    Args:
        saver: the Saver of the model (its own `max_keep` is not used: retention is `keep`).
        save_interval: save every N steps (shorthand for `EveryNSteps(N)`); None for none.
        policies: more save policies (EveryNSeconds, AtSteps, EphemeralEveryNSteps, EveryNSteps); a step
            saves when any says so.
        keep: a KeepPolicy, an int (max_keep) or None (keep all). Default: the saver's max_keep.
        async_save: snapshot on the step into reused host buffers, write and commit in the background.
        preemption: True (SIGTERM), or a PreemptionHandler with the signals to handle.
        shard_id, shard_num: this worker and the number of workers.
        prefix: checkpoint ids are f"{prefix}{global_step}".
        save_rng: save and restore Python/NumPy/torch(/CUDA) RNG state per worker (exact resume).
    """

    def __init__(self, saver: Saver, save_interval: int | None = None, *,
                 policies: Iterable[SavePolicy] = (), keep: KeepPolicy | int | None | object = _FROM_SAVER,
                 async_save: bool = False, preemption: bool | PreemptionHandler = False,
                 shard_id: int = 0, shard_num: int = 1, prefix: str = "ckpt_", save_rng: bool = True):
        if not isinstance(saver, Saver):
            raise TypeError(f"CheckpointManager needs a recckpt.Saver, got {type(saver).__name__}")
        pols = list(policies)
        if save_interval is not None:
            pols.insert(0, EveryNSteps(save_interval))
        self.keep = KeepPolicy.coerce(saver.max_keep if keep is _FROM_SAVER else keep)
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save must be a bool, got {async_save!r}")
        self.schedule = SaveSchedule(pols, self.keep, async_save)
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]*", prefix):
            raise ValueError(f"prefix must be letters, digits, '_', '.' or '-', got {prefix!r}")
        self.saver, self.async_save, self.prefix = saver, async_save, prefix
        self.shard_id, self.shard_num = shard_id, shard_num
        self.global_step = 0
        self.restored_from: str | None = None
        self.preempted = False
        self.saves: list[SaveHandle] = []
        """Every save this manager started, oldest first (stall and write times, bytes)."""
        self._writer = AsyncWriter()
        self._buffers = HostBuffers()
        self._last_save_time = time.monotonic()
        self._last: SaveHandle | None = None
        if save_rng:
            saver.register_io_state(RNG_IO_NAME, RNGState())
        self._preemption: PreemptionHandler | None = None
        if preemption:
            self._preemption = preemption if isinstance(preemption, PreemptionHandler) else PreemptionHandler()
            self._preemption.install()

    # ----------------------------------------------------------------------------- registration
    def register_for_checkpointing(self, name: str, obj: Any) -> None:
        """See `Saver.register_for_checkpointing`."""
        self.saver.register_for_checkpointing(name, obj)

    def register_io_state(self, name: str, obj: Any) -> None:
        """See `Saver.register_io_state`."""
        self.saver.register_io_state(name, obj)

    def ckpt_id(self, step: int) -> str:
        return f"{self.prefix}{step}"

    # ------------------------------------------------------------------------------------- save
    def step(self) -> SaveHandle | None:
        """Count one training step; save `ckpt_<step>` if a policy says so (or a preemption signal
        arrived). Raises a failure of an earlier background save."""
        self._writer.raise_failure()
        self.global_step += 1
        decision = self.schedule.decide(self.global_step, time.monotonic() - self._last_save_time,
                                        agree=_rank0_decides)
        handle = self._save(ephemeral=decision == EPHEMERAL) if decision else None
        if self._preemption is not None and _any_rank(self._preemption.requested is not None):
            if self._preemption.requested is None:
                self._preemption.requested = -1  # another rank was signalled
            self._preempt()
        return handle

    def save(self) -> SaveHandle:
        """Save the current step now (a regular checkpoint); returns its handle."""
        self._writer.raise_failure()
        last = self._last
        if last is not None and last.step == self.global_step and not self._needs_retry(last):
            return last  # this step is already saved (or being saved) under ckpt_<step>
        return self._save(ephemeral=False)

    def wait(self) -> None:
        """Block until the save in flight is durable; raise its failure (or an earlier unreported one)."""
        self._writer.drain()
        self._writer.raise_failure()

    def close(self) -> None:
        """Drain, then remove the preemption handlers."""
        try:
            self.wait()
        finally:
            if self._preemption is not None:
                self._preemption.uninstall()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # drain, but do not hide the exception already propagating
            try:
                self.close()
            except Exception as e:  # noqa: BLE001
                log.error("recckpt: while leaving the manager after %s: %s", exc_type.__name__, e)
        return False

    def _save(self, ephemeral: bool) -> SaveHandle:
        step = self.global_step
        handle = SaveHandle(self.ckpt_id(step), step, ephemeral)
        metadata = {META_STEP: str(step), META_EPHEMERAL: "1" if ephemeral else "0"}
        t0 = time.perf_counter()
        if self.async_save:
            self._writer.drain()           # at most one in flight: its buffers are about to be reused
            self._writer.raise_failure()
            snap = capture_copy(self.saver, self._buffers, self.shard_id)
            handle.stall_seconds = time.perf_counter() - t0

            def write():
                path = self.saver._write(handle.ckpt_id, snap, self.shard_id, self.shard_num,
                                         metadata=metadata, retention=False, step=step)
                self._prune(handle.ckpt_id)
                return path, self._bytes_of_last()

            self._writer.submit(handle, write)
        else:
            try:
                path = self.saver._write(handle.ckpt_id, None, self.shard_id, self.shard_num,
                                         metadata=metadata, retention=False, step=step)
                self._prune(handle.ckpt_id)
            except BaseException as e:
                handle._finish(None, e)
                if isinstance(e, CommitOutcomeUnknownError):
                    self._last = handle  # rank 0 may commit it yet: see _needs_retry
                raise
            handle.write_seconds = handle.stall_seconds = time.perf_counter() - t0
            handle.bytes_written = self._bytes_of_last()
            handle._finish(path, None)
        self._last_save_time = time.monotonic()
        self._last = handle
        self.saves.append(handle)
        return handle

    def _needs_retry(self, last: SaveHandle) -> bool:
        """Whether the step of `last` must be saved again. A save whose outcome this rank never
        learned (CommitOutcomeUnknownError) may have been committed by rank 0 since; saving the step
        again would then fail on this rank alone (the checkpoint exists), so it is looked up first."""
        if last.state != FAILED:
            return False
        if isinstance(last.error, CommitOutcomeUnknownError) and self.saver._is_committed(last.ckpt_id):
            log.warning("recckpt: checkpoint %s, whose outcome this rank did not learn, is committed",
                        self.saver.storage.describe(last.ckpt_id))
            last._finish(self.saver.storage.describe(last.ckpt_id), None)
            return False
        return True

    def _bytes_of_last(self) -> int:
        s = self.saver.last_save
        return s.bytes_written if s is not None else 0

    def _prune(self, ckpt_id: str) -> None:
        """Retention after a commit (only the committing worker): delete what the keep policy allows."""
        found = self.saver.take_listed_after_commit(ckpt_id)  # this save's own listing, if it committed
        if self.shard_num > 1 and self.shard_id != 0:
            return
        storage = self.saver.storage
        entries = []
        for cid, m in (found if found is not None else catalog.committed(storage)):
            step = m.metadata.get(META_STEP)
            entries.append(CkptEntry(cid, int(step) if step is not None and step.isdigit() else None,
                                     m.metadata.get(META_EPHEMERAL) == "1"))
        doomed = self.keep.doomed(entries, self.restored_from)
        deleted = []
        for cid in doomed:
            log.info("recckpt: deleting %s (%s)", storage.describe(cid), self.keep)
            try:
                catalog.delete(storage, cid)
                deleted.append(cid)
            except OSError as e:  # a leftover checkpoint costs disk, not correctness
                log.warning("recckpt: could not delete %s: %s", storage.describe(cid), e)
        try:
            if len(deleted) < len(doomed):  # a failed delete may or may not have uncommitted it: look
                catalog.sync_version_file(storage, self.saver.options.fsync)
            elif doomed:
                gone = set(deleted)
                catalog.write_version_file(storage, [e.ckpt_id for e in entries if e.ckpt_id not in gone],
                                           self.saver.options.fsync)
        except OSError as e:  # the save is committed; the version file is advisory and the next save redoes it
            log.warning("recckpt: checkpoint %s is committed, but rewriting the version file after retention "
                        "failed: %s", storage.describe(ckpt_id), e)

    def _preempt(self) -> None:
        last = self._last
        if last is None or last.step != self.global_step or self._needs_retry(last):
            last = self._save(ephemeral=False)
        last.wait()                  # durable before the process is allowed to go
        self._writer.raise_failure()
        self.preempted = True
        log.warning("recckpt: preemption checkpoint %s is durable", last.ckpt_id)
        self._preemption.finish()

    # ---------------------------------------------------------------------------------- restore
    def checkpoints(self) -> list[tuple[str, int | None]]:
        """(ckpt_id, global step) of the committed checkpoints, oldest first."""
        out = []
        for cid, m in catalog.committed(self.saver.storage):
            out.append((cid, self._step_of(cid, m.metadata)))
        return out

    def _step_of(self, cid: str, metadata: Mapping[str, str]) -> int | None:
        s = metadata.get(META_STEP)
        if s is not None and s.isdigit():
            return int(s)
        m = re.fullmatch(re.escape(self.prefix) + r"(\d+)", cid)
        return int(m.group(1)) if m else None

    def restore(self, global_step: int | None = None, load_conf=None) -> int | None:
        """Load the newest committed checkpoint in output_dir (or the one of `global_step`) into every
        registered object; returns the restored global step, or None (nothing changed) when output_dir
        has no committed checkpoint. A newest checkpoint found corrupt is skipped for the next older one
        (each load replaces the whole state), with a warning. Takes precedence over `load_model_bank`."""
        self.wait()
        storage = self.saver.storage
        found = catalog.committed(storage) if storage.isdir("") else []
        if global_step is not None:
            match = [(cid, m) for cid, m in found if self._step_of(cid, m.metadata) == global_step]
            if not match:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of global step {global_step} in {storage.describe()}; "
                    f"committed: {[(c, self._step_of(c, m.metadata)) for c, m in found]}")
            candidates = match[-1:]
        else:
            candidates = list(reversed(found))
        if not candidates:
            log.info("recckpt: %s holds no committed checkpoint; starting fresh", storage.describe())
            return None
        errors = []
        for cid, m in candidates:
            try:
                self.saver.load(ckpt_id=cid, load_conf=load_conf, shard_id=self.shard_id,
                                shard_num=self.shard_num)
            except CorruptCheckpointError as e:
                errors.append(e)
                if global_step is None and (cid, m) != candidates[-1]:
                    warnings.warn(f"recckpt: checkpoint {storage.describe(cid)} is corrupt ({e}); trying the "
                                  f"next older one", stacklevel=2)
                    continue
                raise
            step = self._step_of(cid, m.metadata)
            if step is None:
                raise CheckpointNotFoundError(
                    f"{storage.describe(cid)} was loaded but records no global step (no {META_STEP!r} in its "
                    f"manifest metadata and its id does not match {self.prefix!r}<step>); it was not written "
                    f"by a CheckpointManager with this prefix")
            self.global_step, self.restored_from = step, cid
            self._last_save_time = time.monotonic()
            log.info("recckpt: restored %s (global step %d)", storage.describe(cid), step)
            self._warn_about_newer(found, step)
            return step
        raise errors[0]  # pragma: no cover - the loop raises or returns

    def _warn_about_newer(self, found, step: int) -> None:
        """A run rewound to an older step (explicitly, or past a corrupt newest checkpoint) will reach
        the newer checkpoints' steps again, and committed checkpoints are never overwritten: say so now,
        not at the first failing save."""
        newer = [cid for cid, m in found if (s := self._step_of(cid, m.metadata)) is not None and s > step]
        if newer:
            warnings.warn(
                f"recckpt: restored global step {step}, but {self.saver.storage.describe()} also holds newer "
                f"checkpoints {newer}; saving at their steps again will fail with CheckpointExistsError. "
                f"Delete them if this run replaces them (recckpt.format.catalog.delete), or restore the newest.",
                stacklevel=3)

    def load_model_bank(self, confs: Sequence[Mapping[str, Any]]) -> list[LoadResult]:
        """Warm start from other runs' checkpoints, in order (a later source overrides an earlier one
        for what both provide). Each source: `path` (a checkpoint directory, or an output_dir whose
        newest checkpoint is used) plus LoadConfig keys (`load`, `exclude`, `strict`, `tables`,
        `rename`, ...). `load` defaults to sparse, sparse_opt and dense. A later `restore()` that finds
        a checkpoint in this run's output_dir overrides all of it."""
        if isinstance(confs, Mapping) or not isinstance(confs, Sequence):
            raise TypeError(f"load_model_bank takes a list of source dicts, got {type(confs).__name__}")
        results = []
        for i, src in enumerate(confs):
            if not isinstance(src, Mapping) or "path" not in src:
                raise ValueError(f"model bank source #{i} must be a dict with a 'path', got {src!r}")
            conf = dict(src)
            path = conf.pop("path")
            conf.setdefault("load", list(BANK_DEFAULT_LOAD))
            lc = LoadConfig.coerce(conf)
            direct = open_storage(path).exists("manifest.json")
            try:
                results.append(self.saver.load(ckpt_path=path, direct_path=direct, load_conf=lc,
                                               shard_id=self.shard_id, shard_num=self.shard_num))
            except RecckptError as e:
                done = ", ".join(r.path for r in results) or "none"
                raise type(e)(f"model bank source #{i} ({path}): {e} (sources already applied: {done})") from e
        return results


__all__ = ["CheckpointManager", "RNG_IO_NAME", "BANK_DEFAULT_LOAD"]
