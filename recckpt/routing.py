"""Which rank owns an id: the one ownership function, shared by distributed training and loading.

`partition(ids, world)` is `owner(bucket(id))` with the bucket function of docs/FORMAT.md
(splitmix64 mod B) and contiguous bucket ranges per rank. A checkpoint loaded on `world` ranks gives
rank r exactly the ids for which `partition(ids, world) == r` (with B = the checkpoint's num_buckets,
default 4096), so a job that routes its ids with this function finds every row where it expects it
after a restart on any number of workers, and each rank reads only its own bucket range.
"""
from __future__ import annotations

import numpy as np
import torch

from . import _C
from .errors import InvalidArgumentError
from .format.hashing import DEFAULT_NUM_BUCKETS, NUM_BUCKETS_LIMIT, owner_of_bucket


def _check(world: int, num_buckets: int) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise InvalidArgumentError(f"partition: world must be an integer >= 1, got {world!r}")
    if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or not 1 <= num_buckets < NUM_BUCKETS_LIMIT:
        raise InvalidArgumentError(f"partition: num_buckets must be an integer in [1, 2**24), the format's range, got "
                         f"{num_buckets!r}")


def partition(ids, world: int, num_buckets: int = DEFAULT_NUM_BUCKETS):
    """Owning rank (0..world-1) of each id. `ids`: int64 torch tensor (any shape, any device) or numpy
    array; returns the same kind and shape, int64. Pass the checkpoints' `SaveOptions.num_buckets`
    if you changed it from the default."""
    _check(world, num_buckets)
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.int64:
            raise InvalidArgumentError(f"partition: ids must be int64, got {ids.dtype}")
        flat = ids.detach().reshape(-1).cpu().contiguous().numpy()
        out = _owner(flat, world, num_buckets).reshape(tuple(ids.shape))
        return torch.from_numpy(out).to(ids.device)
    arr = np.asarray(ids)
    if arr.dtype != np.int64:
        raise InvalidArgumentError(f"partition: ids must be int64, got {arr.dtype}")
    return _owner(np.ascontiguousarray(arr.reshape(-1)), world, num_buckets).reshape(arr.shape)


def _owner(flat: np.ndarray, world: int, num_buckets: int) -> np.ndarray:
    if world == 1:
        return np.zeros(flat.shape, dtype=np.int64)
    return owner_of_bucket(np.asarray(_C.bucket_of(flat, num_buckets)), world, num_buckets)


def split_by_owner(ids: torch.Tensor, world: int, num_buckets: int = DEFAULT_NUM_BUCKETS
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route a batch of ids to their owners, e.g. for `all_to_all_single`.

    Returns `(order, counts, owners)`: `ids.reshape(-1)[order]` lists the ids grouped by owning rank
    (rank 0's first, input order kept within a rank), `counts[r]` is how many go to rank r, and
    `owners` is `partition(ids, world)`. Send `ids.reshape(-1)[order]` with split sizes `counts`; the
    answers come back in the same order, and `out[order.argsort()]` restores the input order."""
    owners = partition(ids, world, num_buckets)
    flat = owners.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=world)
    return order, counts, owners


__all__ = ["partition", "split_by_owner"]
