"""Which coordinator a save uses. Kept apart from coordinator.py because it picks among the
implementations (TorchCoordinator among them), which themselves import the base class there."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .coordinator import Coordinator, InProcessCoordinator, SingleCoordinator


def coordinator_for(shard_id: int, shard_num: int, timeout_s: float = 1800.0) -> Coordinator:
    """The coordinator for worker `shard_id` of `shard_num`: collectives on a dedicated gloo group when
    this process is rank `shard_id` of an initialised torch.distributed world of `shard_num`, else all
    shards are expected from this one process (see InProcessCoordinator)."""
    if shard_num < 1 or not 0 <= shard_id < shard_num:
        raise InvalidArgumentError(f"shard_id={shard_id} is not in [0, shard_num={shard_num})")
    if shard_num == 1:
        return SingleCoordinator()
    from .world import process_group_world
    pg = process_group_world()
    if pg == (shard_id, shard_num):
        from .torch_coordinator import TorchCoordinator
        return TorchCoordinator(timeout_s)
    return InProcessCoordinator(shard_id, shard_num, timeout_s)
