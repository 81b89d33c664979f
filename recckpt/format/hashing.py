"""Id → bucket → owner: the one function that decides which worker holds which id.

`bucket(id) = mix64(id) mod B`; rank r of W owns buckets [r*B//W, (r+1)*B//W). The C++ engine computes
the same bucket (csrc/hash.h); this numpy version is the reference and is what the Python side uses
for routing, so training and loading can never disagree.
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

DEFAULT_NUM_BUCKETS = 4096
#: B < NUM_BUCKETS_LIMIT (docs/FORMAT.md): the one home of the bucket-count range, for SaveOptions and
#: the manifest/index validation alike.
NUM_BUCKETS_LIMIT = 1 << 24
HASH_NAME = "splitmix64"


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer of id + golden gamma, on uint64 with wrap-around."""
    z = np.asarray(ids, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = z + GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _inverse_odd(m: int) -> np.uint64:
    x = m
    for _ in range(6):  # Newton's iteration doubles the correct low bits each round: 6 rounds >= 64
        x = (x * (2 - m * x)) % (1 << 64)
    return np.uint64(x)


def _undo_xorshift(y: np.ndarray, shift: int) -> np.ndarray:
    x = y.copy()
    for _ in range(64 // shift + 1):
        x = y ^ (x >> np.uint64(shift))
    return x


def unmix64(mixed: np.ndarray) -> np.ndarray:
    """The inverse of `mix64` (int64 ids with those hashes). mix64 is a bijection, so anyone can choose ids
    with given hashes, e.g. all in one bucket: that is why in-memory hash tables key their slots
    (csrc/hash.h) and why the bucket function cannot balance chosen ids (docs/DISTRIBUTED.md)."""
    z = np.asarray(mixed, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _undo_xorshift(z, 31) * _inverse_odd(int(_M2))
        z = _undo_xorshift(z, 27) * _inverse_odd(int(_M1))
        return (_undo_xorshift(z, 30) - GOLDEN).view(np.int64)


def bucket_of(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    return (mix64(ids) % np.uint64(num_buckets)).astype(np.int64)


def id_range_buckets(a: int, b: int, input_size: int, num_buckets: int) -> list[tuple[int, int]]:
    """The bucket ranges of an "id_range" table (docs/FORMAT.md) that hold its ids in [a, b): those of
    [a, b) within [0, H) (bucket = id * (B - 1) // H), then the reserved last bucket B - 1, which holds
    every id outside [0, H) and so is read by every loader."""
    last = num_buckets - 1
    a, b = max(a, 0), min(b, input_size)
    out = []
    if a < b:
        out.append((a * last // input_size, (b - 1) * last // input_size + 1))
    if out and out[-1][1] >= last:
        out[-1] = (out[-1][0], num_buckets)
    else:
        out.append((last, num_buckets))
    return out


def bucket_range(rank: int, world: int, num_buckets: int) -> tuple[int, int]:
    """The contiguous bucket range [lo, hi) that `rank` of `world` owns."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of size {world}")
    return rank * num_buckets // world, (rank + 1) * num_buckets // world


def owner_of_bucket(buckets: np.ndarray, world: int, num_buckets: int) -> np.ndarray:
    """Rank owning each bucket: the largest r with r*B//W <= b, i.e. ceil((b+1)W/B) - 1."""
    b = np.asarray(buckets, dtype=np.int64)
    return ((b + 1) * world + num_buckets - 1) // num_buckets - 1


def hash_ownership(num_buckets: int):
    """An ownership function `(ids: int64 tensor, world) -> ranks` giving each id the rank that owns its hash
    bucket (recckpt's own routing, `recckpt.partition`), for checkpoints whose buckets follow another
    function (a table bucketed by row or id range loaded into a table routed by hash)."""
    def owners(ids, world: int) -> np.ndarray:
        return owner_of_bucket(bucket_of(np.asarray(ids, dtype=np.int64), num_buckets), world, num_buckets)
    return owners
