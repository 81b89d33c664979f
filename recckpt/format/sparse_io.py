"""Reading sparse tables back from shard files, through the C++ engine: for each segment, the rows of
a bucket range are one contiguous range per column (or a row run's rows, or column groups), read in
parallel and checked against the chunk checksums. Writing is `sparse_write`; where each bucket's rows
lie in a segment is `bucket_dirs`.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from .. import _C
from ..errors import CorruptCheckpointError, IncompatibleCheckpointError, InvalidArgumentError, StorageError
from ..storage import Storage
from . import layout
from .bucket_dirs import BucketDir, RunDir
from .catalog import check_inside
from .schema import Column, IndexDoc, Segment

log = logging.getLogger("recckpt")


DIRECT_MODES = {"never": _C.DIRECT_NEVER, "auto": _C.DIRECT_AUTO, "always": _C.DIRECT_ALWAYS}


#: The engine's read error for a file it could not open for lack of descriptors or memory (csrc/read_files.h,
#: kNoResources).
_NO_RESOURCES = re.compile(r"cannot be opened for lack of resources \(errno (\d+)")

@dataclass(frozen=True)
class ReadOptions:
    """How loads read shard files: tuning only, never what is read or how it is checked."""

    batch_bytes: int = 64 << 20
    """Bytes of rows planned into one parallel read (`SegmentReader.batches`). Bigger batches keep more
    reads in flight and hold more scratch memory. A replace-load into a table that lends host memory
    (`BulkAppend`) reads each table in one batch instead: it needs no scratch."""

    readahead_bytes: int = _C.DEFAULT_READAHEAD_BYTES
    """How far ahead of its reading threads the engine asks the kernel to start reading local files; 0
    turns it off (benchmarks/bench_readahead.py compares both)."""

    direct_reads: str = "auto"
    """When the engine reads shard files with O_DIRECT, past the page cache: "auto" for the parts of plain
    columns (not column groups: `strided_direct`; not pieces under 256 KiB, such as a small table's
    columns, which are read through the cache) that are not in the page cache (a cold load then neither
    fills the cache nor copies out of it: about a third of its CPU time, more on virtual machines where fresh
    memory is costly), "never", or "always" (where the file system allows it: for loaders that must not fill
    the page cache). File systems that refuse O_DIRECT (tmpfs) are read through the cache whatever this
    says (docs/ENGINE.md)."""

    whole_file_fraction: float = 0.95
    """Object stores: a load that needs at least this share of a shard file's bytes downloads the file
    whole, in one request, instead of reading byte ranges (`SegmentReader.fetch_whole_files`); it then
    fetches at most 1/fraction (1.053 x) of what it needs of that file. Above 1: never."""

    def __post_init__(self):
        for name, lo in (("batch_bytes", 1), ("readahead_bytes", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InvalidArgumentError(f"ReadOptions.{name} must be an integer >= {lo}, got {v!r}")
        v = self.whole_file_fraction
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise InvalidArgumentError(f"ReadOptions.whole_file_fraction must be a number > 0, got {v!r}")
        if self.direct_reads not in DIRECT_MODES:
            raise InvalidArgumentError(f"ReadOptions.direct_reads must be one of {sorted(DIRECT_MODES)}, "
                                       f"got {self.direct_reads!r}")

    @property
    def engine_direct(self) -> int:
        """`direct_reads` as the engine's `read_ranges(direct=)` value."""
        return DIRECT_MODES[self.direct_reads]

    @property
    def strided_direct(self) -> int:
        """`direct_reads` as `read_strided(direct=)`'s value: column groups (a TorchRec table's rows, format
        version 5) go past the page cache only under "always". Measured on real DMP loads
        (bench_torchrec.py, 2 ranks, RowWiseAdagrad, interleaved): a cold load took 0.37-0.42 s reading them
        directly against 0.30-0.37 s through the cache, and a file read directly stays out of the cache, so
        the next load of that checkpoint (a reshard onto 3 ranks: 0.30-0.36 s against 0.21-0.22 s) reads
        the disk again."""
        return DIRECT_MODES["always"] if self.direct_reads == "always" else DIRECT_MODES["never"]


@dataclass(frozen=True)
class ReadRequest:
    """Bytes [lo, hi) of one column of a shard file, checked against the column's chunk checksums.

    `pad` is the zero padding before the column (`Segment.pad_before`); it is read and checked when
    lo == 0, so no byte of a file goes unchecked by a full read."""
    file: int            # position in IndexDoc.files
    column: Column
    lo: int
    hi: int
    what: str            # names the column in errors ("ids", "slot 'embedding'", ...)
    checksum_step: int   # bytes per checksum chunk
    pad: int = 0

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def for_engine(self, path: str, dst: np.ndarray) -> tuple:
        """The engine's request tuple (csrc/io_bindings.cpp, read_ranges) for the file at `path`."""
        c = self.column
        return (path, c.offset, c.length, self.checksum_step, np.asarray(c.crc32c, dtype=np.uint32),
                self.lo, self.hi, dst, self.pad)

    def rows(self, k0: int, k1: int, row_bytes: int) -> "ReadRequest":
        """Rows [k0, k1) of the rows this request reads (`row_bytes` bytes each)."""
        return replace(self, lo=self.lo + k0 * row_bytes, hi=self.lo + k1 * row_bytes)

    def key(self) -> tuple:
        return (self.file, self.column.offset, self.lo, self.hi, self.pad)


@dataclass(frozen=True)
class RunIds:
    """The ids [first, first + n) of rows of a row run (format version 5): stored nowhere, read from
    nothing (the index's `id0` says them)."""
    file: int
    first: int
    n: int
    what: str = "ids"

    @property
    def nbytes(self) -> int:
        return 8 * self.n

    def rows(self, k0: int, k1: int, row_bytes: int = 8) -> "RunIds":
        return replace(self, first=self.first + k0, n=k1 - k0)

    def key(self) -> tuple:
        return ("run", self.file, self.first, self.n)

    def fill(self, dst: np.ndarray) -> None:
        dst.view("<i8")[:] = np.arange(self.first, self.first + self.n, dtype=np.int64)


@dataclass(frozen=True)
class GroupedRead:
    """Rows [r0, r1) of one slot stored in several columns (column groups, format version 5), or a window of
    its columns: `pieces` (format/geometry.py) of the segment's `columns`, each checked against its chunk
    checksums, placed side by side in destination rows of `row_bytes`."""
    file: int
    columns: tuple[Column, ...]   # per piece: its segment column
    pieces: tuple[tuple[int, int, int, int], ...]   # per piece: (column row bytes, src, nbytes, dst)
    pads: tuple[int, ...]         # per piece: zero padding before its column (checked from row 0)
    r0: int
    r1: int
    row_bytes: int
    what: str

    @property
    def nbytes(self) -> int:
        return (self.r1 - self.r0) * self.row_bytes

    def rows(self, k0: int, k1: int, row_bytes: int | None = None) -> "GroupedRead":
        return replace(self, r0=self.r0 + k0, r1=self.r0 + k1)

    def key(self) -> tuple:
        return ("grouped", self.file, tuple(c.offset for c in self.columns), self.pieces, self.r0, self.r1)

    def for_engine(self, path: str, dst: np.ndarray) -> tuple:
        """The engine's request tuple (csrc/io_bindings.cpp, read_strided) for the file at `path`."""
        return (path, self.r0, self.r1, dst, self.row_bytes,
                [(c.offset, c.length, c.step, np.asarray(c.crc32c, dtype=np.uint32), w, src, nb, d, pad)
                 for c, (w, src, nb, d), pad in zip(self.columns, self.pieces, self.pads)])

    def column_reads(self) -> list[ReadRequest]:
        """The rows of each piece's column as plain reads (a store the engine cannot read directly)."""
        return [ReadRequest(self.file, c, w * self.r0, w * self.r1, self.what, c.step, pad)
                for c, (w, _, _, _), pad in zip(self.columns, self.pieces, self.pads)]

    def place(self, raws: list[np.ndarray], dst: np.ndarray) -> None:
        """Put the pieces of each column's rows (`raws`, as `column_reads` read them) into `dst`."""
        n = self.r1 - self.r0
        out = dst.reshape(n, self.row_bytes) if n else dst
        for raw, (w, src, nb, d) in zip(raws, self.pieces):
            if n:
                out[:, d:d + nb] = raw.reshape(n, w)[:, src:src + nb]


#: Bytes of verified bucket offsets one SegmentReader keeps for later reads of the same segments
#: (8·(B+1) a segment: 512 segments of 4096 buckets).
OFFSETS_CACHE_BYTES = 16 << 20


class SegmentReader:
    """Reads rows of one checkpoint's tables, verifying every byte it returns."""

    def __init__(self, storage: Storage, ckpt_dir: str, index: IndexDoc, threads: int = 4,
                 options: ReadOptions | None = None):
        self.storage, self.ckpt_dir, self.index = storage, ckpt_dir, index
        self.threads, self.options = max(1, threads), options or ReadOptions()
        self.bytes_read = 0
        self._checked_sizes: set[int] = set()
        # Verified bucket offsets, kept (up to OFFSETS_CACHE_BYTES; a chain has one reader per link) for
        # the next pass over the same segments: a chain fold reads a link's ids, then its rows, per group.
        self._offsets: dict[tuple, np.ndarray] = {}
        self._offsets_bytes = 0
        self._scratch = np.empty(0, dtype=np.uint8)
        self._local: dict[int, str] = {}   # shard file -> local copy (fetch_whole_files)
        self._tmp: str | None = None
        self._cleanup: weakref.finalize | None = None
        # Verified bytes read ahead for many small tables at once (`prefetch`), taken by `read`.
        self._prefetched: dict[tuple, np.ndarray] = {}

    def _path(self, file_idx: int) -> str:
        return f"{self.ckpt_dir}/{self.index.files[file_idx][0]}" if self.ckpt_dir else self.index.files[file_idx][0]

    def check_sizes(self) -> None:
        """Compare every shard file's size with the index (missing or truncated files fail here); the
        sizes are asked for all at once (on an object store, one listing of their directory)."""
        todo = [fi for fi in range(len(self.index.files)) if fi not in self._checked_sizes]
        try:
            have = self.storage.sizes([self._path(fi) for fi in todo])
        except FileNotFoundError:
            have = [None] * len(todo)   # one is missing: find and name it below
        for fi, n in zip(todo, have):
            self.check_size(fi, n)

    def check_size(self, fi: int, have: int | None = None) -> None:
        """Check shard file `fi` against the size the index records (`have`: its size, when already
        known) and that it lies inside the checkpoint (once per file; a missing, truncated or replaced
        file fails here)."""
        if fi in self._checked_sizes:
            return
        rel, want = self.index.files[fi]
        try:
            if have is None:
                have = self.storage.size(self._path(fi))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.storage.describe(self._path(fi))}: shard file is missing",
                                         self.storage.describe(self._path(fi))) from None
        if have != want:
            raise CorruptCheckpointError(f"{self.storage.describe(self._path(fi))}: {have} bytes, the index "
                                         f"recorded {want}; the file is truncated or replaced",
                                         self.storage.describe(self._path(fi)))
        check_inside(self.storage, self._path(fi), self.ckpt_dir, self.storage.describe(self._path(fi)))
        self._checked_sizes.add(fi)

    def fetch_whole_files(self, jobs: list[tuple[str, list[str]]], bucket_lo: int = 0,
                          bucket_hi: int | None = None) -> int:
        """Before reading `jobs` ((table, slots) pairs, each over buckets [lo, hi)) from a store the
        engine cannot read directly (an object store): download, whole and concurrently, every shard
        file those reads need at least `options.whole_file_fraction` of, into a local temporary directory; later
        reads of those files go through the engine (verified as ever). One request per file instead
        of ranged reads; partial (resharded) loads keep their exact ranged reads. Returns the bytes
        downloaded; `close()` removes the copies."""
        nb = self.index.num_buckets
        hi_b = nb if bucket_hi is None else bucket_hi
        if self.storage.engine_path(self.ckpt_dir) is not None or (bucket_lo, hi_b) != (0, nb):
            return 0
        need = [0] * len(self.index.files)
        ver = self.index.format_version
        for table, slots in jobs:
            segs = self.index.tables[table][1]
            geo = self.index.geometry_of(table)
            for seg in segs:
                cols = [p.first + k for s in slots for p in [geo.place(s, seg.block)] for k in range(p.count)]
                need[seg.file] += seg.buckets.length + seg.columns[0].length
                need[seg.file] += sum(seg.columns[c].length + seg.pad_before(c, ver)
                                      for c in cols if c < len(seg.columns))
        wanted = [fi for fi, (rel, size) in enumerate(self.index.files)
                  if size and fi not in self._local and need[fi] >= self.options.whole_file_fraction * size]
        if not wanted:
            return 0
        self.check_sizes()
        nbytes = sum(self.index.files[fi][1] for fi in wanted)
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="recckpt-load-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        if shutil.disk_usage(self._tmp).free < nbytes + (nbytes >> 3):
            log.warning("recckpt: %s: not enough free space in %s for local copies of %d shard files (%d "
                        "bytes); reading byte ranges instead (set TMPDIR elsewhere to fetch whole files)",
                        self.storage.describe(self.ckpt_dir), self._tmp, len(wanted), nbytes)
            return 0
        pairs = [(self._path(fi), os.path.join(self._tmp, f"{fi}.bin")) for fi in wanted]
        try:
            self.storage.download(pairs)
        except OSError as e:
            if e.errno in (errno.ETIMEDOUT, errno.ENOENT, errno.EACCES, errno.EPERM):
                raise   # the store is down, the checkpoint is being deleted, or access is refused
            # The local copies are an optimisation: a local disk that fills up, or a store that fails this
            # way of reading, leaves the exact ranged reads, which report a store that is really broken.
            log.warning("recckpt: %s: fetching whole shard files failed (%s); reading byte ranges instead",
                        self.storage.describe(self.ckpt_dir), e)
            for _, lp in pairs:
                with contextlib.suppress(OSError):
                    os.remove(lp)
            return 0
        for fi, (_, lp) in zip(wanted, pairs):
            have = os.path.getsize(lp)
            if have != self.index.files[fi][1]:
                raise CorruptCheckpointError(f"{self.storage.describe(self._path(fi))}: {have} bytes downloaded, "
                                             f"the index recorded {self.index.files[fi][1]}; the file changed "
                                             f"while it was read", self.storage.describe(self._path(fi)))
            self._local[fi] = lp
        return nbytes

    def close(self) -> None:
        """Remove the local copies `fetch_whole_files` made (reads then go to the store again)."""
        self._local.clear()
        if self._cleanup is not None:
            self._cleanup()
            self._tmp = self._cleanup = None

    def _engine_path(self, fi: int) -> str | None:
        return self._local.get(fi) or self.storage.engine_path(self._path(fi))

    def _scratch_views(self, sizes: list[int]) -> list[np.ndarray]:
        """Views into one buffer reused across batches. Fresh memory is expensive to fault in (on some
        machines slower than the disk), so a load touches new pages only for the table it fills."""
        total = sum(sizes)
        if self._scratch.size < total:
            self._scratch = np.empty(total, dtype=np.uint8)
        out, pos = [], 0
        for n in sizes:
            out.append(self._scratch[pos:pos + n])
            pos += n
        return out

    def _local_requests(self, reqs: list, dsts: list[np.ndarray]) -> list[tuple] | None:
        """The engine's request tuples for `reqs` (ReadRequests for read_ranges, or GroupedReads for
        read_strided) into `dsts` (each file's size checked first), or None when a file is not one the
        engine can open (an object store)."""
        paths = {}
        for r in reqs:
            if r.file not in paths:
                self.check_size(r.file)
                paths[r.file] = self._engine_path(r.file)
        if any(p is None for p in paths.values()):
            return None
        return [r.for_engine(paths[r.file], dst) for r, dst in zip(reqs, dsts)]

    def engine_requests(self, reqs: list, dsts: list[np.ndarray]) -> list[tuple] | None:
        """What `read(table, reqs, dsts)` would hand the engine's `read_ranges`, for a caller that reads the
        requests of many readers in one engine call (`recckpt.format.link_reads`); None when this reader
        must read them itself (an object store, bytes read ahead by `prefetch`, or requests that are not all
        plain ranges: format version 5's row runs and column groups). The caller adds the bytes it read to
        `bytes_read` and raises `read_error` for the first request that failed."""
        if self._prefetched or any(type(r) is not ReadRequest for r in reqs):
            return None
        return self._local_requests(reqs, dsts)

    def read_error(self, table: str, req, msg: str) -> CorruptCheckpointError | StorageError:
        """The error of a failed engine read of `req` (the engine's message `msg`), naming file and table: a
        StorageError where the process could not open the file for lack of descriptors or memory (nothing
        is wrong with the checkpoint), else CorruptCheckpointError."""
        path = self._path(req.file)
        short = _NO_RESOURCES.search(msg)
        if short is not None:
            import resource
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return StorageError(
                int(short.group(1)), f"{self.storage.describe(path)}: table {table!r}: {msg}. The checkpoint is "
                f"not known to be damaged: this process ran out of file descriptors (its limit, ulimit -n, is "
                f"{soft}) or memory; raise the limit, or close files the process holds, and load again",
                self.storage.describe(path), table=table)
        return CorruptCheckpointError(f"{self.storage.describe(path)}: table {table!r}, {req.what}: {msg}",
                                      self.storage.describe(path), table=table)

    def read(self, table: str, reqs: list, dsts: list[np.ndarray] | None = None,
             map_into: "_C.MappedRegion | None" = None) -> list[np.ndarray]:
        """The verified bytes of each request (`nbytes` each: a `ReadRequest`'s [lo, hi), and when lo == 0
        the zero padding before its column is checked too; a `GroupedRead`'s rows placed from its column
        groups; a `RunIds`'s ids, read from nothing), written into `dsts` (writable uint8 arrays) or into
        fresh arrays. Whole columns whose destination lies in `map_into` at a page-congruent address
        are mapped, not copied."""
        if not self._prefetched:
            return self._read_now(table, reqs, dsts, map_into)
        rest, rest_dst, out = self._take_prefetched(reqs, dsts)
        if rest:
            sub = iter(self._read_now(table, rest, rest_dst, map_into))
            if dsts is None:
                out = [next(sub) if o is None else o for o in out]
        return out

    def read_together(self, jobs: list[tuple[str, list, list[np.ndarray]]]) -> None:
        """`read(table, reqs, dsts)` of every (table, reqs, dsts) job, several tables in one engine call per
        kind of request (column groups; plain ranges) when every file is local and nothing was read ahead:
        a cold read then goes through each shard file once, not once per table (docs/ENGINE.md,
        `read_strided`). A failure names the table and file of the first request that failed; the jobs may
        then be partly written."""
        kinds: dict[bool, tuple[list, list, list]] = {}   # grouped? -> (owners, requests, destinations)
        for table, reqs, dsts in jobs:
            for r, d in zip(reqs, dsts):
                if isinstance(r, RunIds):
                    r.fill(d)   # a row run's ids: nothing to read
                    continue
                owners, rs, ds = kinds.setdefault(isinstance(r, GroupedRead), ([], [], []))
                owners.append(table)
                rs.append(r)
                ds.append(d)
        calls = [] if self._prefetched else [(g, o, rs, self._local_requests(rs, ds)) for g, (o, rs, ds) in kinds.items()]
        if self._prefetched or any(engine_reqs is None for *_, engine_reqs in calls):
            for table, reqs, dsts in jobs:   # bytes read ahead, or an object store: each table's own reads
                self.read(table, reqs, dsts)
            return
        for grouped, owners, rs, engine_reqs in calls:
            nread, errors = self._engine_read(grouped, engine_reqs)
            self.bytes_read += nread
            if errors:
                i, msg = errors[0]
                raise self.read_error(owners[i], rs[i], msg)

    def _read_now(self, table: str, reqs: list, dsts: list[np.ndarray] | None = None,
                  map_into: "_C.MappedRegion | None" = None) -> list[np.ndarray]:
        out = dsts if dsts is not None else [np.empty(r.nbytes, dtype=np.uint8) for r in reqs]
        plain, grouped = [], []
        for i, r in enumerate(reqs):
            if isinstance(r, RunIds):
                r.fill(out[i])   # a row run's ids: nothing to read
            elif isinstance(r, GroupedRead):
                grouped.append(i)
            else:
                plain.append(i)
        if plain:
            self._read_plain(table, [reqs[i] for i in plain], [out[i] for i in plain], map_into)
        if grouped:
            self._read_grouped(table, [reqs[i] for i in grouped], [out[i] for i in grouped])
        return out

    def _engine_read(self, grouped: bool, engine_reqs: list[tuple],
                     map_into: "_C.MappedRegion | None" = None) -> tuple[int, list]:
        """One engine call, with this reader's threads and options: `read_strided` of column groups
        (`grouped`) or `read_ranges` of plain ranges. (bytes read, errors)."""
        if grouped:
            return _C.read_strided(engine_reqs, self.threads, readahead_bytes=self.options.readahead_bytes,
                                   direct=self.options.strided_direct)
        return _C.read_ranges(engine_reqs, self.threads, readahead_bytes=self.options.readahead_bytes,
                              map_into=map_into, direct=self.options.engine_direct)

    def _engine_done(self, table: str, reqs: list, nread: int, errors: list) -> None:
        """Count an engine call's bytes and raise its first error, naming file, table and column."""
        self.bytes_read += nread
        if errors:
            raise self.read_error(table, reqs[errors[0][0]], errors[0][1])

    def _read_grouped(self, table: str, reqs: list["GroupedRead"], out: list[np.ndarray]) -> None:
        """Column groups into row-major rows: by the engine's strided reads (every chunk verified before a
        byte of it is placed), or through the store as plain reads of each column, placed here."""
        engine_reqs = self._local_requests(reqs, out)
        if engine_reqs is not None:
            self._engine_done(table, reqs, *self._engine_read(True, engine_reqs))
            return
        cols = [r.column_reads() for r in reqs]
        raws = iter(self._read_plain(table, [c for cs in cols for c in cs], None, None))
        for r, cs, dst in zip(reqs, cols, out):
            r.place([next(raws) for _ in cs], dst)

    def _read_plain(self, table: str, reqs: list[ReadRequest], dsts: list[np.ndarray] | None,
                    map_into: "_C.MappedRegion | None") -> list[np.ndarray]:
        out = dsts if dsts is not None else [np.empty(r.nbytes, dtype=np.uint8) for r in reqs]
        engine_reqs = self._local_requests(reqs, out)
        if engine_reqs is not None:
            self._engine_done(table, reqs, *self._engine_read(False, engine_reqs, map_into))
            return out
        # Through the store: every range (and padding) the requests need, exactly, in one concurrent call.
        ranges, spans = [], []
        for r in reqs:
            fi, c, lo, hi, step, pad = r.file, r.column, r.lo, r.hi, r.checksum_step, r.pad
            k0, k1 = lo // step, -(-hi // step) if hi > lo else lo // step
            start, end = k0 * step, min(k1 * step, c.length)
            check_pad = bool(pad and lo == 0 and hi > 0)
            if check_pad:
                ranges.append((self._path(fi), c.offset - pad, c.offset))
            ranges.append((self._path(fi), c.offset + start, c.offset + end))
            spans.append((check_pad, k0, k1, start, end))
        datas = iter(self.storage.read_ranges(ranges))
        for r, (check_pad, k0, k1, start, end), dst in zip(reqs, spans, out):
            fi, c, lo, hi, what, step = r.file, r.column, r.lo, r.hi, r.what, r.checksum_step
            where = self.storage.describe(self._path(fi))
            if check_pad and any(next(datas)):
                raise CorruptCheckpointError(f"{where}: table {table!r}, {what}: non-zero byte in the padding "
                                             f"before the column", where, table=table)
            data = next(datas)
            self.bytes_read += len(data)
            arr = np.frombuffer(data, dtype=np.uint8)
            if len(arr) != end - start:
                raise CorruptCheckpointError(f"{where}: table {table!r}, {what}: short read", where, table=table)
            crcs = _C.crc32c_chunks(arr, step)
            bad = np.nonzero(crcs != np.asarray(c.crc32c[k0:k1], dtype=np.uint32))[0]
            if bad.size:
                raise CorruptCheckpointError(f"{where}: table {table!r}, {what}: crc32c mismatch in chunk "
                                             f"{k0 + int(bad[0])}", where, table=table)
            dst[:] = arr[lo - start:hi - start]
        return out

    def prefetch(self, jobs: list[tuple[str, list[str], list[int]]], bucket_lo: int = 0,
                 bucket_hi: int | None = None) -> int:
        """Read ahead, verified, what reads of buckets [lo, hi) of each of `jobs` ((table, slots, row bytes))
        will ask for: their bucket directories in one parallel engine call, then their rows in one more,
        instead of two calls per table (each starts threads and opens files: for a thousand tables of
        a few hundred rows that was most of a load). Later `read`s of the same ranges take the bytes
        from here. Meant for small tables (the bytes are held until read). Anything that fails here is
        left to the table's own reads, which report it; returns the bytes read ahead."""
        self._prefetched.clear()
        hi_b = self.index.num_buckets if bucket_hi is None else bucket_hi
        try:
            segs = [(t, seg) for t, _, _ in jobs for seg in self.index.tables[t][1]]
            need = [(t, seg) for t, seg in segs if (t, seg.file, seg.buckets.offset) not in self._offsets
                    and self.dir_use(seg, bucket_lo, hi_b) == "read"]
            reqs = [self._dir_request(seg) for _, seg in need]
            for (t, seg), raw in zip(need, self.read(jobs[0][0], reqs) if reqs else []):
                d = BucketDir.from_bytes(raw, seg, self.index.num_buckets)
                if d is not None:   # the table's own read reports a bad directory
                    self._keep_dir(t, seg, d)
            reqs = []
            for t, slots, row_bytes in jobs:
                for seg, r0, r1 in self.iter_row_ranges(t, self.index.tables[t][1], bucket_lo, hi_b):
                    reqs += self.row_requests(t, seg, r0, r1, slots, row_bytes)
            datas = self.read(jobs[0][0], reqs) if reqs else []
        except (CorruptCheckpointError, OSError, KeyError, ValueError):
            self._prefetched.clear()
            return 0
        self._prefetched = {r.key(): d for r, d in zip(reqs, datas)}
        return sum(d.nbytes for d in datas)

    def _take_prefetched(self, reqs: list[ReadRequest], dsts: list[np.ndarray] | None):
        """(requests still to read, their destinations, the output with None where still to read)."""
        rest, rest_dst, out = [], [] if dsts is not None else None, []
        for i, r in enumerate(reqs):
            got = self._prefetched.pop(r.key(), None)
            if got is None:
                rest.append(r)
                if dsts is not None:
                    rest_dst.append(dsts[i])
                out.append(dsts[i] if dsts is not None else None)
            elif dsts is not None:
                dsts[i][:] = got
                out.append(dsts[i])
            else:
                out.append(got)
        return rest, rest_dst, out

    def bucket_offsets(self, table: str, seg: Segment) -> "BucketDir":
        return self.all_bucket_offsets(table, [seg])[0]

    def iter_bucket_offsets(self, table: str, segs: list[Segment], group_bytes: int = 8 << 20
                            ) -> Iterator[tuple[Segment, "BucketDir"]]:
        """(segment, verified bucket directory) for each segment, about `group_bytes` of them per parallel
        call: on a cold disk one small synchronous read per segment would each wait out the device's
        latency, and all at once would hold every segment's directory of a table of any size."""
        k = 0
        while k < len(segs):
            part, nbytes = [], 0
            while k < len(segs) and (not part or nbytes + segs[k].buckets.length <= group_bytes):
                part.append(segs[k])
                nbytes += segs[k].buckets.length
                k += 1
            have = [self._offsets.get((table, seg.file, seg.buckets.offset)) for seg in part]
            missing = [seg for seg, off in zip(part, have) if off is None]
            read = iter(self.all_bucket_offsets(table, missing) if missing else [])
            for seg, off in zip(part, have):
                if off is None:
                    off = next(read)
                    self._keep_dir(table, seg, off)
                yield seg, off

    def iter_row_ranges(self, table: str, segs: list[Segment], bucket_lo: int, bucket_hi: int
                        ) -> Iterator[tuple[Segment, int, int]]:
        """(segment, r0, r1): the rows [r0, r1) of each segment that fall in buckets [lo, hi), for the
        segments holding any (r1 > r0). A load of every bucket reads (and verifies) each directory too,
        so that no byte goes unchecked; a partial load skips, by the buckets the index records for each
        segment (format version 4), the segments outside its range and the directories of those wholly
        inside it, and reads the directories of the others (docs/FORMAT.md, what a loading rank reads)."""
        todo, whole, runs = [], {}, {}
        for seg in segs:
            how = self.dir_use(seg, bucket_lo, bucket_hi)
            if how == "whole":
                whole[id(seg)] = True
            elif how == "read":
                todo.append(seg)
            elif how == "run":   # format version 5: the rows of a row run follow from its ids, nothing is read
                runs[id(seg)] = self.run_dir(table, seg)
        dirs = {id(seg): off for seg, off in self.iter_bucket_offsets(table, todo)}
        dirs.update(runs)
        for seg in segs:
            if id(seg) in whole:
                yield seg, 0, seg.rows
                continue
            off = dirs.get(id(seg))
            if off is None:
                continue
            r0, r1 = (0, seg.rows) if (bucket_lo, bucket_hi) == (0, self.index.num_buckets) else (
                off[bucket_lo], off[bucket_hi])
            if r1 > r0:
                yield seg, r0, r1

    def dir_use(self, seg: Segment, bucket_lo: int, bucket_hi: int) -> str:
        """What a read of buckets [lo, hi) does with the segment's directory: "read" it (a full read checks
        every directory), "skip" the segment (no rows in the range) or take it "whole" (version 4: its
        recorded buckets lie inside the range)."""
        full = (bucket_lo, bucket_hi) == (0, self.index.num_buckets)
        if not full and (seg.last < bucket_lo or seg.first >= bucket_hi):
            return "skip"
        if seg.is_run:   # format version 5: no directory; its rows in the range follow from [id0, id0 + rows)
            return "whole" if full or bucket_lo <= seg.first and seg.last < bucket_hi else "run"
        if full:
            return "read"
        if seg.dir_entries and bucket_lo <= seg.first and seg.last < bucket_hi:
            return "whole"
        return "read"

    def run_dir(self, table: str, seg: Segment) -> "RunDir":
        """The bucket directory a row run implies (format version 5)."""
        return RunDir(seg.id0, seg.rows, self.index.geometry_of(table).num_rows, self.index.num_buckets)

    @staticmethod
    def _dir_request(seg: Segment) -> ReadRequest:
        return ReadRequest(seg.file, seg.buckets, 0, seg.buckets.length, "bucket offsets", max(seg.buckets.length, 1))

    def _dir_of(self, table: str, seg: Segment, raw: np.ndarray) -> "BucketDir":
        """The directory of `seg` from its verified bytes; CorruptCheckpointError if it is not valid."""
        d = BucketDir.from_bytes(raw, seg, self.index.num_buckets)
        if d is None:
            raise CorruptCheckpointError(f"{self.storage.describe(self._path(seg.file))}: table {table!r}: "
                                         f"bucket offsets are not a valid partition of {seg.rows} rows",
                                         self.storage.describe(self._path(seg.file)), table=table)
        return d

    def _keep_dir(self, table: str, seg: Segment, d: "BucketDir") -> None:
        if self._offsets_bytes + d.nbytes <= OFFSETS_CACHE_BYTES:
            self._offsets[(table, seg.file, seg.buckets.offset)] = d
            self._offsets_bytes += d.nbytes

    def all_bucket_offsets(self, table: str, segs: list[Segment]) -> list["BucketDir | RunDir"]:
        """The verified bucket directory of each of `segs` (format version 4, or versions 1-3's offsets
        block as a directory), read in one parallel call; a row run's is computed (`run_dir`)."""
        stored = [seg for seg in segs if not seg.is_run]
        raws = iter(self.read(table, [self._dir_request(seg) for seg in stored]))
        return [self.run_dir(table, seg) if seg.is_run else self._dir_of(table, seg, next(raws)) for seg in segs]

    def dir_requests(self, table: str, segs: list[Segment], bucket_lo: int, bucket_hi: int
                     ) -> tuple[list[Segment], list[ReadRequest]]:
        """The segments of `segs` whose directories a read of buckets [lo, hi) needs and this reader has
        not kept, and the requests that read them: a caller reading many readers at once reads these,
        then gives the bytes to `keep_dirs`. (A row run has no directory to read: `dir_use`.)"""
        need = [seg for seg in segs if self.dir_use(seg, bucket_lo, bucket_hi) == "read"
                and (table, seg.file, seg.buckets.offset) not in self._offsets]
        return need, [self._dir_request(seg) for seg in need]

    def keep_dirs(self, table: str, segs: list[Segment], raws: list[np.ndarray]) -> None:
        """Check the directories of `segs` read as `dir_requests` asked (CorruptCheckpointError naming the
        file if one is not valid) and keep them for this reader's later reads (up to
        OFFSETS_CACHE_BYTES; any left out are read again when needed)."""
        for seg, raw, d in zip(segs, raws, BucketDir.all_from_bytes(raws, segs, self.index.num_buckets)):
            self._keep_dir(table, seg, d if d is not None else self._dir_of(table, seg, raw))

    def row_requests(self, table: str, seg: Segment, r0: int, r1: int, slots: list[str], row_bytes: list[int],
                     columns: tuple[int, int] | None = None) -> list:
        """`read` requests for rows [r0, r1) of a segment: its ids (`RunIds` for a row run), then each slot in
        `slots` (`row_bytes[k]` bytes a row as delivered): one `ReadRequest` of a slot stored in one column
        and read whole in width, else a `GroupedRead` of its column groups (format version 5). `columns`:
        of the split slots, only the columns [a, b) of their last dim (each read delivers the columns the
        segment's block holds of them); slot columns come with their alignment padding."""
        ver = self.index.format_version
        geo = self.index.geometry_of(table)
        ids = seg.columns[0]
        out: list = [RunIds(seg.file, seg.id0 + r0, r1 - r0) if seg.is_run
                     else ReadRequest(seg.file, ids, 8 * r0, 8 * r1, "ids", ids.step)]
        for s, rb in zip(slots, row_bytes):
            place = geo.place(s, seg.block)
            if place.count == 1 and (place.ranges is None or columns is None):   # one column, read whole in width
                col = seg.columns[place.first]
                out.append(ReadRequest(seg.file, col, rb * r0, rb * r1, f"slot {s!r}", col.step,
                                       seg.pad_before(place.first, ver)))
                continue
            # a split slot in several column groups, or a window of its columns
            pieces = place.pieces(columns)
            if place.row_bytes(columns) != rb or not pieces:
                raise ValueError(f"table {table!r}, slot {s!r}: {rb} bytes a row asked; column block {seg.block} "
                                 f"holds {place.row_bytes(columns)} of columns {columns} ({place.span} stored)")
            col = seg.columns[pieces[0].column]
            if len(pieces) == 1 and pieces[0].src == 0 and pieces[0].nbytes == col.length // max(seg.rows, 1):
                out.append(ReadRequest(seg.file, col, rb * r0, rb * r1, f"slot {s!r}", col.step,
                                       seg.pad_before(pieces[0].column, ver)))   # exactly one whole group
                continue
            widths = place.widths()
            out.append(GroupedRead(
                seg.file, tuple(seg.columns[p.column] for p in pieces),
                tuple((widths[p.column - place.first], p.src, p.nbytes, p.dst) for p in pieces),
                tuple(seg.pad_before(p.column, ver) for p in pieces), r0, r1, rb, f"slot {s!r}"))
        return out

    def table_segments(self, table: str, block: int | None = None, ids_only: bool = False
                       ) -> tuple[list[str], list[Segment]]:
        """(slots, segments) of `table`; of a column-split table (docs/FORMAT.md, Column blocks) only the
        segments of column block `block`, whose split slots hold that block's columns (the caller gives
        their row bytes). A reader that does not name a block cannot read such a table as whole rows:
        `column_join` joins its blocks. A read of ids alone (`ids_only`) takes block 0's: every block
        holds every id."""
        all_slots, segs = self.index.tables[table]
        if self.index.geometry_of(table).runs:
            # A row_range table (format version 5) read in id order: a writer's segments are listed file by
            # file, so a full save's runs come back [0, a), [c, N), [a, b), ...; in bucket order, a fold
            # (compaction) hands the writer ids in order again, which it stores as row runs.
            segs = sorted(segs, key=_bucket_order)
        if table in self.index.blocked:
            if block is None and ids_only:
                block = 0   # every block holds every id: block 0's are the table's
            if block is None:
                raise IncompatibleCheckpointError(
                    f"{self.storage.describe(self.ckpt_dir)}: table {table!r} was saved column-split (column "
                    f"blocks, e.g. by a column-wise TorchRec plan); this kind of read does not join column "
                    f"blocks: load it into a model's table (TorchRec or HashTable), or read it with recckpt.open "
                    f"/ recckpt export", table=table)
            segs = [sg for sg in segs if sg.block == block]
        elif block not in (None, 0):
            raise ValueError(f"table {table!r} has no column block {block}")
        return all_slots, segs

    def batches(self, table: str, slots: list[str], row_bytes: list[int],
                bucket_lo: int = 0, bucket_hi: int | None = None, block: int | None = None,
                batch_bytes: float | None = None, columns: tuple[int, int] | None = None,
                dirs_with_rows: bool = False) -> Iterator["ReadBatch"]:
        """Plan the reads of buckets [lo, hi) of `table` in batches of about `batch_bytes` (default
        `options.batch_bytes`; `math.inf`: one batch): each batch is one or more segments' row ranges,
        read together so the engine's threads share the work. `block`: of a column-split table, the
        column block read (see `table_segments`). `columns`: of a table with column groups, read only the
        columns [a, b) of its split slots that the block holds (`row_bytes` for those slots: that width;
        format/geometry.py). `dirs_with_rows`: for a caller that reads every batch with `read_batch`, a
        read of every bucket (which takes each segment whole, whatever its directory says) reads and
        checks the directories in the same engine call as the rows, not in one call before them, when the
        table's rows fit in one batch."""
        _, segs = self.table_segments(table, block, ids_only=not slots)
        hi_b = self.index.num_buckets if bucket_hi is None else bucket_hi
        limit = self.options.batch_bytes if batch_bytes is None else batch_bytes
        batch = ReadBatch(table, row_bytes)
        if dirs_with_rows and (bucket_lo, hi_b) == (0, self.index.num_buckets):
            # Only where the whole table is one batch: every directory is then checked before any of its
            # rows is handed out, as when the directories are read first (a bad directory in a later
            # batch would otherwise be found after earlier batches were applied).
            if sum(seg.rows for seg in segs) * (8 + sum(row_bytes)) <= limit:   # (the rows' bytes, as asked)
                need, dir_reqs = self.dir_requests(table, segs, bucket_lo, hi_b)
                batch.dirs = list(zip(need, dir_reqs))
                for seg in segs:
                    if seg.rows > 0:
                        batch.add(seg.rows, self.row_requests(table, seg, 0, seg.rows, slots, row_bytes, columns))
                if batch.rows:
                    yield batch
                elif need:   # no rows to read them with (segments of no rows): checked alone
                    self.keep_dirs(table, need, self.read(table, dir_reqs))
                return
        for seg, r0, r1 in self.iter_row_ranges(table, segs, bucket_lo, hi_b):
            batch.add(r1 - r0, self.row_requests(table, seg, r0, r1, slots, row_bytes, columns))
            if batch.nbytes >= limit:
                yield batch
                batch = ReadBatch(table, row_bytes)
        if batch.rows:
            yield batch

    def removed_ids(self, table: str, bucket_lo: int = 0, bucket_hi: int | None = None, *,
                    with_file: bool = False):
        """The verified ids an incremental checkpoint records as removed from `table`, in buckets
        [lo, hi) (int64, a new array). with_file=True returns (ids, the shard file index of each id)."""
        batch = self.removed_batch(table, bucket_lo, bucket_hi)
        ids = self.read_batch(batch, [np.empty(8 * batch.rows, dtype=np.uint8)])[0].view("<i8")
        if with_file:
            return ids, batch.row_files()
        return ids

    def removed_batch(self, table: str, bucket_lo: int = 0, bucket_hi: int | None = None) -> "ReadBatch":
        """The reads of the ids removed from `table` in buckets [lo, hi) (an incremental checkpoint's
        removed segments), as one batch of ids only."""
        hi_b = self.index.num_buckets if bucket_hi is None else bucket_hi
        batch = ReadBatch(table, [])
        for seg, r0, r1 in self.iter_row_ranges(table, self.index.removed.get(table, []), bucket_lo, hi_b):
            batch.add(r1 - r0, [ReadRequest(seg.file, seg.columns[0], 8 * r0, 8 * r1, "removed ids",
                                            seg.columns[0].step)])
        return batch

    def map_table(self, table: str, slots: list[str], row_bytes: list[int], bucket_lo: int = 0,
                  bucket_hi: int | None = None, spare_rows: int = 0) -> "MappedTable":
        """Rows of buckets [lo, hi) of `table` for a mapped load: the ids read into a new array, and
        each slot's rows placed in one `MappedRegion`. A segment whose rows all fall in the range has
        its slot columns mapped copy-on-write from the shard file wherever the layout allows (format
        version 2 aligns them); every other row is read into the region. All of it is verified. The
        storage has room for `spare_rows` more rows. Needs local storage."""
        if self.storage.engine_path(self.ckpt_dir) is None:
            raise ValueError(f"{self.storage.describe(self.ckpt_dir)}: mapped loads need a local filesystem")
        _, segs = self.table_segments(table)
        hi_b = self.index.num_buckets if bucket_hi is None else bucket_hi
        parts = list(self.iter_row_ranges(table, segs, bucket_lo, hi_b))
        # Whole segments of whole granules first: each then starts on the page offset of its file column.
        g = layout.row_granule(row_bytes)
        parts.sort(key=lambda p: not (p[1] == 0 and p[2] == p[0].rows and p[0].rows % g == 0))
        rows = sum(r1 - r0 for _, r0, r1 in parts)
        cap = rows + spare_rows
        page = _C.MappedRegion.page_size
        starts, size = [], 0
        for rb in row_bytes:  # one region, each slot's storage starting on a page
            starts.append(size)
            size += -(-cap * rb // page) * page
        region = _C.MappedRegion(size)
        whole = np.frombuffer(region, dtype=np.uint8)
        ids = np.empty(cap, dtype="<i8")
        ids_bytes = ids.view(np.uint8)
        reqs, dsts, pos = [], [], 0
        for seg, r0, r1 in parts:
            n = r1 - r0
            reqs += self.row_requests(table, seg, r0, r1, slots, row_bytes)
            dsts.append(ids_bytes[8 * pos:8 * (pos + n)])
            dsts += [whole[st + rb * pos:st + rb * (pos + n)] for rb, st in zip(row_bytes, starts)]
            pos += n
        if reqs:
            self.read(table, reqs, dsts, map_into=region)
        cols = {s: whole[st:st + cap * rb] for s, rb, st in zip(slots, row_bytes, starts)}
        return MappedTable(rows, ids, cols, region.bytes_mapped)

    def read_batch(self, batch: "ReadBatch", dst: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Read and verify one batch. `dst`: one writable, C-contiguous buffer per column (ids, then the
        slots), `rows * row_bytes` bytes each, filled in segment order; None reads into the reused
        scratch buffer. Returns the per-column uint8 arrays (`dst` viewed as bytes, or scratch views
        valid until the next read)."""
        widths = [8] + list(batch.row_bytes)
        if dst is None:
            out = self._scratch_views([batch.rows * w for w in widths])
        else:
            if len(dst) != len(widths):
                raise ValueError(f"table {batch.table!r}: read_batch got {len(dst)} destinations for "
                                 f"{len(widths)} columns")
            out = []
            for d, w in zip(dst, widths):
                flat = np.frombuffer(d, dtype=np.uint8) if not isinstance(d, np.ndarray) else d.reshape(-1).view(np.uint8)
                if flat.size != batch.rows * w:
                    raise ValueError(f"table {batch.table!r}: read_batch destination of {flat.size} bytes for "
                                     f"{batch.rows} rows of {w} bytes")
                out.append(flat)
        flat_reqs, flat_dst = batch.layout(out)
        if batch.dirs:   # read first in the call, so that a bad directory is what a failure names first
            raws = [np.empty(r.nbytes, dtype=np.uint8) for _, r in batch.dirs]
            flat_reqs, flat_dst = [r for _, r in batch.dirs] + flat_reqs, raws + flat_dst
        if flat_reqs:
            self.read(batch.table, flat_reqs, dsts=flat_dst)
        if batch.dirs:
            self.keep_dirs(batch.table, [seg for seg, _ in batch.dirs], raws)
        return out

    def iter_table(self, table: str, slots: list[str], row_bytes: list[int],
                   bucket_lo: int = 0, bucket_hi: int | None = None, *, with_file: bool = False,
                   block: int | None = None, columns: tuple[int, int] | None = None) -> Iterator[tuple]:
        """Yield (ids, [uint8[n, row_bytes] per requested slot]) per segment, for buckets [lo, hi);
        with_file=True adds a third element, the segment's position in `index.files`. Segments are
        read in batches; the arrays are views of a reused buffer: consume (copy) them before the next.
        `block`, `columns`: as `batches`."""
        for batch in self.batches(table, slots, row_bytes, bucket_lo, bucket_hi, block, columns=columns,
                                  dirs_with_rows=True):
            for ids, parts, reqs in batch.split(self.read_batch(batch)):
                yield (ids, parts, reqs[0].file) if with_file else (ids, parts)


@dataclass
class MappedTable:
    """What `SegmentReader.map_table` read: `rows` rows of ids (int64[capacity]) and, per slot, the
    uint8 storage of `capacity` rows, views of one `MappedRegion` that lives as long as any of them."""
    rows: int
    ids: np.ndarray
    columns: dict[str, np.ndarray]
    bytes_mapped: int


def _bucket_order(seg: Segment) -> tuple[int, int, int]:
    return seg.block, seg.first, seg.id0


class ReadBatch:
    """Row ranges of one or more segments of a table, read together by `SegmentReader.read_batch`."""

    def __init__(self, table: str, row_bytes: list[int]):
        self.table, self.row_bytes = table, list(row_bytes)
        self.parts: list[tuple[int, list[ReadRequest]]] = []  # (rows, [request per column])
        # directories read and checked with the rows (`SegmentReader.batches(dirs_with_rows=True)`): only
        # `read_batch` reads them, so only its callers ask for them
        self.dirs: list[tuple[Segment, ReadRequest]] = []
        self.rows = 0
        self.nbytes = 0

    def add(self, rows: int, reqs: list[ReadRequest]) -> None:
        self.parts.append((rows, reqs))
        self.rows += rows
        self.nbytes += sum(r.nbytes for r in reqs)

    def layout(self, cols: list[np.ndarray]) -> tuple[list[ReadRequest], list[np.ndarray]]:
        """Every request of the batch and where its bytes go in `cols` (one flat uint8 buffer per column,
        ids first, `rows * width` bytes each), the parts' rows one after another."""
        widths = [8] + self.row_bytes
        reqs, dsts = [], []
        pos = [0] * len(widths)
        for n, rs in self.parts:
            for c, r in enumerate(rs):
                nb = n * widths[c]
                reqs.append(r)
                dsts.append(cols[c][pos[c]:pos[c] + nb])
                pos[c] += nb
        return reqs, dsts

    def row_files(self) -> np.ndarray:
        """The shard file (its position in the index's `files`) of each row of the batch."""
        if not self.parts:
            return np.empty(0, dtype=np.int64)
        return np.repeat(np.array([rs[0].file for _, rs in self.parts], dtype=np.int64),
                         np.array([n for n, _ in self.parts], dtype=np.int64))

    def split(self, cols: list) -> Iterator[tuple]:
        """`cols` (what `read_batch` read: ids, then one byte array per slot) cut back into its parts:
        (ids, [uint8[n, row_bytes] per slot], the part's requests) per part, as views of `cols`."""
        pos = 0
        for n, reqs in self.parts:
            ids = cols[0][8 * pos:8 * (pos + n)].view("<i8")
            slots = [c[rb * pos:rb * (pos + n)].reshape(n, rb) for c, rb in zip(cols[1:], self.row_bytes)]
            pos += n
            yield ids, slots, reqs
