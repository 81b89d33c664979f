"""What a save or a load reports: the figures a user sends to a metrics system (TensorBoard, MLflow,
W&B), given to `CheckpointManager(on_save=..., on_load=...)` callbacks as small frozen dataclasses, and
the one INFO line each save writes to the `recckpt` logger."""
from __future__ import annotations

from dataclasses import dataclass


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class SaveEvent:
    """One save of this worker that became durable (committed). On the committing worker (rank 0)
    `bytes`/`rows` are the whole checkpoint's; on the others, that worker's part."""
    ckpt_id: str
    step: int | None
    bytes: int
    seconds: float
    """Time the write took: the whole save when sync, the background write when async."""
    stall_seconds: float
    """Time the training step was held (sync: the whole save; async: the snapshot)."""
    rows: int
    path: str
    kind: str
    """'full', 'incremental' or 'ephemeral'."""
    async_save: bool
    rank: int
    durable_time: float
    """time.time() when the save became durable."""

    @property
    def throughput(self) -> float:
        """Bytes per second of the write."""
        return _rate(self.bytes, self.seconds)


@dataclass(frozen=True)
class LoadEvent:
    """One load of this worker: a restore or a model-bank source."""
    ckpt_id: str | None
    step: int | None
    bytes: int
    """Bytes read from the checkpoint's shard files."""
    seconds: float
    rows: int
    path: str
    source: str
    """'restore' or 'model_bank'."""
    rank: int

    @property
    def throughput(self) -> float:
        return _rate(self.bytes, self.seconds)


def save_line(ckpt_id: str, step: int | None, nbytes: int, seconds: float, rows: int, *, kind: str,
              rank: int, whole: bool, stall_seconds: float | None = None) -> str:
    """The INFO line of one save: id, step, bytes, seconds, throughput (and the stall of an async one)."""
    what = f"saved {ckpt_id}" if whole else f"rank {rank} wrote its part of {ckpt_id}"
    line = (f"recckpt: {what} (step {'-' if step is None else step}, {kind}): {nbytes / 1e6:.1f} MB, {rows} rows "
            f"in {seconds:.3f} s ({_rate(nbytes, seconds) / 1e6:.1f} MB/s)")
    if stall_seconds is not None:
        line += f"; training stalled {stall_seconds:.3f} s (async save)"
    return line


__all__ = ["SaveEvent", "LoadEvent", "save_line"]
