"""`recckpt.verify(path)` (defined here): check every byte of one checkpoint without loading it into a model.

Reads the manifest, every file it lists (size and CRC), the merged and per-worker indexes (schema, and
that the merged index is exactly the merge of the workers'), the dense/extras/IO-state files (header
and state tree, never unpickling), and every shard file: size, that its segments tile it with no gap or
overlap, every chunk checksum of every column, that each segment's bucket offsets partition its rows
and that every id sits in the bucket its hash says. Memory stays bounded (columns are read in windows).
An incremental checkpoint is checked with its whole chain: every link back to the full base must exist,
be committed and have the manifest hash its child recorded, and every link's files are checked the same
way, each problem naming the link's file.

    python -m recckpt.format.verifier <checkpoint dir>   # exit status 0 when the checkpoint is intact
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _C
from ..errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from ..storage import Storage, open_storage
from . import catalog, extras as extras_fmt, gcpause, names, safetensors_io, structure
from .bucket_dirs import BucketDir
from .chain import split_path, table_links, walk_chain
from .checkpoint import CheckpointReader, parse_index_bytes
from .index_parse import index_from_json
from .schema import IndexDoc
from .segment_groups import check_dirs
from .sparse_io import ReadRequest, SegmentReader

_WINDOW = 64 << 20  # bytes of one column read at a time
_GROUP_BYTES = 16 << 20  # bytes of small segments checked in one parallel read
_SAME_AS_MERGED = IndexDoc(0, 0)   # a worker index whose bytes are the merged index's (one worker)


#: Per-group masks for the hash check of `_repeated`: id ^ mask is one-to-one within a group, so an id
#: repeated in a group always repeats its key (keys equal across groups are sorted out exactly).
_GROUP_MASK = np.int64(-7046029254386353131)   # 0x9E3779B97F4A7C15 as int64


def _repeated(ids: np.ndarray, group: np.ndarray) -> np.ndarray:
    """True at each row whose id another row of the same `group` (a segment) also holds. A hash set of
    the keys says first whether any key repeats (about a tenth of a sort's time); only then are the rows
    sorted to find which."""
    if len(ids) < 2:
        return np.zeros(len(ids), dtype=bool)
    keys = ids ^ (group.astype(np.int64) * _GROUP_MASK)
    if _C.IdMap(len(keys)).insert_new(keys) == len(keys):
        return np.zeros(len(ids), dtype=bool)
    order = np.lexsort((ids, group))
    same = (ids[order][1:] == ids[order][:-1]) & (group[order][1:] == group[order][:-1])
    out = np.zeros(len(ids), dtype=bool)
    out[order[1:][same]] = True
    out[order[:-1][same]] = True
    return out


@dataclass(frozen=True)
class _Seg:
    """A segment to check: its table, whether its rows count as the table's."""
    table: str
    seg: object
    counted: bool


@dataclass
class VerifyReport:
    """What `verify` found. `ok` is True exactly when `problems` is empty."""
    path: str
    ckpt_id: str | None = None
    problems: list[str] = field(default_factory=list)
    """One line per defect, each naming the file (and table) concerned."""
    unlisted: list[str] = field(default_factory=list)
    """Files inside the checkpoint that its manifest and index do not mention (ignored by loads); those
    of an older link of a chain as `<link id>/<path>`."""
    files_checked: int = 0
    bytes_checked: int = 0
    tables: dict[str, int] = field(default_factory=dict)
    """Table name -> rows verified (summed over the links of a chain)."""
    links: list[str] = field(default_factory=list)
    """The checkpoint ids checked, base first: the whole chain of an incremental checkpoint."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            raise CorruptCheckpointError(f"{self.problems[0]}{more}", self.path)

    def __str__(self) -> str:
        chain = f" (a chain of {len(self.links)} links, base {self.links[0]})" if len(self.links) > 1 else ""
        head = (f"{self.path}{chain}: {'OK' if self.ok else 'CORRUPT'}: {self.files_checked} files, "
                f"{self.bytes_checked} bytes, {sum(self.tables.values())} rows in {len(self.tables)} tables "
                f"checked in {self.seconds:.2f}s")
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  unlisted: {u}" for u in self.unlisted]
        return "\n".join(lines)


def verify(path: str, *, threads: int = 4, storage_options: dict | None = None) -> VerifyReport:
    """Check the committed checkpoint directory `path` (a local path or fsspec URL) completely.

    Returns a report; raises CheckpointNotFoundError only when `path` has no manifest.json at all.
    `report.raise_if_failed()` turns a failed report into a CorruptCheckpointError. `storage_options`
    go to fsspec for a URL (endpoint, credentials)."""
    with gcpause.paused():   # a thousand tables' metadata: see recckpt.format.gcpause
        return _verify(path, threads, storage_options)


def _verify(path: str, threads: int, storage_options: dict | None) -> VerifyReport:
    t0 = time.perf_counter()
    storage = open_storage(path, storage_options)
    report = VerifyReport(storage.describe())
    if not storage.exists(names.MANIFEST):
        raise CheckpointNotFoundError(catalog.not_a_checkpoint(storage), path=storage.describe())
    with catalog.deleted_as_such([(storage, "")], "verified"):
        m = _check_one(storage, report, threads)
        if m is not None:
            report.ckpt_id = m.ckpt_id
            report.links = [m.ckpt_id]
            if m.parent is not None:
                _check_chain(path, report, threads, storage_options)
    if report.problems and not storage.exists(names.MANIFEST):
        # its files went missing because the checkpoint was deleted, not corrupted
        raise CheckpointDeletedError(
            f"checkpoint {storage.describe()} was deleted while it was being verified (by retention in another "
            f"process, or by hand): {report.problems[0]}. Verify the newest checkpoint instead.",
            path=storage.describe())
    report.seconds = time.perf_counter() - t0
    return report


def _check_one(storage: Storage, report: VerifyReport, threads: int):
    """Check the checkpoint at the root of `storage` into `report`; its manifest, or None if unreadable."""
    try:
        reader = CheckpointReader(storage, "", threads=threads)
    except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
        report.problems.append(str(e))
        return None
    report.files_checked += 1
    report.bytes_checked += storage.size(names.MANIFEST)
    _Checker(storage, reader, report).run()
    return reader.manifest


def _check_chain(path: str, report: VerifyReport, threads: int, storage_options: dict | None) -> None:
    """The older links of the incremental checkpoint at `path` (already checked itself): that the chain
    is whole and unaltered (chain.walk_chain, the rule loads apply), then each link's every byte."""
    root, ckpt_dir = split_path(path)
    out = open_storage(root, storage_options)
    try:
        links = walk_chain(CheckpointReader(out, ckpt_dir, threads=threads))
    except (CorruptCheckpointError, IncompatibleCheckpointError, FileNotFoundError) as e:
        report.problems.append(str(e))
        return
    for link in links[:-1]:
        sub = VerifyReport(link.describe())
        _check_one(open_storage(f"{root.rstrip('/')}/{link.ckpt_dir}", storage_options), sub, threads)
        report.problems += sub.problems                                   # each names its file in full
        report.unlisted += [f"{link.ckpt_dir}/{u}" for u in sub.unlisted]  # relative to the output dir
        report.files_checked += sub.files_checked
        report.bytes_checked += sub.bytes_checked
        for table, rows in sub.tables.items():
            report.tables[table] = report.tables.get(table, 0) + rows
    report.links = [link.manifest.ckpt_id for link in links]
    for table in links[-1].manifest.tables:   # each table's links, by the rule loads and readers apply
        try:
            table_links(links, table)
        except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
            report.problems.append(str(e))


class _Checker:
    def __init__(self, storage: Storage, reader: CheckpointReader, report: VerifyReport):
        self.storage, self.reader, self.report, self.m = storage, reader, report, reader.manifest

    def problem(self, e: Exception) -> None:
        self.report.problems.append(str(e))

    def run(self) -> None:
        worker_docs: dict[int, IndexDoc] = {}
        for rel, info in sorted(self.m.files.items()):
            try:
                if rel == self.m.index:   # read, checked and parsed once, by the reader (kept for the rest)
                    self.reader.parsed_index()   # fields, against the manifest
                    self.report.files_checked += 1
                    self.report.bytes_checked += info.size
                    continue
                data = self.reader.read_file(rel)
                self.report.files_checked += 1
                self.report.bytes_checked += len(data)
                self.check_file(rel, data, worker_docs)
            except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
                self.problem(e)
                worker = names.worker_index_worker(rel) if rel.startswith(f"{names.SPARSE_DIR}/worker-") else None
                if worker is not None:
                    worker_docs.setdefault(worker, None)   # recorded, and reported above: not also "missing"
        self.check_worker_indexes(worker_docs)
        if self.m.index is not None:
            self.check_shards()
        self.find_unlisted()

    def check_file(self, rel: str, data: bytes, worker_docs: dict[int, IndexDoc]) -> None:
        where = self.reader.describe(rel)
        if rel.startswith(f"{names.SPARSE_DIR}/worker-") and rel.endswith(".index.json"):
            worker = names.worker_index_worker(rel)
            if worker is None:
                raise CorruptCheckpointError(f"{where}: not a worker index name (expected "
                                             f"{names.worker_index(0)} and so on)", where)
            if self.reader.same_as_merged_index(data):
                # One worker: its index is byte for byte the merged one, which the reader parses and checks.
                worker_docs[worker] = _SAME_AS_MERGED
                return
            worker_docs[worker] = index_from_json(parse_index_bytes(data, where, self.m.format_version), where,
                                                  self.m, worker=True)
        elif rel == self.m.dense:
            safetensors_io.parse(data, where)   # the library's rules; tensors are not made (no torch)
        elif rel == self.m.extras:
            # pickled entries stay bytes: never unpickled; tensors as numpy arrays (no torch)
            extras_fmt.validate(self.reader.tree(rel, arrays=True), where)
        elif rel in self.m.io_state.values():
            self.reader.tree(rel, arrays=True)

    def check_worker_indexes(self, docs: dict[int, IndexDoc | None]) -> None:
        """`docs`: each worker index the manifest records, parsed (None: unreadable, reported already)."""
        if not self.m.tables:
            return
        where = self.reader.describe(names.SPARSE_DIR)
        if sorted(docs) != list(range(self.m.shard_num)):
            self.problem(CorruptCheckpointError(
                f"{where}: the manifest records worker indexes of workers {sorted(docs)}, not of workers "
                f"0..{self.m.shard_num - 1}", where))
            return
        if None in docs.values():
            return   # a worker index that could not be read: its own problem says why
        try:
            merged = self.reader.parsed_index()
        except (CorruptCheckpointError, IncompatibleCheckpointError):
            return  # already reported
        if all(d is _SAME_AS_MERGED for d in docs.values()):
            return
        try:
            again = IndexDoc.merge([docs[w] for w in range(self.m.shard_num)])
        except ValueError as e:
            self.problem(CorruptCheckpointError(f"{where}: worker indexes do not merge: {e}", where))
            return
        if again.to_json() != merged.to_json():
            idx = self.reader.describe(self.m.index)
            self.problem(CorruptCheckpointError(
                f"{idx}: the merged index differs from the merge of the worker indexes in {where}", idx))

    def check_shards(self) -> None:
        try:
            index = self.reader.parsed_index()
        except (CorruptCheckpointError, IncompatibleCheckpointError):
            return  # already reported
        seg_reader = SegmentReader(self.storage, "", index, self.reader.threads, self.reader.read_options)
        bad_files: set[int] = set()
        for fi in range(len(index.files)):
            try:
                seg_reader.check_size(fi)
            except CorruptCheckpointError as e:
                self.problem(e)
                bad_files.add(fi)
        self.check_tiling(index, bad_files)
        self.report.files_checked += len(index.files) - len(bad_files)
        # Every segment of every table, removed ids first (ids-only segments, checked like any, not counted).
        # Small segments are checked together, one parallel read per group (a model of a thousand small
        # tables is one pass, not a thousand); a large one alone, in windows.
        group: list[_Seg] = []
        nbytes = 0
        for table, (slots, segs) in index.tables.items():
            self.report.tables[table] = 0
            items = [_Seg(table, seg, False) for seg in index.removed.get(table, [])]
            items += [_Seg(table, seg, seg.block == 0) for seg in segs]   # column blocks repeat the rows
            for it in items:
                size = it.seg.buckets.length + sum(c.length for c in it.seg.columns)
                if size > _GROUP_BYTES:
                    self.check_alone(seg_reader, index, it, bad_files)
                    continue
                group.append(it)
                nbytes += size
                if nbytes >= _GROUP_BYTES:
                    self.check_group(seg_reader, index, group, bad_files)
                    group, nbytes = [], 0
        self.check_group(seg_reader, index, group, bad_files)
        self.report.bytes_checked += seg_reader.bytes_read

    def check_alone(self, seg_reader, index: IndexDoc, it: "_Seg", bad_files: set[int]) -> None:
        """One segment, every byte; a failure is reported and its file is not read further."""
        if it.seg.file in bad_files:
            return
        try:
            self.check_segment(seg_reader, index, it.table, it.seg)
        except CorruptCheckpointError as e:
            self.problem(e)
            bad_files.add(it.seg.file)
            return
        if it.counted:
            self.report.tables[it.table] += it.seg.rows

    def check_group(self, seg_reader, index: IndexDoc, group: list["_Seg"], bad_files: set[int]) -> None:
        """Small segments (of any tables) read in one call: directories and whole columns, checked at once.
        Whatever fails is checked again segment by segment (`check_alone`), which names the table and column."""
        group = [it for it in group if it.seg.file not in bad_files]
        if not group:
            return
        good = self.group_ok(seg_reader, index, group)
        for it, ok in zip(group, good):
            if not ok:
                self.check_alone(seg_reader, index, it, bad_files)
            elif it.counted:
                self.report.tables[it.table] += it.seg.rows

    def group_ok(self, seg_reader, index: IndexDoc, group: list["_Seg"]) -> list[bool]:
        """Whether each segment of `group` passes every check, from one read of all their blocks: the
        directories (`segment_groups.check_dirs`, the rule of BucketDir.from_bytes for all at once) and
        every id in the bucket its directory records (one bucket_of per bucket function of the group)."""
        ver, segs = index.format_version, [it.seg for it in group]
        dir_bytes = sum(seg.buckets.length for seg in segs)
        ids_bytes = sum(seg.columns[0].length for seg in segs)
        rest = sum(c.length for seg in segs for c in seg.columns[1:])
        buf = np.empty(dir_bytes + (-dir_bytes % 8) + ids_bytes + rest, dtype=np.uint8)
        reqs, dsts, dir_at = [], [], []
        pos, ids_pos = 0, dir_bytes + (-dir_bytes % 8)   # directories, then every ids column, then the rest
        rest_pos = ids_pos + ids_bytes
        for seg in segs:
            dir_at.append(pos)
            reqs.append(ReadRequest(seg.file, seg.buckets, 0, seg.buckets.length, "bucket offsets",
                                    max(seg.buckets.length, 1)))
            dsts.append(buf[pos:pos + seg.buckets.length])
            pos += seg.buckets.length
            for k, col in enumerate(seg.columns):
                reqs.append(ReadRequest(seg.file, col, 0, col.length, "ids" if k == 0 else f"column {k}",
                                        col.step or index.chunk_bytes, seg.pad_before(k, ver)))
                at = ids_pos if k == 0 else rest_pos
                dsts.append(buf[at:at + col.length])
                if k == 0:
                    ids_pos += col.length
                else:
                    rest_pos += col.length
        try:
            seg_reader.read(group[0].table, reqs, dsts)
        except CorruptCheckpointError:
            return [False] * len(group)
        # A row run (format version 5) stores no directory and no ids: its index entry, validated with the
        # index, says them, so it passes once its columns' CRCs have. The others' ids are checked here.
        stored = [i for i, seg in enumerate(segs) if not seg.is_run]
        out = [True] * len(group)
        for i, ok in zip(stored, self.stored_ids_ok(index, [group[i] for i in stored],
                                                     [dir_at[i] for i in stored], buf, dir_bytes, ids_bytes)):
            out[i] = ok
        return out

    def stored_ids_ok(self, index: IndexDoc, group: list["_Seg"], dir_at: list[int], buf: np.ndarray,
                      dir_bytes: int, ids_bytes: int) -> list[bool]:
        """`group_ok`'s check of segments storing their directories and ids (read into `buf`: directories at
        `dir_at`, then every ids column from the next multiple of 8 after `dir_bytes`, `ids_bytes` of them)."""
        segs = [it.seg for it in group]
        if not segs:
            return []
        ids_start = dir_bytes + (-dir_bytes % 8)
        dirs = check_dirs(buf, dir_at, segs, index.num_buckets)
        if dirs is None:   # a bad directory, or a version 1-3 offsets block: one segment at a time
            out, at = [], ids_start
            for it, seg, d0 in zip(group, segs, dir_at):
                off = BucketDir.from_bytes(buf[d0:d0 + seg.buckets.length], seg, index.num_buckets)
                ids = buf[at:at + seg.columns[0].length].view("<i8")
                at += seg.columns[0].length
                out.append(off is not None and self.ids_match(it.table, ids, off, 0, index))
            return out
        ids = buf[ids_start:ids_start + ids_bytes].view("<i8")
        got = np.empty(len(ids), dtype=np.int64)
        first = np.zeros(len(segs), dtype=np.int64)
        np.cumsum([seg.rows for seg in segs[:-1]], out=first[1:])
        fn = [tuple(sorted(self.m.tables[it.table].bucket_args().items())) for it in group]
        kinds = set(fn)
        for args in kinds:   # (nearly always one: recckpt's hash)
            rows = slice(None) if len(kinds) == 1 else np.concatenate(
                [np.arange(f, f + seg.rows) for f, seg, a in zip(first, segs, fn) if a == args])
            got[rows] = _C.bucket_of(np.ascontiguousarray(ids[rows]), index.num_buckets, **dict(args))
        wrong = np.add.reduceat((got != dirs.bucket_of_rows()).astype(np.int64), first)
        seg_of = np.repeat(np.arange(len(segs)), [seg.rows for seg in segs])
        for i in np.unique(seg_of[_repeated(ids, seg_of)]):
            wrong[i] += 1
        return (wrong == 0).tolist()

    def check_tiling(self, index: IndexDoc, bad_files: set[int]) -> None:
        # The loader's rule (structure.py), every finding reported; a file that fails it is not read. A
        # version 4 index that parsed has passed it: its parse checks that the segments tile every file.
        if index.format_version >= names.SEGMENT_DIR_SINCE:
            return
        for fi, e in sorted(structure.tiling_problems(index, self.storage.describe).items()):
            if fi not in bad_files:
                self.problem(e)
                bad_files.add(fi)

    def check_segment(self, seg_reader, index: IndexDoc, table: str, seg) -> None:
        off = seg_reader.bucket_offsets(table, seg)  # CRC + partition check (a row run's: its ids, by rule)
        geo = index.geometry_of(table) if table in index.tables else None
        ids_read = []   # (a segment's ids: bounded by the segment size the writer chose)
        for k, col in enumerate(seg.columns):
            what = geo.column_name(k, seg.block) if geo is not None else "ids" if k == 0 else f"column {k}"
            step = col.step or index.chunk_bytes
            window = max(step, _WINDOW // step * step)
            for lo in range(0, col.length, window):
                hi = min(col.length, lo + window)
                pad = seg.pad_before(k, index.format_version)
                (data,) = seg_reader.read(table, [ReadRequest(seg.file, col, lo, hi, what, step, pad)])
                if k == 0:
                    self.check_ids(table, seg, data.view("<i8"), off, lo // 8, index)
                    ids_read.append(np.array(data.view("<i8")))
        if len(ids_read) and not seg.is_run:
            ids = np.concatenate(ids_read)
            twice = _repeated(ids, np.zeros(len(ids), dtype=np.int64))
            if twice.any():
                where = self.storage.describe(index.files[seg.file][0])
                raise CorruptCheckpointError(f"{where}: table {table!r}: id {int(ids[twice][0])} is stored twice in "
                                             f"one segment (an id appears at most once in a checkpoint)", where,
                                             table=table)

    def ids_match(self, table, ids: np.ndarray, off, first_row: int, index: IndexDoc) -> bool:
        """Whether rows [first_row, first_row + len(ids)) sit in the buckets their ids map to (by the
        table's bucket function; a row_range id must also be a row of the table)."""
        info = self.m.tables[table]
        buckets = _C.bucket_of(ids, index.num_buckets, **info.bucket_args())
        rows = np.arange(first_row, first_row + len(ids))
        return bool(np.array_equal(buckets, off.bucket_of_rows(rows)))

    def check_ids(self, table, seg, ids: np.ndarray, off, first_row: int, index: IndexDoc) -> None:
        if not self.ids_match(table, ids, off, first_row, index):
            where = self.storage.describe(index.files[seg.file][0])
            raise CorruptCheckpointError(f"{where}: table {table!r}: ids are not in the buckets the index "
                                         f"records for them", where)

    def find_unlisted(self) -> None:
        listed = set(self.m.files) | {names.MANIFEST}
        try:
            listed |= {p for p, _ in self.reader.parsed_index().files}
        except (CorruptCheckpointError, IncompatibleCheckpointError):
            pass
        stack = [""]
        while stack:
            d = stack.pop()
            for name in self.storage.listdir(d):
                rel = f"{d}/{name}" if d else name
                if self.storage.is_link(rel):   # never followed: `a -> .` would never end
                    if rel not in listed:
                        self.report.unlisted.append(f"{rel} (a symbolic link, not followed)")
                elif self.storage.isdir(rel):
                    stack.append(rel)
                elif rel not in listed:
                    self.report.unlisted.append(rel)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m recckpt.format.verifier <checkpoint dir>", file=sys.stderr)
        return 2
    report = verify(args[0])
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
