"""`recckpt.open(path)`: a read-only view of one committed checkpoint that needs no model.

An incremental checkpoint is shown as the state it stands for: its whole chain (the full base and every
increment up to it) is opened and checked first, and its tables and rows are the folded state (newest
row wins, removed ids absent), as a load or `recckpt.compact` would give; its metadata still names its
parent.

Built on format.checkpoint.CheckpointReader, so every byte it hands out was checked against the size and
CRC-32C the checkpoint recorded (manifest files whole, shard columns chunk by chunk), and nothing is ever
unpickled: registered objects saved with `allow_pickle=True` are shown as their raw bytes.

    view = recckpt.open("/runs/a/ckpt_1000")
    view.step, view.workers, view.tables["user"].rows
    for ids, cols in view.iter_rows("user", slots=["embedding"], chunk_rows=65536):
        ...   # ids: int64[n]; cols["embedding"]: float32[n, dim]
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError
from ..format import catalog, dtypes
from ..format.chain import chain_of, split_path, table_links
from ..format.checkpoint import CheckpointReader
from ..format.column_join import FROM_OVERLAP, iter_joined, row_range_of_buckets
from ..format.digest import DenseDigest, TableDigest
from ..format.fold import bucket_groups, fold_rows, plan_fold
from ..format.hashing import bucket_range
from ..format.retention import META_EPHEMERAL, recorded_step
from ..storage import Storage, location, open_storage

DEFAULT_CHUNK_ROWS = 65536
#: iter_rows reads about this many bytes of rows (all segments together) per bucket window.
WINDOW_BYTES = 32 << 20



@dataclass(frozen=True)
class SlotDesc:
    """One slot (column) of a sparse table: format dtype name ('F32', 'BF16', ...) and the row shape."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    category: str          # 'sparse' (the model's rows) or 'sparse_opt' (optimizer state)

    @property
    def torch_dtype(self):
        """The slot's torch.dtype (imports torch)."""
        return dtypes.torch_dtype(self.dtype)

    @property
    def numpy_dtype(self) -> np.dtype:
        """What `iter_rows` returns as numpy: the slot's own type; float32 for BF16 (numpy has none)."""
        return np.dtype(dtypes.numpy_dtype(self.dtype) or "<f4")

    @property
    def row_bytes(self) -> int:
        return dtypes.itemsize(self.dtype) * int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class TableDesc:
    name: str
    rows: int
    slots: Mapping[str, SlotDesc]   # in column order


@dataclass(frozen=True)
class DenseDesc:
    key: str
    dtype: str
    shape: tuple[int, ...]


def open_output_dir(path, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of an output directory (or checkpoint directory) at a path or fsspec URL."""
    return _open_storage(location(path), storage_options)


def _open_storage(path: str, storage_options: Mapping[str, Any] | None) -> Storage:
    return open_storage(path, dict(storage_options) if storage_options else None)


def open(path, storage_options: Mapping[str, Any] | None = None, *, threads: int = 4) -> CheckpointView:
    """A read-only view of the committed checkpoint directory `path` (local path or fsspec URL).

    Raises CheckpointNotFoundError when `path` holds no checkpoint (naming the newest one when `path` is
    an output directory), CorruptCheckpointError when its manifest fails validation."""
    path = location(path)
    storage = _open_storage(path, storage_options)
    try:
        reader = CheckpointReader(storage, "", threads=threads)
    except FileNotFoundError:
        raise CheckpointNotFoundError(catalog.not_a_checkpoint(storage)) from None
    if reader.manifest.parent is None:
        return CheckpointView(reader)
    root, ckpt_dir = split_path(path)
    out = _open_storage(root, storage_options)
    # The links' manifests and hashes are checked here; their files, as a full checkpoint's, when read or by
    # `files_problems` (so that inspect and diff report a damaged link instead of failing whole).
    with catalog.deleted_as_such([(storage, "")], "opened"):   # a link may go with it: chain_of says which
        return CheckpointView(reader, chain_of(CheckpointReader(out, ckpt_dir, threads=threads)))


def unless_damaged(damaged: list[str] | None, read, empty=None):
    """`read()`; but where `damaged` (a checkpoint's `files_problems`) is non-empty and the read fails on the
    checkpoint's bytes, `empty`, with the failure added to `damaged` (each file named once): a report on a
    damaged checkpoint (diff, inspect) leaves that part out instead of failing whole."""
    if not damaged:
        return read()
    try:
        return read()
    except CorruptCheckpointError as e:
        if not any((e.path or str(e)) in said for said in damaged):
            damaged.append(str(e))
        return empty


def kind_of(metadata: Mapping[str, str], parent: str | None) -> str:
    """'incremental' (has a parent), 'ephemeral' (a manager's short-lived checkpoint) or 'full'."""
    if parent:
        return "incremental"
    return "ephemeral" if metadata.get(META_EPHEMERAL) == "1" else "full"


def parent_of(manifest) -> str | None:
    """The id of the parent an incremental checkpoint names in its manifest (format version 3), else None.
    A view of an incremental checkpoint shows that checkpoint's own rows: the ones changed since the
    parent."""
    parent = getattr(manifest, "parent", None)
    return None if parent is None else getattr(parent, "ckpt_id", parent)


def _names(names: str | Sequence[str]) -> list[str]:
    """Names given as one string or a sequence of them (a bare string is one name, not its letters)."""
    return [names] if isinstance(names, str) else list(names)


def _index(x) -> int | None:
    """`x` as a Python int if it is an integer (numpy's too), not a bool; else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _pair(x) -> tuple[int, int] | None:
    """A (lo, hi) / (rank, world) pair of integers (a tuple or list; numpy integers welcome), or None."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        return None
    a, b = _index(x[0]), _index(x[1])
    return None if a is None or b is None else (a, b)


class CheckpointView:
    """One committed checkpoint, read-only. Cheap to open (the manifest only; for an incremental checkpoint
    every link's manifest and index); the index, dense file, registered objects and IO state
    are read and verified when first asked for. `links`: the checkpoint's chain, base first, each link
    opened by format.chain.chain_of (files checked as read); None for a full checkpoint."""

    def __init__(self, reader: CheckpointReader, links: list[CheckpointReader] | None = None):
        self._links = list(links) if links else [reader]
        self._r = self._links[-1]
        m = reader.manifest
        self.path: str = reader.describe()
        self.ckpt_id: str = m.ckpt_id
        self.format_version: int = m.format_version
        self.num_buckets: int = m.num_buckets
        self.workers: int = m.shard_num
        self.writer: str = m.writer
        self.created_ns: int = m.created_ns
        self.metadata: Mapping[str, str] = dict(m.metadata)
        self.worker_steps: Mapping[int, int] = dict(m.worker_steps)
        self.parent: str | None = parent_of(m)
        self.links: list[str] = [link.manifest.ckpt_id for link in self._links]
        """The ids of the chain this view folds, base first (just this checkpoint's, for a full one)."""
        self._slots: dict[str, dict[str, SlotDesc]] = {
            name: {s: SlotDesc(s, i.dtype, tuple(i.shape), i.category) for s, i in t.slots.items()}
            for name, t in m.tables.items()}
        self._tables: dict[str, TableDesc] | None = None
        self._dense: dict[str, DenseDesc] | None = None
        self._indexes_checked = False

    def __repr__(self) -> str:
        return f"<recckpt checkpoint {self.path}: step {self.step}, {len(self.tables)} tables, {self.workers} workers>"

    def _reading(self):
        """Around every read of the checkpoint's files: a checkpoint (or a link of its chain) deleted under
        this view raises CheckpointDeletedError, not a corrupt-checkpoint error or a bare OSError."""
        return catalog.deleted_as_such([(link.storage, link.ckpt_dir) for link in self._links], "read")

    @contextlib.contextmanager
    def _rows_reading(self):
        """`_reading`, for reads of rows: the worker indexes of every link checked first (once), as a load
        checks them, so that a checkpoint a load refuses for a missing or damaged worker index is not
        exported or looked up as if intact."""
        with self._reading():
            if not self._indexes_checked:
                for link in self._links:
                    link.verify_worker_indexes()
                self._indexes_checked = True
            yield

    def local_dirs(self) -> list[str]:
        """The local directories of this checkpoint and of the links of its chain, base first (none on an
        object store)."""
        return [p for p in (link.storage.engine_path(link.ckpt_dir) for link in self._links) if p is not None]

    # ------------------------------------------------------------------------------------ metadata
    @property
    def step(self) -> int | None:
        """The global step the CheckpointManager recorded, else the newest step a worker saved at."""
        return recorded_step(self.metadata, self.worker_steps)

    @property
    def created(self) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.created_ns / 1e9, tz=_dt.timezone.utc)

    @property
    def kind(self) -> str:
        """'incremental' (has a parent), 'ephemeral' (a manager's short-lived checkpoint) or 'full'."""
        return kind_of(self.metadata, self.parent)

    @property
    def size_bytes(self) -> int:
        """Bytes of the checkpoint's files as recorded: manifest entries plus the shard files in the index
        (which is read and checked: a view of a checkpoint reports a corrupt or hostile index)."""
        with self._reading():
            return sum(f.size for f in self._r.manifest.files.values()) + sum(s for _, s in self._r.index.files)

    @property
    def tables(self) -> Mapping[str, TableDesc]:
        """Each table's slots and rows. For an incremental checkpoint the rows are the folded state's,
        counted the first time this is read from the ids of every link (rows themselves are not read)."""
        if self._tables is None:
            with self._reading():
                self._tables = {name: TableDesc(name, self._folded_rows(name), slots)
                                for name, slots in self._slots.items()}
        return self._tables

    def _folded_rows(self, table: str) -> int:
        links = table_links(self._links, table)
        if len(links) == 1:
            return links[0].manifest.tables[table].rows
        # the fold's plan reads and verifies the ids of every link, not their rows
        return sum(plan_fold(links, table, lo, hi).rows
                   for lo, hi in bucket_groups(links, table, 0, self.num_buckets, WINDOW_BYTES))

    @property
    def schema(self) -> Mapping[str, Mapping[str, SlotDesc]]:
        """Each table's slots (column order), from the manifest alone: unlike `tables`, never reads ids."""
        return self._slots

    def files_problems(self) -> list[str]:
        """What is wrong with the checkpoint's files short of reading rows (CheckpointReader.files_problems;
        empty when none): this checkpoint's small files read and CRC-checked, the older links of its chain
        checked by sizes, and only the files a load of it reads there (indexes and shards, not their dense
        and object files)."""
        with self._reading():
            return [p for link in self._links for p in link.files_problems(read_small_files=link is self._r,
                                                                            rows_only=link is not self._r)]

    # ------------------------------------------------------------------------------------- digests
    @property
    def manifest_sha256(self) -> str | None:
        """SHA-256 of this checkpoint's manifest.json bytes: equal manifests mean equal checkpoints (the
        manifest covers every file through sizes and checksums, and an increment's chain by hash)."""
        return self._r.manifest.content_sha256

    def table_digest(self, table: str) -> tuple[TableDigest | None, str | None]:
        """(the content digest of `table` as this view shows it, None) or (None, why it is not known)."""
        self._table_slots(table)
        m = self._r.manifest
        if m.tables[table].changes:
            return None, (f"{self.ckpt_id} holds only the changes of table {table!r} since {self.parent}: its "
                          f"content is the fold of a chain of {len(self.links)} links, which records no digest")
        if m.digests is None:
            return None, f"{self.ckpt_id} records no content digests (format version {m.format_version})"
        d = m.digests.tables.get(table)
        return (d, None) if d is not None else (None, f"{self.ckpt_id} records no digest of table {table!r}")

    @property
    def digest_hash(self) -> str | None:
        """The function of this checkpoint's content digests (`digests.hash`); None when it records none."""
        d = self._r.manifest.digests
        return None if d is None else d.hash

    @property
    def dense_digests(self) -> Mapping[str, DenseDigest] | None:
        """Dense key -> dtype, shape and content digest, from the manifest; None when not recorded."""
        d = self._r.manifest.digests
        return None if d is None or d.dense is None else dict(d.dense)

    # ---------------------------------------------------------------------------------- dense & objects
    @property
    def dense(self) -> Mapping[str, DenseDesc]:
        """Dense keys with dtype and shape (reads and verifies the dense file once)."""
        if self._dense is None:  # from the verified file's header: no tensors made, no torch imported
            with self._reading():
                self._dense = {k: DenseDesc(k, dt, shape) for k, (dt, shape) in self._r.dense_header().items()}
        return self._dense

    def dense_tensors(self, keys: Sequence[str] | None = None) -> dict[str, Any]:
        """Copies of the dense tensors (all, or `keys`)."""
        with self._reading():
            tensors = self._r.dense()
        if keys is not None:
            keys = _names(keys)
            unknown = [k for k in keys if k not in tensors]
            if unknown:
                raise InvalidArgumentError(f"{self.path}: no dense keys {unknown}; it has {sorted(tensors)}")
            tensors = {k: tensors[k] for k in keys}
        return {k: t.clone() for k, t in tensors.items()}

    def dense_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the dense tensors as numpy arrays (BF16 as uint16 bits), without importing torch."""
        from ..format import safetensors_io
        m = self._r.manifest
        if m.dense is None:
            return {}
        with self._reading():
            arrays, _ = safetensors_io.read_arrays(self._r.read_file(m.dense), self._r.describe(m.dense))
        return arrays

    def objects(self, arrays: bool = False) -> dict:
        """The registered-objects tree {'objects': {name: {'kind', 'state'}}, 'sparse_optimizer': ...}.
        Objects saved with pickle keep kind 'pickled_*' and their state as a uint8 tensor: never unpickled.
        arrays=True: tensors come as numpy arrays (BF16 as uint16 bits) and torch is not imported."""
        from ..format import extras as extras_fmt
        with self._reading():
            tree = self._r.extras(arrays)
        if tree is None:
            return {"objects": {}, "sparse_optimizer": None}
        return extras_fmt.validate(tree, self._r.describe(self._r.manifest.extras))

    @property
    def io_state_workers(self) -> list[int]:
        return sorted(self._r.manifest.io_state)

    def io_state(self, worker: int, arrays: bool = False) -> Any:
        """Worker `worker`'s IO state tree (registered name -> dumped state), or None if it saved none.
        arrays=True: tensors as numpy arrays, as for objects()."""
        index = _index(worker)
        if index is None or not 0 <= index < self.workers:
            raise InvalidArgumentError(f"{self.path}: io_state: worker must be an integer in [0, {self.workers}), "
                                       f"got {worker!r}")
        worker = index
        with self._reading():
            return self._r.io_state(worker, arrays)

    # ---------------------------------------------------------------------------------------- rows
    def _table_slots(self, table: str) -> dict[str, SlotDesc]:
        t = self._slots.get(table)
        if t is None:
            raise InvalidArgumentError(f"{self.path}: no table {table!r}; it has {sorted(self._slots) or 'none'}")
        return t

    def _slots_of(self, table: str, have: dict[str, SlotDesc], slots) -> list[str]:
        """The slots asked for (all when None; one name or a sequence), checked to be distinct slots of it."""
        slots = list(have) if slots is None else _names(slots)
        unknown = [s for s in slots if s not in have]
        if unknown or len(set(slots)) != len(slots):
            raise InvalidArgumentError(f"{self.path}: table {table!r}: slots {slots} are not distinct slots of "
                                       f"the table; it has {list(have)}")
        return slots

    def bucket_range(self, shard: tuple[int, int] | None = None,
                     buckets: tuple[int, int] | None = None) -> tuple[int, int]:
        """The bucket range [lo, hi) selected by `shard=(rank, world)` or `buckets=(lo, hi)` (not both)."""
        nb = self.num_buckets
        if shard is not None and buckets is not None:
            raise InvalidArgumentError("iter_rows: pass shard=(rank, world) or buckets=(lo, hi), not both")
        if shard is not None:
            pair = _pair(shard)
            if pair is None or not (pair[1] >= 1 and 0 <= pair[0] < pair[1]):
                raise InvalidArgumentError(f"shard={shard!r}: expected (rank, world) with 0 <= rank < world")
            return bucket_range(pair[0], pair[1], nb)
        if buckets is not None:
            pair = _pair(buckets)
            if pair is None or not 0 <= pair[0] <= pair[1] <= nb:
                raise InvalidArgumentError(f"buckets={buckets!r}: expected (lo, hi) with 0 <= lo <= hi <= "
                                           f"{nb} (this checkpoint's bucket count)")
            return pair
        return 0, nb

    def iter_rows(self, table: str, slots: Sequence[str] | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                  shard: tuple[int, int] | None = None, *, buckets: tuple[int, int] | None = None,
                  as_torch: bool = False, reuse: bool = False) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Yield `(ids, {slot: rows})` chunks of at most `chunk_rows` rows of `table`, every byte verified.

        slots: which slots (default all). shard=(rank, world): the rows worker `rank` of `world` owns;
        buckets=(lo, hi): the rows of buckets [lo, hi). Rows come in bucket order, not id order. Arrays are
        numpy (BF16 slots as float32, exactly) or, with as_torch=True, torch tensors of the slot's dtype.
        Each chunk is fresh memory the caller may keep; with reuse=True every chunk lands in the same
        buffer instead (valid until the next chunk: saves faulting in new memory for a caller that
        converts or writes each chunk at once). Memory use is bounded by chunk_rows and the reader's
        window, whatever the table's size."""
        have = self._table_slots(table)
        slots = self._slots_of(table, have, slots)
        if type(chunk_rows) is not int or chunk_rows < 1:
            raise InvalidArgumentError(f"chunk_rows={chunk_rows!r}: expected an integer >= 1")
        lo, hi = self.bucket_range(shard, buckets)
        descs = [have[s] for s in slots]
        widths = [d.row_bytes for d in descs]
        if lo == hi:
            return
        with self._rows_reading():
            links = table_links(self._links, table)
            if len(links) == 1 and table not in self._r.index.tables:
                return
            upper = sum(link.manifest.tables[table].rows for link in links)   # the table's rows, before folding
            cap = max(1, min(chunk_rows, upper))  # no allocation beyond the table, whatever chunk_rows says
            buf = _Chunk(cap, widths)
            for ids, parts in self._pieces(links, table, slots, widths, lo, hi):
                pos, n = 0, len(ids)
                while pos < n:
                    take = buf.fill(ids, parts, pos, n)
                    pos += take
                    if buf.full:
                        yield self._convert(buf, slots, descs, as_torch)
                        buf = buf.emptied() if reuse else _Chunk(cap, widths)
            if buf.rows:
                yield self._convert(buf, slots, descs, as_torch)

    def column_blocks(self, table: str):
        """The column blocks `table` was saved in (`format.schema.ColumnBlocks`: the split slots and each
        block's columns), None when it was saved whole-row (docs/FORMAT.md, Column blocks)."""
        self._table_slots(table)
        with self._reading():
            return table_links(self._links, table)[0].manifest.tables[table].column_blocks

    def block_values(self, table: str, slot: str, buckets: tuple[int, int] | None = None
                     ) -> "tuple[np.ndarray, list[tuple[tuple[int, int], np.ndarray]]] | None":
        """Of a table saved as column blocks whose `slot` is not split (a per-row value each block keeps its
        own of: a column-wise plan's RowWiseAdagrad state, one per column shard), `(ids, [((c0, c1),
        values), ...])`: the rows of buckets [lo, hi) (None: all), sorted by id, and each block's columns
        and values, every byte verified. None for any other table or slot. Whole-row readers (`iter_rows`,
        export, the digests) show block 0's value (docs/FORMAT.md, Column blocks); `diff` compares them all."""
        have = self._table_slots(table)
        self._slots_of(table, have, [slot])
        lo, hi = self.bucket_range(None, buckets)
        d = have[slot]
        with self._rows_reading():
            link = table_links(self._links, table)[0]   # column blocks are whole in one link
            info = link.manifest.tables[table]
            cb = info.column_blocks
            if cb is None or slot in cb.slots:
                return None
            rows = row_range_of_buckets(info, self.num_buckets, lo, hi)
            chunk = max(1, WINDOW_BYTES // (8 + d.row_bytes * len(cb.blocks)))
            ids_l, per = [], [[] for _ in cb.blocks]
            for ids, _, unsplit in iter_joined(link.segments, table, info, [slot], [rows], None, chunk,
                                               FROM_OVERLAP):
                ids_l.append(ids)
                for j, (_, raw) in enumerate(unsplit[slot]):
                    per[j].append(raw)
        ids = np.concatenate(ids_l) if ids_l else np.empty(0, np.int64)
        order = np.argsort(ids, kind="stable")
        out = []
        for rng, parts in zip(cb.blocks, per):
            raw = np.concatenate(parts) if parts else np.empty((0, d.row_bytes), np.uint8)
            out.append((tuple(rng), _numpy_rows(raw, d, len(ids))[order]))
        return ids[order], out

    #: Above this many separate bucket runs, `lookup` reads the one range from the lowest to the highest
    #: (a window at a time) rather than a read per run, each of which reads its segments' directories.
    LOOKUP_MAX_RUNS = 32

    def lookup(self, table: str, ids, slots: str | Sequence[str] | None = None, *, as_torch: bool = False
               ) -> tuple[Any, dict[str, Any]]:
        """The rows of `ids` (int64[n], any order, repeats allowed) of `table`: `(found, {slot: rows})` in
        the order of `ids`, `found[i]` saying whether `ids[i]` is in the checkpoint (its rows are zero where
        it is not). For an incremental checkpoint, the chain's state (newest row wins, removed ids absent).
        Only the buckets those ids fall in are read (`iter_rows(buckets=...)`), each verified: a few ids
        cost a few bucket windows, not the table. Arrays as `iter_rows` gives them (numpy, BF16 as float32;
        torch tensors of the slots' dtypes with `as_torch=True`)."""
        have = self._table_slots(table)
        slots = self._slots_of(table, have, slots)
        want = lookup_ids(ids)
        found = np.zeros(len(want), dtype=bool)
        descs = [have[s] for s in slots]
        out = {s: np.zeros((len(want), *d.shape), dtype=d.numpy_dtype) for s, d in zip(slots, descs)}
        order = np.argsort(want, kind="stable")
        sorted_want = want[order]
        for lo, hi in self._lookup_ranges(table, want):
            for got, cols in self.iter_rows(table, slots, buckets=(lo, hi), reuse=True):
                left = np.searchsorted(sorted_want, got, "left")
                counts = np.searchsorted(sorted_want, got, "right") - left
                if not counts.any():
                    continue
                rows = np.repeat(np.arange(len(got)), counts)   # each read row, once per time it was asked for
                starts = np.repeat(np.cumsum(counts) - counts, counts)
                at = order[np.repeat(left, counts) + np.arange(len(rows)) - starts]
                found[at] = True
                for s in slots:
                    out[s][at] = cols[s][rows]
        if as_torch:
            import torch
            return torch.from_numpy(found), {s: torch.from_numpy(out[s]).to(d.torch_dtype)
                                             for s, d in zip(slots, descs)}
        return found, out

    def _lookup_ranges(self, table: str, ids: np.ndarray) -> list[tuple[int, int]]:
        """The bucket ranges holding `ids` under the table's bucket function (its newest link's, as a
        chain's fold reads them): runs of adjacent buckets, or one range when there are many."""
        from .. import _C
        with self._reading():
            links = table_links(self._links, table)
            if not len(ids) or (len(links) == 1 and table not in self._r.index.tables):
                return []
        info = links[-1].manifest.tables[table]
        b = np.asarray(_C.bucket_of(ids, self.num_buckets, **info.bucket_args()))
        b = np.unique(b[b >= 0])   # -1: an id no row of a fixed-size table can have
        if not len(b):
            return []
        cuts = np.flatnonzero(np.diff(b) > 1) + 1
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(b, cuts)]
        return runs if len(runs) <= self.LOOKUP_MAX_RUNS else [(runs[0][0], runs[-1][1])]

    def _pieces(self, links: list[CheckpointReader], table: str, slots: list[str], widths: list[int],
                lo: int, hi: int):
        """(ids, [uint8 rows per slot]) of buckets [lo, hi): one link's rows window by window, or the
        fold of a chain (format.fold: the one home of "newest row wins, removed ids absent"), bucket group
        by bucket group of about WINDOW_BYTES of the links' rows."""
        if len(links) > 1:
            yield from fold_rows(links, table, slots, lo, hi, group_bytes=WINDOW_BYTES)
            return
        info = links[0].manifest.tables[table]
        if info.column_blocks is not None:   # saved column-split: whole rows joined from every block
            rows = row_range_of_buckets(info, self.num_buckets, lo, hi)
            chunk = max(1, WINDOW_BYTES // (8 + sum(widths)))
            for ids, split, unsplit in iter_joined(links[0].segments, table, info, slots, [rows], None, chunk):
                yield ids, [split[s] if s in split else unsplit[s][0][1] for s in slots]
            return
        n = self._windows(links[0].manifest.tables[table].rows, widths, lo, hi)
        for k in range(n):
            w_lo, w_hi = lo + k * (hi - lo) // n, lo + (k + 1) * (hi - lo) // n
            yield from links[0].segments.iter_table(table, slots, widths, w_lo, w_hi)

    def _windows(self, rows: int, widths: list[int], lo: int, hi: int) -> int:
        """How many bucket windows of about WINDOW_BYTES of rows each to split [lo, hi) into (ids hash
        evenly over buckets): the segment reader reads whole segments' row ranges, and a segment can be as
        large as the writer chose, so reading a window at a time is what bounds memory whatever the table
        and its segments."""
        total = rows * (8 + sum(widths)) * (hi - lo) // self.num_buckets
        return max(1, min(hi - lo, -(-total // WINDOW_BYTES)))

    @staticmethod
    def _convert(buf: _Chunk, slots, descs, as_torch):
        n = buf.rows
        ids = buf.ids[:n]
        cols = {}
        for s, d, raw in zip(slots, descs, buf.cols):
            raw = raw[:n]
            if as_torch:
                import torch
                cols[s] = torch.from_numpy(raw).view(d.torch_dtype).reshape(n, *d.shape)
            else:
                cols[s] = _numpy_rows(raw, d, n)
        if as_torch:
            import torch
            return torch.from_numpy(ids), cols
        return ids, cols


def _numpy_rows(raw: np.ndarray, d: SlotDesc, n: int) -> np.ndarray:
    """n rows of slot `d` as numpy from their bytes: the slot's own type, BF16 as float32 (exactly)."""
    if d.dtype == "BF16":   # bf16 is the top half of a float32: widening is exact
        return (raw.view("<u2").astype("<u4") << 16).view("<f4").reshape(n, *d.shape)
    return raw.view(d.numpy_dtype).reshape(n, *d.shape)


class _Chunk:
    """A chunk being filled from the reader's reused buffers: one copy per byte."""

    def __init__(self, cap: int, widths: list[int]):
        self.cap, self.rows = cap, 0
        self.ids = np.empty(cap, dtype="<i8")
        self.cols = [np.empty((cap, w), dtype=np.uint8) for w in widths]

    def emptied(self) -> _Chunk:
        self.rows = 0
        return self

    @property
    def full(self) -> bool:
        return self.rows == self.cap

    def fill(self, ids, parts, pos: int, n: int) -> int:
        take = min(n - pos, self.cap - self.rows)
        r = self.rows
        self.ids[r:r + take] = ids[pos:pos + take]
        for dst, src in zip(self.cols, parts):
            dst[r:r + take] = src[pos:pos + take]
        self.rows += take
        return take


__all__ = ["DEFAULT_CHUNK_ROWS", "CheckpointView", "DenseDesc", "SlotDesc", "TableDesc", "open"]


def lookup_ids(ids) -> np.ndarray:
    """`ids` (a 1-D array, tensor or list of integers) as contiguous int64, each id checked to lie in int64:
    cast, a larger one (numpy makes 2**63 uint64) would wrap onto another id."""
    if isinstance(ids, (list, tuple)):   # Python ints one by one: numpy would make a mix of huge and negative
        # ones float64 or object, and the message would be about the dtype
        wide = next((i for i in ids if isinstance(i, int) and not -(1 << 63) <= i < 1 << 63), None)
        if wide is not None:
            raise InvalidArgumentError(f"lookup: id {wide} is outside int64, the range of a table's ids; give ids "
                                       f"as signed 64-bit integers")
    want = np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids)
    if want.ndim != 1 or (want.size and want.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"lookup: ids must be a 1-D array of integers, got {want.dtype} of shape "
                                   f"{want.shape}")
    if want.dtype.kind == "u" and want.size and int(want.max()) >= 1 << 63:
        raise InvalidArgumentError(f"lookup: id {int(want.max())} is outside int64, the range of a table's ids; "
                                   f"give ids as signed 64-bit integers (a uint64 hash as its int64 bit pattern: "
                                   f"ids.view(np.int64))")
    return np.ascontiguousarray(want, dtype=np.int64)
