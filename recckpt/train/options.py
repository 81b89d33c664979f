"""Save-side options: one validated dataclass, a docstring per field."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..format.hashing import DEFAULT_NUM_BUCKETS, NUM_BUCKETS_LIMIT

#: Largest byte count an option may give (the engine counts bytes in int64).
MAX_BYTES = 1 << 62
#: Longest timeout an option may give, in seconds (about 31 years: "never", within what an int64 of
#: milliseconds and datetime.timedelta hold).
MAX_TIMEOUT_S = 1e9


@dataclass(frozen=True)
class SaveOptions:
    num_buckets: int = DEFAULT_NUM_BUCKETS
    """Buckets per table (B). Fixed per checkpoint and recorded in its manifest; a loader on W workers
    reads whole buckets, so B should be well above any world size you will load on."""

    chunk_bytes: int = 256 << 10
    """Bytes covered by one CRC-32C. Also the granularity of a partial (resharded) read: a worker reading
    a bucket range reads at most two extra chunks per column and segment. 256 KiB keeps a 1-of-3 load of
    an object store within 1.2 x its share at default segment sizes (benchmarks/bench_s3.py; 1 MiB gave
    1.32 x) and costs nothing measurable on local saves and loads; the index holds 4 bytes per chunk."""

    segment_bytes: int = 64 << 20
    """Target bytes of one exported chunk of a table, which becomes one bucket-sorted segment. Bounds the
    memory a save needs per table beyond the table itself, and splits a giant table across threads."""

    max_inflight_bytes: int = 256 << 20
    """Exported bytes that may wait for the writer threads before the exporter blocks."""

    staging_bytes: int = 64 << 20
    """Host memory a save may use to copy tables that live on a device (e.g. ``HashTable(device="cuda")``)
    to the host: two reusable buffers of half this size (pinned for CUDA tables), so the pinned memory a
    save holds is bounded by this value whatever the table size. Each buffer must hold at least one row
    of a table's slots. Tables in host memory are written without it."""

    fsync: bool = True
    """fsync files and directories before the commit. Turn off only for tests on throwaway disks."""

    coordination_timeout_s: float = 1800.0
    """Distributed saves: how long a rank waits for the others at each step of the commit protocol
    (gathering the parts, hearing the outcome). When one rank fails or stops responding, every other
    rank raises within this time and nothing is committed. Must cover the slowest rank's writing."""

    storage_timeout_s: float = 300.0
    """Object stores: the longest one remote operation (a request with its retries, or one concurrent
    batch of uploads or ranged reads) may take before the save or load fails with a StorageError. A frozen
    endpoint fails a save within about this time. Raise it for very large shard files on slow links."""

    visibility_timeout_s: float = 30.0
    """Before the commit, rank 0 opens every file every rank wrote, at the location it commits, and
    checks its size: a checkpoint some rank's files are missing from could never be loaded (an
    output_dir that is not shared between the nodes). Files another node wrote that a shared
    filesystem shows late (NFS attribute caches) are waited for up to this long; after that the save
    fails on every rank and nothing is committed."""

    def __post_init__(self):
        for name, lo in (("num_buckets", 1), ("chunk_bytes", 64), ("segment_bytes", 1), ("max_inflight_bytes", 1),
                         ("staging_bytes", 256)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= MAX_BYTES:
                raise InvalidArgumentError(f"SaveOptions.{name} must be an integer in [{lo}, 2**62], got {v!r}")
        if not isinstance(self.fsync, bool):
            raise InvalidArgumentError(f"SaveOptions.fsync must be a bool, got {self.fsync!r}")
        # Bounded above: the timeouts become integer milliseconds (gloo, sockets); inf failed every save later.
        v = self.visibility_timeout_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_TIMEOUT_S:
            raise InvalidArgumentError(f"SaveOptions.visibility_timeout_s must be a number of seconds in [0, 1e9], "
                                       f"got {v!r}")
        for name in ("coordination_timeout_s", "storage_timeout_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIMEOUT_S:
                raise InvalidArgumentError(f"SaveOptions.{name} must be a number of seconds in (0, 1e9], got {t!r}")
        if self.num_buckets >= NUM_BUCKETS_LIMIT:
            raise InvalidArgumentError(f"SaveOptions.num_buckets={self.num_buckets} is out of the format's range: "
                             f"1 <= num_buckets < 2**24 ({NUM_BUCKETS_LIMIT}); the default is {DEFAULT_NUM_BUCKETS}")
        if self.chunk_bytes >= 1 << 31:
            raise InvalidArgumentError("SaveOptions.chunk_bytes must be below 2 GiB")
