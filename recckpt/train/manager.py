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

import dataclasses
import logging
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..coordination import agreement_for, check_world, resolve_shard
from ..coordination.world import process_group_world
from ..errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    CommitOutcomeUnknownError,
    CoordinationError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidArgumentError,
    InvalidCheckpointIdError,
    RecckptError,
)
from ..format import catalog, names
from ..format.chain import chain_stats
from ..format.names import validate_ckpt_id
from ..format.retention import recorded_step, restore_order
from ..load.load_apply import io_state_resized
from ..load.load_config import LoadConfig
from .async_save import FAILED, AsyncWriter, SaveHandle
from .events import LoadEvent, SaveEvent
from .increments import IncrementPolicy
from .policies import (
    EPHEMERAL,
    META_EPHEMERAL,
    META_STEP,
    AnySavePolicy,
    EveryNSteps,
    KeepPolicy,
    SaveContext,
    SaveDecisionPolicy,
    SaveSchedule,
    parse_step,
)
from .preemption import PreemptionHandler
from .rng import RNGState
from .saver import LoadResult, Saver
from .snapshot import CaptureFailed, HostBuffers

log = logging.getLogger("recckpt")

RNG_IO_NAME = names.RNG_IO_NAME
#: How many of its saves a CheckpointManager keeps in `saves`.
SAVES_KEPT = 1000
#: Categories a model-bank source loads unless it says otherwise: the model, not another run's
#: reader positions, RNG state or registered objects.
BANK_DEFAULT_LOAD = ("sparse", "sparse_opt", "dense")
#: Keys of a model-bank source that are not LoadConfig fields.
BANK_SOURCE_KEYS = ("path", "resume_step", "storage_options")
_FROM_SAVER = object()  # default of `keep`: the saver's keep policy


class CheckpointManager:
    """Saves `saver`'s checkpoints on a schedule, keeps what the keep policy says, and restores.

    Args:
        saver: the Saver of the model. The manager's `keep` becomes the saver's retention too
            (`saver.keep`), so a direct `saver.save()` in the same output_dir keeps what the manager keeps.
        save_interval: save every N steps (shorthand for `EveryNSteps(N)`); None for none.
        policies: more save policies (EveryNSeconds, AtSteps, EphemeralEveryNSteps, EveryNSteps); a step
            saves when any says so.
        keep: a KeepPolicy, an int (max_keep) or None (keep all). Default: the saver's max_keep. It counts
            checkpoints, increments included; the links a kept checkpoint's chain needs are kept too.
        async_save: snapshot on the step into reused host buffers, write and commit in the background.
        preemption: True (SIGTERM), or a PreemptionHandler with the signals to handle. A signal that
            reaches any one rank makes every rank save the same step, then exit as signalled.
        shard_id, shard_num: this worker and the number of workers. Default, as for `Saver.save`: the
            rank and world size of the initialised torch.distributed process group, else RANK and
            WORLD_SIZE, else 0 of 1. Values that disagree with an initialised process group are an
            error (a silent single-worker save under torchrun would lose every other rank's rows).
        prefix: checkpoint ids are f"{prefix}{global_step}" (f"{prefix}{global_step}.{n}" where `restore()`
            skipped a damaged checkpoint of that id: `ckpt_id`) (checked at construction against the
            checkpoint-id rule, recckpt.format.names.validate_ckpt_id).
        save_rng: save and restore Python/NumPy/torch(/CUDA) RNG state per worker (exact resume).
        resize_policy: what `restore()` does with per-worker state when the checkpoint was saved by a
            different number of workers: 'reseed' (default) keeps the global step, drops the saved IO
            state (reader positions; `restored.io_state_dropped` lists it, with a warning) and seeds
            every generator from (global step, rank), so a resized run is reproducible; 'error' refuses
            the restore before anything is loaded.
        increments: an IncrementPolicy: write increments (only the changed sparse rows) between full
            checkpoints, a full one every k increments or once the chain's bytes pass a fraction of its
            base's (docs/INCREMENTAL.md). With async_save the changes are copied at the step that saves
            (a smaller stall than a full copy). Ephemeral saves are always full.
        on_save: called with a `SaveEvent` (ckpt_id, step, bytes, seconds, stall_seconds, rows, kind,
            throughput, ...) for every save of this worker once it is durable: on the training thread
            for a sync save, on the background writer thread for an async one. For metrics
            (TensorBoard, MLflow, W&B); what it raises is logged, never turned into a failed save.
        on_load: called with a `LoadEvent` (ckpt_id, step, bytes, seconds, rows, source) after a
            `restore()` and after each model-bank source is loaded, on the calling thread (what it
            raises is logged).

    Every collective the manager issues runs on recckpt's own gloo groups (never the default group,
    which may be NCCL), and a step runs one only when an `EveryNSeconds`-like policy or preemption
    needs it. Construct the manager on every rank, in the same order relative to other managers.
    """

    def __init__(self, saver: Saver, save_interval: int | None = None, *,
                 policies: Iterable[SaveDecisionPolicy] = (), keep: KeepPolicy | int | None | object = _FROM_SAVER,
                 async_save: bool = False, preemption: bool | PreemptionHandler = False,
                 shard_id: int | None = None, shard_num: int | None = None, prefix: str = "ckpt_",
                 save_rng: bool = True, resize_policy: str = "reseed", increments: IncrementPolicy | None = None,
                 on_save: Callable[[SaveEvent], Any] | None = None,
                 on_load: Callable[[LoadEvent], Any] | None = None):
        if not isinstance(saver, Saver):
            raise InvalidArgumentError(f"CheckpointManager needs a recckpt.Saver, got {type(saver).__name__}")
        if isinstance(policies, AnySavePolicy):
            policies = [policies]   # one composite policy is a list of one
        if isinstance(policies, (str, bytes, Mapping)) or not isinstance(policies, Iterable):
            raise InvalidArgumentError(f"CheckpointManager policies must be a list of save policies, got {policies!r}")
        pols = list(policies)
        if save_interval is not None:
            pols.insert(0, EveryNSteps(save_interval))
        self.keep = saver.keep if keep is _FROM_SAVER else KeepPolicy.coerce(keep)
        if not isinstance(async_save, bool):
            raise InvalidArgumentError(f"async_save must be a bool, got {async_save!r}")
        self.schedule = SaveSchedule(pols, self.keep, async_save)
        if increments is not None and not isinstance(increments, IncrementPolicy):
            raise InvalidArgumentError(f"increments must be a recckpt.IncrementPolicy or None, got {increments!r}")
        self.increments = increments
        for what, fn in (("on_save", on_save), ("on_load", on_load)):
            if fn is not None and not callable(fn):
                raise InvalidArgumentError(f"CheckpointManager {what} must be a function of one event, got {fn!r}")
        self.on_save, self.on_load = on_save, on_load
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"CheckpointManager prefix must be a str, got {type(prefix).__name__}")
        try:  # the id rule has one home; the longest step an int64 counter can reach must fit too
            validate_ckpt_id(f"{prefix}0")
            validate_ckpt_id(f"{prefix}{2 ** 63 - 1}")
        except InvalidCheckpointIdError as e:
            raise InvalidArgumentError(f"CheckpointManager prefix {prefix!r} cannot start checkpoint ids: {e}") from None
        if resize_policy not in ("reseed", "error"):
            raise InvalidArgumentError(f"resize_policy must be 'reseed' or 'error', got {resize_policy!r}")
        self.shard_id, self.shard_num = resolve_shard(shard_id, shard_num, saving=True)
        check_world(self.shard_id, self.shard_num, "CheckpointManager")
        if self.shard_num > 1 and process_group_world() is None:
            # (a Saver can save every shard from one process; a manager's ranks agree on each step)
            raise InvalidArgumentError(
                f"CheckpointManager: shard_id={self.shard_id}, shard_num={self.shard_num} needs an initialised "
                f"torch.distributed process group: every rank runs its own manager, and they agree on each "
                f"step's save. Call torch.distributed.init_process_group first (torchrun sets it up), or leave "
                f"shard_num unset for a job of one process")
        if not isinstance(preemption, (bool, PreemptionHandler)):
            raise InvalidArgumentError(f"CheckpointManager preemption must be a bool or a PreemptionHandler, "
                                       f"got {preemption!r}")
        # Every argument is checked: only now is the Saver changed (a refused construction leaves it as it was).
        # One retention for the output directory: a Saver applying its own max_keep after a direct
        # save() would delete what this policy keeps (e.g. keep_every_n_steps checkpoints).
        saver.keep = self.keep
        self.saver, self.async_save, self.prefix = saver, async_save, prefix
        self.resize_policy = resize_policy
        self.global_step = 0
        self.restored_from: str | None = None
        self.restored: LoadResult | None = None
        """What the last `restore()` applied (None before one)."""
        # (parent, its chain's stats) for the next save's increment decision, worked out by the background
        # writer after each commit, so that an async step does not read the store on the training thread
        self._next_chain: tuple[str, tuple | None] | None = None
        self.restore_skipped: list[str] = []
        """Checkpoints the last `restore()` found corrupt (on some rank) and skipped for an older one,
        newest first, each with why: steps of training lost, which a job that silences warnings must
        still be able to see."""
        self._skipped_ids: set[str] = set()     # the ids restore_skipped names (see ckpt_id)
        self._damaged_ids: set[str] = set()     # names holding a manifest that does not verify (rank 0's listing)
        self._restorable: set[str] = set()      # the committed checkpoints the last restore listed
        self.preempted = False
        self._closed = False
        self.saves: list[SaveHandle] = []
        """The last SAVES_KEPT saves this manager started, oldest first (stall and write times, bytes): a
        job saving every few minutes for weeks keeps a bounded list (`on_save` hears of every save)."""
        self._agreement = agreement_for(self.shard_num, saver.options.coordination_timeout_s)
        self._writer = AsyncWriter()
        self._buffers = HostBuffers(saver.options.staging_bytes)
        self._last_save_time = time.monotonic()
        self._last: SaveHandle | None = None
        self._rng: RNGState | None = None
        if save_rng:
            # The process's RNGs: one registration serves every manager a Saver gets in turn (a new one
            # after close(), or after a construction that was refused).
            self._rng = dict(saver.registry.io_items()).get(RNG_IO_NAME)
            if not isinstance(self._rng, RNGState):
                self._rng = RNGState()
                # optional: a checkpoint written without it (Saver.save(step=...), save_rng=False) is a restore
                # point too; the RNGs are then seeded from the step (see _restored)
                saver.register_io_state(RNG_IO_NAME, self._rng, optional=True)
        self._preemption: PreemptionHandler | None = None
        if preemption:
            self._preemption = preemption if isinstance(preemption, PreemptionHandler) else PreemptionHandler()
            # a manager dropped without close() must not leave a handler that swallows the signal
            self._preemption_link = self._preemption.install()
            self._retire_preemption = weakref.finalize(self, self._preemption_link.retire)

    # ----------------------------------------------------------------------------- registration
    def register_for_checkpointing(self, name: str, obj: Any, *, allow_pickle: bool = False) -> None:
        """See `Saver.register_for_checkpointing`."""
        self.saver.register_for_checkpointing(name, obj, allow_pickle=allow_pickle)

    def register_io_state(self, name: str, obj: Any, *, optional: bool = False) -> None:
        """See `Saver.register_io_state`."""
        self.saver.register_io_state(name, obj, optional=optional)

    def ckpt_id(self, step: int) -> str:
        """The id of this manager's checkpoint of `step`: f"{prefix}{step}"; where the last `restore()`
        skipped a damaged checkpoint of that id (or found one whose manifest does not verify),
        f"{prefix}{step}.{n}", n the first naming no committed or damaged checkpoint then.
        Every later restore would skip the damaged one too, and its id stays taken (committed checkpoints
        are never overwritten): under the plain id, the run's save of that step would fail, and so would
        every restart of a job its scheduler restarts. The damaged one is kept for a look (`recckpt
        verify`), and retention deletes it in its turn."""
        base = f"{self.prefix}{step}"
        if base not in self._skipped_ids and base not in self._damaged_ids:
            return base
        taken = self._restorable | self._damaged_ids
        n = 1
        while f"{base}.{n}" in taken:
            n += 1
        return f"{base}.{n}"

    # ------------------------------------------------------------------------------------- save
    def step(self) -> SaveHandle | None:
        """Count one training step; save `ckpt_<step>` if a policy says so (or a preemption signal
        arrived on any rank). Raises a failure of an earlier background save, after counting the step
        and starting its save: when a rank learns of the failure depends on when its background write
        ended, so a rank that skipped this step's save for it would leave the others saving alone."""
        self._check_open("step")
        self.global_step += 1
        earlier = self._writer.take_failure()
        try:
            handle = self._step_save()
        except Exception as e:
            if earlier is not None:   # taken above: raised here or never, so it leads, with this one as cause
                raise earlier from e
            raise
        if earlier is not None:
            raise earlier
        return handle

    def _step_save(self) -> SaveHandle | None:
        """The save this step's policies (or a preemption signal on any rank) decide, and the preemption."""
        last = self._last.step if self._last is not None else None
        context = SaveContext(time.monotonic() - self._last_save_time, last, self.shard_num)
        signal = 0
        agree = None
        if self.schedule.needs_agreement or self._preemption is not None:
            # One collective settles both: rank 0's answer for clock-like policies, and whether any
            # rank was signalled (with which signal, so that every rank exits the same way).
            mine = self.schedule.rank0_part(self.global_step, context) if self.schedule.needs_agreement else False
            requested = self._preemption.requested if self._preemption is not None else None
            rank0_says, signal = self._agreement.exchange(mine, int(requested or 0))
            agree = lambda _mine: rank0_says  # noqa: E731
        decision = self.schedule.decide(self.global_step, context, agree=agree)
        handle = self._save(ephemeral=decision == EPHEMERAL) if decision else None
        if signal:
            if self._preemption.requested is None:
                self._preemption.requested = signal  # another rank was signalled
            handle = self._preempt()   # (with exit_after_save the process ends in there)
        return handle

    def save(self) -> SaveHandle:
        """Save the current step now (a regular checkpoint); returns its handle. A step already saved
        (or being saved, or just restored) returns that save: if a policy saved it as ephemeral, it stays
        ephemeral (committed checkpoints are never rewritten), which this warns about."""
        self._check_open("save")
        self._writer.raise_failure()
        last = self._last
        if last is not None and last.step == self.global_step and not self._needs_retry(last):
            if last.ephemeral:
                warnings.warn(f"recckpt: step {self.global_step} was already saved as the ephemeral checkpoint "
                              f"{self.ckpt_id(self.global_step)!r}; it stays ephemeral and retention deletes it "
                              f"once a newer checkpoint commits. To keep this step, add it to a regular policy "
                              f"(AtSteps / EveryNSteps), or save at a later step.", stacklevel=2)
            return last  # this step is already saved (or being saved) under ckpt_<step>
        return self._save(ephemeral=False)

    def wait(self) -> None:
        """Block until the save in flight is durable; raise its failure (or an earlier unreported one)."""
        self._writer.drain()
        self._writer.raise_failure()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidArgumentError(
                f"CheckpointManager.{what}() after close(): the manager of {self.saver.storage.describe()} no longer "
                f"handles preemption signals, so its saves would not be what it promises; create a new "
                f"CheckpointManager (on the same Saver if you like) and restore() with it")

    def close(self) -> None:
        """Drain, then remove the preemption handlers. The manager saves no more: step() and save() then raise."""
        self._closed = True
        try:
            self.wait()
        finally:
            if self._preemption is not None:
                if self._retire_preemption.detach() is not None:   # (None: closed already)
                    self._preemption.close(self._preemption_link)

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

        def write(snapshot=None, incremental=False):
            return self.saver.write(handle.ckpt_id, snapshot, shard_id=self.shard_id, shard_num=self.shard_num,
                                    metadata=metadata, step=step, keep=self.keep,
                                    protect=self.restored_from, incremental=incremental)

        if self.async_save:
            self._writer.drain()           # at most one in flight: its buffers are about to be reused
            # A failure of the save just drained is NOT raised here: it stays for the next step(), save()
            # or wait(). Raised here, it would cancel this save on the ranks whose previous save ended
            # after this step began, while ranks that reported it earlier go on saving this step: the
            # ranks would then be saving different checkpoints and every later save would fail.
            # after the drain: the save in flight committed (or failed), so the chain's parent is known
            incremental = self._increment_next(ephemeral)
            try:
                snap = self.saver.capture_copy(self._buffers, self.shard_id, incremental, step=step)
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it: see CaptureFailed
                if self.shard_num == 1:
                    raise   # no other rank waits in this save: the step reports it at once
                snap, incremental = CaptureFailed(CheckpointSaveError(
                    f"checkpoint {handle.ckpt_id!r}: taking rank {self.shard_id}'s snapshot on the training thread "
                    f"failed ({type(e).__name__}: {e}); no rank commits it, and the next save is tried as "
                    f"usual", rank=self.shard_id)), False
                snap.error.__cause__ = e
            handle.stall_seconds = snap.stall_seconds = time.perf_counter() - t0
            done = {}

            def write_async():
                done["stats"] = stats = write(snap, incremental)
                self._next_chain = self._chain_of_next()
                return stats.path, stats.bytes_written

            self._writer.submit(handle, write_async,
                                None if self.on_save is None else lambda h: self._saved(h, done["stats"], True))
        else:
            try:
                stats = write(incremental=self._increment_next(ephemeral))
            except BaseException as e:
                handle.finish(None, e)
                if isinstance(e, CommitOutcomeUnknownError):
                    self._last = handle  # rank 0 may commit it yet: see _needs_retry
                raise
            handle.write_seconds = handle.stall_seconds = time.perf_counter() - t0
            handle.bytes_written = stats.bytes_written
            handle.finish(stats.path, None)
            if self.on_save is not None:
                try:
                    self._saved(handle, stats, False)
                except Exception:  # noqa: BLE001 - the checkpoint is committed; a metrics hook must not undo that
                    log.exception("recckpt: the on_save callback for checkpoint %r raised", handle.ckpt_id)
        self._last_save_time = time.monotonic()
        self._last = handle
        self.saves.append(handle)
        if len(self.saves) > SAVES_KEPT:
            del self.saves[0]
        return handle

    def _saved(self, handle: SaveHandle, stats, async_save: bool) -> None:
        """Tell `on_save` about a durable save."""
        kind = "incremental" if stats.parent is not None else "ephemeral" if handle.ephemeral else "full"
        self.on_save(SaveEvent(handle.ckpt_id, handle.step, stats.bytes_written, handle.write_seconds,
                               handle.stall_seconds, stats.sparse_rows, handle.path, kind, async_save,
                               self.shard_id, time.time()))

    def _loaded(self, result: LoadResult, source: str) -> None:
        """Tell `on_load` about a load."""
        if self.on_load is None:
            return
        event = LoadEvent(result.ckpt_id, self._step_of(result.ckpt_id or "", result.metadata),
                          result.bytes_read + result.other_bytes_read, result.seconds, result.sparse_rows,
                          result.path, source, self.shard_id)
        try:
            self.on_load(event)
        except Exception:  # noqa: BLE001 - the model is loaded; a metrics hook must not leave that half-said
            log.exception("recckpt: the on_load callback for %s raised", result.path)

    def _increment_next(self, ephemeral: bool) -> bool:
        """Whether the next save is an increment: the IncrementPolicy on the current chain, read from the
        committed manifests (so it survives restarts). Every rank reads the same files, so all agree."""
        if self.increments is None or ephemeral:
            return False
        parent = self.saver.chain_parent()
        if parent is None:
            return False
        known = self._next_chain
        return self.increments.incremental(known[1] if known is not None and known[0] == parent else
                                           self._chain_stats(parent))

    def _chain_stats(self, parent: str) -> tuple | None:
        """`chain_stats` of the chain ending at `parent`, from a listing of the output directory."""
        return chain_stats(catalog.committed(self.saver.storage), parent)

    def _chain_of_next(self) -> tuple[str, tuple | None] | None:
        """After a background save committed: the next save's parent and its chain's stats, read now (off
        the training thread); None where there is nothing to read or the store does not answer (the next
        step then reads it itself)."""
        if self.increments is None:
            return None
        parent = self.saver.chain_parent()
        if parent is None:
            return None
        try:
            return parent, self._chain_stats(parent)
        except (OSError, RecckptError) as e:
            log.debug("recckpt: the chain of %s was not read after its save: %s", parent, e)
            return None

    def _needs_retry(self, last: SaveHandle) -> bool:
        """Whether the step of `last` must be saved again. A save whose outcome this rank never
        learned (CommitOutcomeUnknownError) may have been committed by rank 0 since; saving the step
        again would then fail on this rank alone (the checkpoint exists), so it is looked up first."""
        if last.state != FAILED:
            return False
        if isinstance(last.error, CommitOutcomeUnknownError) and self.saver.is_committed(last.ckpt_id):
            log.warning("recckpt: checkpoint %s, whose outcome this rank did not learn, is committed",
                        self.saver.storage.describe(last.ckpt_id))
            last.finish(self.saver.storage.describe(last.ckpt_id), None)
            return False
        return True

    def _preempt(self) -> SaveHandle:
        """Save this step (unless saved already), wait until it is durable, serve the request; its handle."""
        last = self._last
        if last is None or last.step != self.global_step or self._needs_retry(last):
            last = self._save(ephemeral=False)
        last.wait()                  # durable before the process is allowed to go
        self._writer.raise_failure()
        self.preempted = True
        log.warning("recckpt: preemption checkpoint %s is durable", last.ckpt_id)
        self._preemption.finish()
        return last

    # ---------------------------------------------------------------------------------- restore
    def checkpoints(self) -> list[tuple[str, int | None]]:
        """(ckpt_id, global step) of the committed checkpoints, oldest first."""
        return self._with_steps(catalog.committed(self.saver.storage))

    @staticmethod
    def _candidates(found: list[tuple[str, int | None]], global_step: int | None) -> list[tuple[str, int]]:
        """(ckpt_id, step) that `restore(global_step)` tries, in order, of `found` ((ckpt_id, step), oldest
        commit first). Checkpoints without a global step (a direct saver.save("final") in the same
        directory) are not restore points: restoring one would change the model and then have no step.
        The newest is the highest step, not the last committed: a compaction of an older link, listed
        last, must not rewind the run (retention.restore_order; ties: the one committed last)."""
        if global_step is not None:
            return [(cid, step) for cid, step in found if step == global_step][-1:]
        stepped = [(cid, step) for cid, step in found if step is not None]
        step_of = dict(stepped)
        return [(cid, step_of[cid]) for cid in restore_order(stepped)]

    def _with_steps(self, found) -> list[tuple[str, int | None]]:
        """(ckpt_id, step) of each (ckpt_id, catalog entry) of `found`: the step a restart ranks it by
        (`recorded_step`: the global step a manager recorded, else the newest `Saver.save(step=...)`, as
        retention ranks it), else the one its id carries (`<prefix><step>`)."""
        out = []
        for cid, m in found:
            step = recorded_step(m.metadata, m.worker_steps)
            out.append((cid, step if step is not None else self._step_of(cid, {})))
        return out

    def _step_of(self, cid: str, metadata: Mapping[str, str]) -> int | None:
        step = parse_step(metadata.get(META_STEP))
        if step is not None:
            return step
        return parse_step(cid[len(self.prefix):]) if cid.startswith(self.prefix) else None

    def _committed_everywhere(self, global_step: int | None = None) -> tuple[list[list], list[str]]:
        """[ckpt_id, step] of the committed checkpoints as rank 0 lists them, and the names holding a manifest
        that does not verify (never listed, their ids stay taken), on every rank: ranks
        that listed a shared store a moment apart must still restore the same checkpoint. The entry
        `restore(global_step)` would load first is checked against its manifest: the catalog's check of
        its newest entry does not cover the highest step when that is an older commit."""
        listing, damaged = None, []
        if self._agreement.rank == 0:
            # no isdir first: a missing output directory lists empty, and on an object store an isdir
            # of a prefix with 10 000 checkpoints cost more than the listing itself
            found, top = catalog.committed_and_top(self.saver.storage)
            stepped = self._with_steps(found)
            first = next(iter(self._candidates(stepped, global_step)), None)
            # (a step asked for and not listed is looked for in the manifests too: the catalog may be stale)
            if (first is None and global_step is not None and found) or (
                    first is not None and not catalog.picked_entry_holds(self.saver.storage, found, first[0])):
                found, top = catalog.committed_and_top(self.saver.storage, trust_catalog=False)
                stepped = self._with_steps(found)
            listing = [list(e) for e in stepped]
            damaged = catalog.damaged(self.saver.storage, top, {cid for cid, _ in found})
            if damaged:
                warnings.warn(
                    f"recckpt: restore skips {[n for n, _ in damaged]} in {self.saver.storage.describe()}: their "
                    f"manifests do not verify ({damaged[0][1]}); their ids stay taken until deleted "
                    f"(recckpt.delete(output_dir, {[n for n, _ in damaged]!r}))", stacklevel=3)
            damaged = [n for n, _ in damaged]
        listing, damaged = self._agreement.broadcast0([listing, damaged])
        return listing, damaged

    def restore(self, global_step: int | None = None, load_conf=None) -> int | None:
        """Load the newest committed checkpoint in output_dir (or the one of `global_step`) into every
        registered object, on every rank; returns the restored global step, or None (nothing changed)
        when output_dir has no committed checkpoint. Every rank restores the same checkpoint (the same
        manifest: ranks that find different checkpoints under one name, an output directory that is not
        shared, raise CoordinationError before anything is loaded): a newest
        checkpoint found corrupt by any rank is skipped by all for the next older one (each load
        replaces the whole state), with a warning; any other failure on any rank raises on every rank,
        and a rank killed during the load makes the others raise CoordinationError saying what they
        applied. A checkpoint saved by another number of workers is
        resharded; per-worker state follows `resize_policy` (which sets `io_state_on_resize` of
        `load_conf`). Only checkpoints that record a step are restore points (the manager's global step, or
        a `Saver.save(step=...)`), and the newest is the one of the highest step (ties: the one committed
        last), as retention ranks them. Takes precedence
        over `load_model_bank`."""
        # Checked before the directory is read: a bad argument must fail the first run, not only the resume
        # after a preemption, when there is at last something to restore.
        if global_step is not None and (isinstance(global_step, bool) or not isinstance(global_step, int)
                                        or global_step < 0):
            raise InvalidArgumentError(f"restore: global_step must be an int >= 0 or None, got {global_step!r}")
        conf = LoadConfig.coerce(load_conf)
        self.wait()
        self.restore_skipped = []
        self._skipped_ids, self._damaged_ids, self._restorable = set(), set(), set()
        storage = self.saver.storage
        found, damaged = self._committed_everywhere(global_step)
        candidates = self._candidates([tuple(f) for f in found], global_step)
        if global_step is not None and not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint of global step {global_step} in {storage.describe()}; "
                f"committed: {[tuple(f) for f in found]}", path=storage.describe())
        if global_step is None and found and not candidates:
            raise CheckpointNotFoundError(
                f"{storage.describe()} holds committed checkpoints {[f[0] for f in found]}, but none records "
                f"a global step (none was written by a CheckpointManager with prefix {self.prefix!r}); "
                f"load one with saver.load(ckpt_id=...), or use another output_dir", path=storage.describe())
        if not candidates:
            log.info("recckpt: %s holds no committed checkpoint; starting fresh", storage.describe())
            return None
        conf = dataclasses.replace(conf, io_state_on_resize="drop" if self.resize_policy == "reseed" else "error")
        for i, (cid, step) in enumerate(candidates):
            self._same_as_rank0s(cid)
            self._refuse_resize(cid, conf)
            error, result = None, None
            try:
                result = self.saver.load(ckpt_id=cid, load_conf=conf, shard_id=self.shard_id,
                                         shard_num=self.shard_num)
            except Exception as e:  # noqa: BLE001 - any failure: the other ranks must still hear of it
                error = e
            # 0: loaded, 1: corrupt here (an older one may do), 2: any other failure (no fallback).
            code = 0 if error is None else 1 if isinstance(error, CorruptCheckpointError) else 2
            worst = self._outcome_agreed(cid, step, code, error)
            culprit = "another rank" if worst == 0 else self._rank_with(code == worst)
            if worst == 0:
                self._skipped_ids = {c for c, _ in candidates[:i]}
                self._restorable = {f[0] for f in found}
                self._damaged_ids = set(damaged)
                restored = self._restored(cid, step, result, found)
                self._loaded(result, "restore")
                return restored
            if worst == 1 and global_step is None and i + 1 < len(candidates):
                why = f"{storage.describe(cid)} (step {step}) is corrupt: " + (
                    str(error) if error is not None else f"{culprit} found it so")
                self.restore_skipped.append(why)
                log.warning("recckpt: restore skips %s; trying the next older one", why)
                warnings.warn(f"recckpt: checkpoint {why}; trying the next older one", stacklevel=2)
                continue
            if error is not None:
                if isinstance(error, RecckptError) and (self._agreement.world > 1 or self.restore_skipped):
                    raise error.retold(self._last_candidate_failed(error, worst)) from error
                raise error
            if worst == 1:
                raise CorruptCheckpointError(
                    f"rank {self._agreement.rank}: {culprit} found {storage.describe(cid)} corrupt (see its "
                    f"error); this rank loaded it, but a restore must be the same on every rank: fix or remove "
                    f"the checkpoint, or restore an explicit global_step", path=storage.describe(cid))
            raise CoordinationError(
                f"rank {self._agreement.rank}: restoring {storage.describe(cid)} failed on {culprit} (see its "
                f"error); this rank loaded it, but a restore must be the same on every rank: fix the cause and "
                f"restore again on every rank", rank=self._agreement.rank, path=storage.describe(cid))
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

    def _last_candidate_failed(self, error: RecckptError, worst: int) -> str:
        """The message of the error that ends a restore: which rank met it, and, after skipped checkpoints,
        that none was left (the error alone names only the last one tried)."""
        msg = f"rank {self._agreement.rank}: {error}" if self._agreement.world > 1 else str(error)
        if worst == 1 and self.restore_skipped:
            msg += (f". restore() had skipped {len(self.restore_skipped)} newer checkpoint(s) as corrupt "
                    f"(manager.restore_skipped), so none of {self.saver.storage.describe()} could be restored: "
                    f"check them with `recckpt verify`, restore an older global_step if one is kept, or start "
                    f"the run afresh in another output_dir")
        return msg

    def _rank_with(self, mine: bool) -> str:
        """'rank r', r the highest rank for which `mine` holds (a collective: every rank calls it, after an
        agreement found a failure), or 'another rank' where the ranks cannot agree on it."""
        if self._agreement.world == 1:
            return f"rank {self._agreement.rank}"
        try:
            r = self._agreement.worst(self._agreement.rank if mine else -1)
        except CoordinationError:
            return "another rank"
        return f"rank {r}" if r >= 0 else "another rank"

    def _refuse_resize(self, cid: str, conf: LoadConfig) -> None:
        """Under resize_policy='error', refuse on every rank (they read one manifest), before anything is
        loaded, a checkpoint whose per-worker IO state another number of workers saved: the loader's own
        refusal advises a LoadConfig option the manager sets from resize_policy."""
        if self.resize_policy != "error":
            return
        try:
            m = catalog.read_manifest(self.saver.storage, cid)
        except (OSError, RecckptError):
            return   # the load says why
        if io_state_resized(conf, self.saver.registry, m, self.shard_num):
            raise IncompatibleCheckpointError(
                f"checkpoint {self.saver.storage.describe(cid)} was saved by {m.shard_num} worker(s) and is restored "
                f"on {self.shard_num}: its per-worker IO state (reader positions) cannot be split or merged, and "
                f"this CheckpointManager has resize_policy='error'. Nothing was loaded. Use resize_policy='reseed' "
                f"to restore everything else, restart the readers and seed the RNGs from (step, rank), or restore "
                f"on {m.shard_num} workers", path=self.saver.storage.describe(cid), rank=self.shard_id)

    def _outcome_agreed(self, cid: str, step: int, code: int, error: BaseException | None) -> int:
        """The worst of every rank's restore `code`. Where the ranks cannot agree (a rank was killed or
        stopped responding during the load), the CoordinationError says what this rank applied."""
        try:
            return self._agreement.worst(code)
        except CoordinationError as e:
            did = ("this rank loaded it" if error is None else
                   f"this rank's load failed ({type(error).__name__}: {error}), so its state may be partly loaded")
            raise CoordinationError(
                f"restoring {self.saver.storage.describe(cid)} (global step {step}): {did}, but the ranks could "
                f"not agree on the outcome, so the ranks may now hold different states; restart every rank and "
                f"restore again. {e}", rank=e.rank) from (error if error is not None else e)

    def _same_as_rank0s(self, cid: str) -> None:
        """Raise on every rank, before any loads, when some rank's `cid` is not the checkpoint rank 0 sees
        under that name (its manifest differs): the output directory is not shared, and each rank would
        restore its own disk's state. A collective: every rank calls it (a world of one has nothing to
        compare)."""
        if self._agreement.world == 1:
            return
        try:
            mine = catalog.read_manifest(self.saver.storage, cid).content_sha256
        except (OSError, RecckptError):
            mine = None   # unreadable here: the load says why
        ref = self._agreement.broadcast0(mine)
        differs = mine is not None and ref is not None and mine != ref
        if not self._agreement.worst(int(differs)):
            return
        where, rank = self.saver.storage.describe(cid), self._agreement.rank
        seen = (f"its manifest's sha256 is {mine[:16]}... here and {ref[:16]}... on rank 0" if differs
                else "another rank read a different manifest under that name")
        raise CoordinationError(
            f"rank {rank}: checkpoint {where} is not the same checkpoint on every rank ({seen}): the output "
            f"directory is not shared between the ranks (a node-local path given to a multi-node job?), so "
            f"each rank would restore another state. Nothing was loaded; give every rank one shared output_dir",
            rank, path=where)

    def _restored(self, cid: str, step: int | None, result: LoadResult, found) -> int:
        storage = self.saver.storage
        if step is None:
            raise CheckpointNotFoundError(
                f"{storage.describe(cid)} was loaded but records no global step (no {META_STEP!r} in its "
                f"manifest metadata and its id does not match {self.prefix!r}<step>); it was not written "
                f"by a CheckpointManager with this prefix", path=storage.describe(cid))
        self.global_step, self.restored_from, self.restored = step, cid, result
        # The restored checkpoint is this step's save: save() (or a preemption) at this step returns it
        # instead of writing the step again, which committed checkpoints refuse.
        self._last = SaveHandle(cid, step, result.metadata.get(META_EPHEMERAL) == "1")
        self._last.finish(storage.describe(cid), None)
        resized = result.saved_by_workers not in (0, self.shard_num)
        # A resized restore seeds the RNGs from (step, rank) whenever it did not load them (dropped with the
        # other IO state, or left out by load_conf), so that it is reproducible as resize_policy says
        reseeded = self._rng is not None and (RNG_IO_NAME in result.io_state_dropped or (
            resized and RNG_IO_NAME not in result.io_state))
        if reseeded:
            self._rng.reseed(step, self.shard_id)
        if reseeded and not result.io_state_dropped:
            warnings.warn(f"recckpt: {storage.describe(cid)} was saved by {result.saved_by_workers} worker(s) and "
                          f"restored on {self.shard_num} without its RNG state (load_conf left out 'io_state'): "
                          f"every RNG was seeded from (step {step}, rank {self.shard_id})", stacklevel=3)
        if result.io_state_dropped:
            why = (f"it was saved by {result.saved_by_workers} worker(s), restored on {self.shard_num} "
                   f"(resize_policy='reseed')" if result.saved_by_workers not in (0, self.shard_num) else
                   "it holds none of it (written by Saver.save, or with save_rng=False)")
            warnings.warn(
                f"recckpt: per-worker IO state {result.io_state_dropped} of {storage.describe(cid)} was not "
                f"loaded on worker {self.shard_id}: {why}. The objects keep their own state"
                + (f"; every RNG was seeded from (step {step}, rank {self.shard_id})" if reseeded else ""),
                stacklevel=3)
        self._last_save_time = time.monotonic()
        log.info("recckpt: restored %s (global step %d)", storage.describe(cid), step)
        self._warn_about_newer(found, step)
        return step

    def _warn_about_newer(self, found, step: int) -> None:
        """A run rewound to an older step (explicitly, or past a corrupt newest checkpoint) will reach
        the newer checkpoints' steps again, and committed checkpoints are never overwritten: say so now,
        not at the first failing save."""
        newer = [cid for cid, s in found if s is not None and s > step and cid not in self._skipped_ids]
        if newer:
            warnings.warn(
                f"recckpt: restored global step {step}, but {self.saver.storage.describe()} also holds newer "
                f"checkpoints {newer}; saving at their steps again will fail with CheckpointExistsError. "
                f"Delete them if this run replaces them (recckpt.delete(output_dir, {newer!r})), or restore the "
                f"newest.",
                stacklevel=3)

    def load_model_bank(self, confs: Sequence[Mapping[str, Any]]) -> list[LoadResult]:
        """Warm start from other runs' checkpoints, in order (a later source overrides an earlier one
        for what both provide). Each source: `path` (a checkpoint directory, or an output_dir whose
        newest checkpoint is used) plus LoadConfig keys (`load`, `exclude`, `strict`, `tables`,
        `rename`, ...); `load` defaults to sparse, sparse_opt and dense. `resume_step: True` also
        continues the global step from that source's checkpoint (add "extra" to `load` to take its
        registered objects too), as a run that starts from another run's checkpoint would.

        When this run's output_dir already holds a committed checkpoint, nothing is read from the bank
        (a restarted run continues from its own checkpoints: `restore()` takes precedence), and an empty
        list is returned; the sources are still validated."""
        if isinstance(confs, Mapping) or not isinstance(confs, Sequence):
            raise InvalidArgumentError(f"load_model_bank takes a list of source dicts, got {type(confs).__name__}")
        sources = []
        for i, src in enumerate(confs):
            if not isinstance(src, Mapping) or "path" not in src:
                raise InvalidArgumentError(f"model bank source #{i} must be a dict with a 'path', got {src!r}")
            conf = {k: v for k, v in src.items() if k not in BANK_SOURCE_KEYS}
            conf.setdefault("load", list(BANK_DEFAULT_LOAD))
            resume = src.get("resume_step", False)
            if not isinstance(resume, bool):
                raise InvalidArgumentError(f"model bank source #{i}: resume_step must be a bool, got {resume!r}")
            sources.append((src["path"], LoadConfig.coerce(conf), resume, src.get("storage_options")))
        if self._committed_everywhere()[0]:
            log.info("recckpt: %s holds committed checkpoints: restore() resumes from them, so the model "
                     "bank (%d source(s)) is not read", self.saver.storage.describe(), len(sources))
            return []
        results = []
        for i, (path, lc, resume, options) in enumerate(sources):
            try:
                direct = self.saver.open_storage(path, options).exists("manifest.json")
                res = self.saver.load(ckpt_path=path, direct_path=direct, load_conf=lc,
                                      shard_id=self.shard_id, shard_num=self.shard_num, storage_options=options)
            except RecckptError as e:
                done = ", ".join(r.path for r in results) or "none"
                raise e.retold(f"model bank source #{i} ({path}): {e} (sources already applied: {done})") from e
            results.append(res)
            self._loaded(res, "model_bank")
            if resume:
                step = self._step_of(res.ckpt_id or "", res.metadata)
                if step is None:
                    raise CheckpointNotFoundError(
                        f"model bank source #{i} ({path}) has resume_step=True, but {res.path} records no "
                        f"global step (no {META_STEP!r} in its manifest metadata); it was not written by a "
                        f"CheckpointManager. Sources already applied: {', '.join(r.path for r in results)}",
                        path=res.path)
                self.global_step = step
                self._last_save_time = time.monotonic()
        return results


__all__ = ["CheckpointManager", "RNG_IO_NAME", "BANK_DEFAULT_LOAD", "SaveEvent", "LoadEvent"]
