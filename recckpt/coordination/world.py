"""Which worker am I: shard_id / shard_num defaults from the process group, else RANK / WORLD_SIZE."""
from __future__ import annotations

import os

from ..errors import InvalidArgumentError


def process_group_world() -> tuple[int, int] | None:
    """(rank, world) of the initialised default torch.distributed group, or None."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch build without distributed support
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not an integer; unset it or pass "
                         f"shard_id/shard_num explicitly") from None


def resolve_shard(shard_id: int | None, shard_num: int | None, *, saving: bool = False) -> tuple[int, int]:
    """Fill in what the caller left as None: from the process group when one is initialised, else
    from RANK / WORLD_SIZE, else worker 0 of 1. Explicit values always win.

    A save on several workers needs the process group to gather their parts, so `saving` with
    RANK / WORLD_SIZE > 1 but no process group is an error rather than a save that never commits."""
    found = (0, 1) if shard_id is not None and shard_num is not None else process_group_world()
    if found is None:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        found = (rank if rank is not None else 0, world if world is not None else 1)
        if saving and shard_num is None and found[1] > 1:
            raise InvalidArgumentError(
                f"WORLD_SIZE={found[1]} but torch.distributed is not initialised, so the workers of this "
                f"save cannot agree on a commit: call torch.distributed.init_process_group() first (gloo "
                f"or nccl), or pass shard_id/shard_num to save all shards from one process")
    sid = found[0] if shard_id is None else shard_id
    num = found[1] if shard_num is None else shard_num
    for name, v in (("shard_id", sid), ("shard_num", num)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidArgumentError(f"{name} must be an integer, got {v!r}")
    if num < 1 or not 0 <= sid < num:
        raise InvalidArgumentError(f"shard_id={sid} is not in [0, shard_num={num})")
    return sid, num


def check_world(shard_id: int, shard_num: int, who: str) -> None:
    """Refuse a view of the world that disagrees with an initialised process group: under torchrun,
    every rank saving as "worker 0 of 1" would race to commit one id and keep one rank's rows."""
    pg = process_group_world()
    if pg is not None and (shard_id, shard_num) != pg:
        raise InvalidArgumentError(
            f"{who}: shard_id={shard_id}, shard_num={shard_num} disagree with the initialised "
            f"torch.distributed process group (rank {pg[0]} of {pg[1]}); leave shard_id/shard_num unset to "
            f"take them from the process group, or pass the rank and world size")
