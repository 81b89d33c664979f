"""The ``SparseState`` protocol: what a sparse embedding table must provide to be checkpointed.

A *sparse table* maps int64 ids (the full signed range) to rows of named columns called *slots*:
the embedding itself, optimizer state (``adagrad.acc``, ``adam.m``, ...), counters. Every slot has
its own dtype and row shape; all slots of a table share one id order.

Any object implementing :class:`SparseState` can be saved and loaded by recckpt. The library never
special-cases a concrete implementation: :class:`recckpt.state.hashtable.HashTable` is simply the
first user of this protocol. Objects are discovered inside a ``state_dict`` (usually as the
``<prefix>_extra_state`` entry of a module whose ``get_extra_state()`` returns the table) by
:func:`split_sparse_dense_state_dict`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Protocol, Sequence, Tuple, runtime_checkable

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "Admission",
    "Admitted",
    "AdoptStorage",
    "BulkAppend",
    "ChangeTracking",
    "Changes",
    "ColumnPieces",
    "FixedSize",
    "LendsRows",
    "RoutedRows",
    "RowRangeLayout",
    "column_split_slots",
    "pieces_of",
    "SLOT_CATEGORIES",
    "SlotSpec",
    "SparseTableMeta",
    "SparseState",
    "split_sparse_dense_state_dict",
]

#: Allowed values of :attr:`SlotSpec.category`.
SLOT_CATEGORIES = ("sparse", "sparse_opt")


def _as_shape(shape: Any, what: str) -> Tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise InvalidArgumentError(f"{what}: shape must be a sequence of ints, got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool):
            raise InvalidArgumentError(f"{what}: shape entries must be ints, got {d!r} in {shape!r}")
        try:
            d = operator.index(d)
        except TypeError:
            raise InvalidArgumentError(f"{what}: shape entries must be ints, got {d!r} in {shape!r}") from None
        if d < 0:
            raise InvalidArgumentError(f"{what}: shape entries must be non-negative, got {tuple(shape)!r}")
        out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class SlotSpec:
    """Description of one named column (slot) of a sparse table.

    Attributes:
        dtype: the ``torch.dtype`` every row of this slot is stored and exchanged in.
        shape: the shape of one row, e.g. ``(dim,)`` for an embedding; ``()`` for one scalar per
            row (a counter). A column of ``n`` rows has shape ``(n, *shape)``. Normalised to a tuple
            of non-negative Python ints on construction.
        category: ``"sparse"`` for the model's own per-id state (embeddings, counters) or
            ``"sparse_opt"`` for optimizer state (``adagrad.acc``, ``adam.m``, ...). Loaders use it
            to load or skip optimizer state as a group.

    Construction raises ``TypeError`` for a dtype that is not a ``torch.dtype`` or a non-integer
    shape entry, and ``ValueError`` for a negative shape entry or an unknown category.
    """

    dtype: torch.dtype
    shape: Tuple[int, ...]
    category: str

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"SlotSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", _as_shape(self.shape, "SlotSpec"))
        if self.category not in SLOT_CATEGORIES:
            raise InvalidArgumentError(
                f"SlotSpec.category must be one of {SLOT_CATEGORIES}, got {self.category!r}"
            )

    @property
    def row_numel(self) -> int:
        """Number of elements in one row (1 for a scalar slot)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: ``row_numel * element size of dtype``."""
        return self.row_numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class SparseTableMeta:
    """A snapshot of a sparse table's schema and size.

    Attributes:
        name: the table's name, unique among the sparse tables of one checkpoint; the key under
            which the table is saved and matched on load.
        slots: slot name -> :class:`SlotSpec`, in a stable order (insertion order). For
            :class:`~recckpt.state.hashtable.HashTable` ``"embedding"`` is always first. The mapping
            is copied on construction, so later changes to the table do not change this snapshot.
        num_rows: number of ids in the table at the time of the call.
    """

    name: str
    slots: Dict[str, SlotSpec]
    num_rows: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"SparseTableMeta.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.slots, Mapping):
            raise InvalidArgumentError(f"table {self.name!r}: slots must be a mapping, got {type(self.slots)}")
        slots = dict(self.slots)
        for k, v in slots.items():
            if not isinstance(k, str) or not k:
                raise InvalidArgumentError(f"table {self.name!r}: slot names must be non-empty str, got {k!r}")
            if not isinstance(v, SlotSpec):
                raise InvalidArgumentError(f"table {self.name!r}: slot {k!r} must be a SlotSpec, got {v!r}")
        object.__setattr__(self, "slots", slots)
        if isinstance(self.num_rows, bool):
            raise InvalidArgumentError(f"table {self.name!r}: num_rows must be an int")
        n = operator.index(self.num_rows)
        if n < 0:
            raise InvalidArgumentError(f"table {self.name!r}: num_rows must be >= 0, got {n}")
        object.__setattr__(self, "num_rows", n)


@runtime_checkable
class SparseState(Protocol):
    """What a sparse table implements to be checkpointed by recckpt.

    Tensors exchanged through this protocol are CPU tensors, except that a table whose storage lives
    on a device (``HashTable(device="cuda")``) may hand out its slot columns on that device from
    :meth:`export_chunks` and ``append_views``; the saver and loader copy them through bounded host
    buffers (:mod:`recckpt.state.staging`). Ids are ``torch.int64`` and cover
    the full signed 64-bit range (no value is reserved). Within one table every id appears at most
    once. An implementation need not be thread-safe: recckpt calls it from one thread at a time and
    does not modify the table while iterating :meth:`export_chunks`.
    """

    def sparse_meta(self) -> SparseTableMeta:
        """Return the table's name, slot schema (in a stable order) and current number of rows."""
        ...

    def export_chunks(
        self, slots: Sequence[str], max_rows: int
    ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """Iterate over the whole table in chunks.

        Each item is ``(ids, columns)``: ``ids`` is a C-contiguous CPU ``int64`` tensor of shape
        ``[n]`` and ``columns`` maps each requested slot name (in the order given) to a C-contiguous
        tensor (CPU, or the table's device; see the class docstring) of shape ``[n, *spec.shape]``
        in the slot's dtype, row ``i`` belonging to
        ``ids[i]``. ``1 <= n <= max_rows`` for every chunk; across all chunks every id of the table
        appears exactly once; an empty table yields nothing. ``max_rows`` must be >= 1 and every
        name in ``slots`` must be a slot of the table (``ValueError`` otherwise).

        Chunks may be views of the table's live storage: they are valid until the table is next
        modified, and the caller must not write to them.
        """
        ...

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        """Insert or overwrite (upsert) the rows of ``ids``.

        ``ids`` is an ``int64`` tensor of shape ``[n]`` with no repeated id. For every slot in
        ``columns`` the row of each id is set to the given row. A slot not in ``columns`` keeps its
        value for ids that already existed and starts at its initial value (the table's
        initializer for the embedding, the slot's own init value for other slots) for new ids, so
        loading only optimizer slots never resets trained embeddings. A column must
        have exactly the slot's dtype and shape ``[n, *spec.shape]`` (the caller casts); a mismatch,
        an unknown slot name, or bad ``ids`` raises ``ValueError`` naming the table, the slot and
        both the expected and the given shape/dtype, before anything is modified.
        """
        ...

    def clear_rows(self) -> None:
        """Remove every id from the table (called before a load that replaces its contents)."""
        ...

    # Optional: ``reserve(rows: int) -> None``. If present, loaders call it with the number of rows
    # the table is about to hold, so an implementation can allocate once instead of growing.


@runtime_checkable
class BulkAppend(Protocol):
    """Optional extension of :class:`SparseState`: let a loader read rows straight into storage.

    A table being replace-loaded (emptied by ``clear_rows``) receives ids it does not hold yet, so
    it can lend the loader the memory those rows will live in; the loader reads checkpoint bytes
    directly into it instead of into a staging buffer that ``import_rows`` would copy again. Loaders
    use it only when no dtype cast is needed and the table was cleared (not with ``merge``); any
    other case goes through ``import_rows``. Both methods are called from one thread.
    """

    def append_views(
        self, n: int, slots: Sequence[str]
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Return writable, C-contiguous tensors (CPU, or the table's device for slots) for ``n`` rows that are not yet in the table:
        ``ids`` (``int64[n]``) and, for each slot named in ``slots``, ``[n, *spec.shape]`` in the
        slot's dtype. The caller fills every element, then calls :meth:`commit_append`. Until then
        the rows are not part of the table (``len`` and lookups are unchanged); a caller that gives
        up simply never commits, and the next ``append_views`` or modification discards them."""
        ...

    def commit_append(self) -> None:
        """Add the rows filled since the last :meth:`append_views` to the table. Slots not named
        there start at their initial value. If an appended id is already in the table or repeated,
        raise ``ValueError`` naming the table and the id, leaving the table as it was before."""
        ...


@dataclass(frozen=True)
class Changes:
    """What changed in a table since a mark (see :class:`ChangeTracking`).

    Attributes:
        rows: number of rows inserted or written since the mark (the rows ``chunks`` yields).
        chunks: ``(ids, columns)`` items exactly like :meth:`SparseState.export_chunks`'s, covering
            each changed row once; the table must not be modified while they are iterated.
        removed: ``int64[k]`` ids removed since the mark and not in the table now (no repeats).
    """

    rows: int
    chunks: Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
    removed: torch.Tensor


@runtime_checkable
class ChangeTracking(Protocol):
    """Optional extension of :class:`SparseState`: tell what changed since a mark, so that an
    incremental checkpoint writes only those rows. A table without it is saved in full in every
    checkpoint (incremental ones included). A Saver takes a mark when it captures a checkpoint and
    asks for the changes since the mark of the checkpoint's parent."""

    def mark_changes(self) -> int:
        """Return a mark (an int) for "now": later inserts, writes and removals are changes since it.
        Marks increase; taking one does not forget anything."""
        ...

    def export_changes(self, since: int, slots: Sequence[str], max_rows: int) -> "Changes | None":
        """The rows inserted or written after mark ``since`` (all requested slots, in chunks of at most
        ``max_rows`` rows) and the ids removed after it that are not in the table now. ``None`` when
        the table cannot tell (it was cleared or reloaded, got a new slot, or ``since`` is not one of
        its marks): the caller then saves the table in full. A row rewritten with its old value may be
        reported as changed; a changed row must never be missed."""
        ...

    def forget_changes(self, upto: int) -> None:
        """The caller no longer asks for changes since marks ``<= upto``: records kept only for them
        (e.g. removed ids) may be dropped."""
        ...


@runtime_checkable
class AdoptStorage(Protocol):
    """Optional extension of :class:`SparseState`: take storage the loader allocated.

    A mapped load (``LoadConfig(mmap=True)``) builds each slot's storage from the checkpoint file
    itself, a copy-on-write mapping whose pages are shared with the page cache until written, and
    hands it over instead of copying the rows into memory the table allocated. Used only for a table
    being replace-loaded (emptied by ``clear_rows``) with no dtype cast; called from one thread.
    """

    def adopt_storage(self, rows: int, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        """Make these tensors the table's storage. ``ids`` is ``int64[capacity]`` and each column is
        ``[capacity, *spec.shape]`` in its slot's dtype, all C-contiguous CPU tensors with the same
        ``capacity >= rows``; their first ``rows`` rows are the table's contents and the rest is room
        to grow into. The table keeps and writes these tensors (it may replace them when it grows past
        ``capacity``). Slots not in ``columns`` start at their initial value. The table must be empty;
        a repeated id, a wrong shape or dtype, or a non-empty table raise ``ValueError`` naming the
        table and leave it unchanged."""
        ...


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}") from None


def _as_range(value: Any, what: str) -> Tuple[int, int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a (start, end) pair of ints, got {value!r}")
    pair = tuple(value)
    if len(pair) != 2:
        raise InvalidArgumentError(f"{what} must be a (start, end) pair of ints, got {value!r}")
    return _as_int(pair[0], what), _as_int(pair[1], what)


@dataclass(frozen=True)
class RowRangeLayout:
    """Ownership of a fixed-size table (ids are row indices 0..num_rows-1), as its sharding plan says.

    Tables whose rows are a fixed range of indices (TorchRec's EmbeddingBagCollection and
    EmbeddingCollection) are owned by contiguous row ranges and column blocks rather than by hash
    buckets. A table that reports this layout (see :class:`FixedSize`) is saved with the
    ``"row_range"`` bucket function (``bucket = row * B // num_rows``), so a rank that owns a row
    range reads a contiguous bucket range, and with one column block per distinct ``columns``
    range, so a column-wise rank reads its columns alone (docs/FORMAT.md, version 4).

    Attributes:
        num_rows: global rows N of the logical table (every process reports the same N).
        owned_rows: this process's ``[start, end)`` row ranges, sorted, non-overlapping, non-empty,
            inside ``[0, num_rows)``. Empty when this process holds no rows of the table.
        columns: ``(c0, c1)``, the ``[c0, c1)`` range of the last dimension of every column-split
            slot that this process holds, or ``None`` for all columns.
        replicated: every process holds the same rows (a data-parallel table). Such a table is
            written by one process only and loaded by every process.
        column_blocks: the ``[c0, c1)`` column ranges that the processes of a column-split plan hold,
            sorted and partitioning ``[0, D)``, the same on every process (a process with rows holds
            one of them as ``columns``; one holding several is a table with :class:`ColumnPieces`);
            ``None`` when every process holds whole rows. The saver writes one column block per range
            (docs/FORMAT.md, Column blocks).

    Construction normalises ranges to tuples of Python ints and raises
    :class:`~recckpt.errors.InvalidArgumentError` (a ``ValueError`` and ``TypeError``) for a
    non-int, negative, empty, overlapping, unsorted or out-of-range row range, or a column range
    with ``c0 < 0`` or ``c1 <= c0``.
    """

    num_rows: int
    owned_rows: Tuple[Tuple[int, int], ...]
    columns: "Tuple[int, int] | None" = None
    replicated: bool = False
    column_blocks: "Tuple[Tuple[int, int], ...] | None" = None

    def __post_init__(self) -> None:
        n = _as_int(self.num_rows, "RowRangeLayout.num_rows")
        if n < 0:
            raise InvalidArgumentError(f"RowRangeLayout.num_rows must be >= 0, got {n}")
        object.__setattr__(self, "num_rows", n)
        if isinstance(self.owned_rows, (str, bytes)) or not hasattr(self.owned_rows, "__iter__"):
            raise InvalidArgumentError(
                f"RowRangeLayout.owned_rows must be a sequence of (start, end) pairs, got {self.owned_rows!r}"
            )
        ranges = []
        prev_end = 0
        for r in self.owned_rows:
            lo, hi = _as_range(r, "RowRangeLayout.owned_rows entry")
            if not 0 <= lo < hi <= n:
                raise InvalidArgumentError(
                    f"RowRangeLayout.owned_rows: range [{lo}, {hi}) must be non-empty and inside [0, {n})"
                )
            if lo < prev_end:
                raise InvalidArgumentError(
                    f"RowRangeLayout.owned_rows must be sorted and non-overlapping, got {tuple(self.owned_rows)!r}"
                )
            prev_end = hi
            ranges.append((lo, hi))
        object.__setattr__(self, "owned_rows", tuple(ranges))
        if self.columns is not None:
            c0, c1 = _as_range(self.columns, "RowRangeLayout.columns")
            if c0 < 0 or c1 <= c0:
                raise InvalidArgumentError(
                    f"RowRangeLayout.columns must be [c0, c1) with 0 <= c0 < c1, got {self.columns!r}"
                )
            object.__setattr__(self, "columns", (c0, c1))
        if not isinstance(self.replicated, bool):
            raise InvalidArgumentError(f"RowRangeLayout.replicated must be a bool, got {self.replicated!r}")
        if self.column_blocks is not None:
            blocks, end = [], 0
            for b in self.column_blocks:
                c0, c1 = _as_range(b, "RowRangeLayout.column_blocks entry")
                if c0 != end or c1 <= c0:
                    raise InvalidArgumentError(f"RowRangeLayout.column_blocks must be sorted non-empty ranges "
                                               f"partitioning [0, D), got {self.column_blocks!r}")
                blocks.append((c0, c1))
                end = c1
            if not blocks or self.replicated or (self.owned_rows and self.columns not in blocks):
                raise InvalidArgumentError(
                    f"RowRangeLayout.column_blocks {self.column_blocks!r}: needs at least one block, no "
                    f"replication, and this process's columns {self.columns!r} among them when it holds rows")
            object.__setattr__(self, "column_blocks", tuple(blocks))

    @property
    def owned_count(self) -> int:
        """Number of rows this process holds (the sum of its ranges' lengths)."""
        return sum(hi - lo for lo, hi in self.owned_rows)


@runtime_checkable
class FixedSize(Protocol):
    """Optional extension of :class:`SparseState` for tables of fixed size whose ids are row indices
    0..N-1 and whose rows (and columns) a sharding plan assigns to processes (TorchRec's tables).

    ``sparse_meta()`` gives the LOGICAL slot shapes (full embedding dim D) and ``num_rows`` = the rows
    this process holds; ``export_chunks``/``import_rows`` use global row ids, and when ``columns`` is
    set they carry only columns [c0, c1) of column-split slots (:func:`column_split_slots`), shape
    ``[n, c1 - c0]``. A loader gives each process the rows of its ``owned_rows`` (all rows when
    ``replicated``); ``clear_rows`` cannot remove rows of such a table (a load overwrites them). A replacing
    load that leaves some of its slots out (``exclude: ["sparse_opt"]``) calls ``reset_slots(slots)`` right
    after ``clear_rows``: it sets those slots of every row the process holds to their initial value, as an
    emptied table's new rows would have. A table without ``reset_slots`` is refused such a load before
    anything is applied."""

    def row_layout(self) -> RowRangeLayout: ...


@runtime_checkable
class ColumnPieces(Protocol):
    """Optional extension of :class:`FixedSize` for a process that holds several column ranges of a
    column-split table (TorchRec's column-wise plans put several column shards of a table on one rank,
    adjacent or not, each with its own per-row optimizer state).

    :meth:`column_pieces` gives one :class:`FixedSize` view per range, in column order, each with one
    ``columns`` range among ``column_blocks`` and the table's ``sparse_meta()``; the saver writes each as
    its own column block and the loader fills each with its columns. The table itself answers the calls
    that concern all its rows (``clear_rows``, ``reset_slots``, change marks); its ``row_layout()`` may
    refuse, since no one range describes it. Use :func:`pieces_of` rather than calling this directly."""

    def column_pieces(self) -> Sequence[Any]: ...


def pieces_of(table: Any) -> Sequence[Any]:
    """The views a fixed-size table's rows are saved and loaded through: its :meth:`ColumnPieces.column_pieces`
    when it has more than one, else the table itself. One home for the rule, shared by the saver, the
    snapshot and the loader."""
    if implements(table, ColumnPieces):
        pieces = list(table.column_pieces())
        if len(pieces) > 1:
            return pieces
    return [table]


@runtime_checkable
class LendsRows(Protocol):
    """Optional extension of :class:`FixedSize`: the table lends its live storage, so a load reads rows
    from the shard files straight into it (no staging buffer, no second copy, no per-table Python over
    rows). A load uses it only when the checkpoint's slot dtypes and shapes are the table's.

    :meth:`row_views` gives, for every range of ``row_layout().owned_rows`` in order, ``(first row,
    {slot: view})``: each view a C-contiguous CPU tensor ``[rows, *slot shape]`` (logical shapes: the
    process holds every column of these rows) aliasing the storage training reads. It returns None when
    it cannot lend every owned range whole (column-split slots, storage that is not contiguous, another
    device); the loader then imports rows through ``import_rows``. After writing rows ``[row0, row0 +
    rows)`` into the views the loader calls :meth:`rows_loaded`, so that change tracking counts them."""

    def row_views(self, slots: Sequence[str]) -> "list[tuple[int, Dict[str, torch.Tensor]]] | None": ...

    def rows_loaded(self, row0: int, rows: int) -> None: ...


@dataclass(frozen=True)
class Admission:
    """How a :class:`RoutedRows` table admits a checkpoint's ids (from the load's `LoadConfig`).

    Attributes:
        overflow: ``"error"``: a process routed more ids than it holds fails the load (naming the table
            and the counts); ``"evict"``: each keeps the ids ranked highest.
        rank_by: the checkpoint slot (one value per row) whose highest values are admitted first when
            there are more ids than room (ties: the smaller id); it implies ``overflow="evict"``. None:
            the table's own eviction policy ranks them (:meth:`RoutedRows.plan_slots`).
        strict: ids the table cannot hold at all (e.g. outside its input range): refuse the load
            (True) or leave them out and report them (False).
    """
    overflow: str = "error"
    rank_by: "str | None" = None
    strict: bool = True


@dataclass(frozen=True)
class Admitted:
    """What :meth:`RoutedRows.plan_rows` decided, for the load's report (`LoadResult.admission`): over
    the whole table (every process counts every id alike), ids ``admitted``, ids ``left_out`` for want
    of room, and per reason the ids ``refused`` because the table cannot hold them; ``here``: the ids
    this process keeps."""
    admitted: int
    left_out: int
    refused: Mapping[str, int]
    here: int

    def as_dict(self) -> Dict[str, Any]:
        return {"admitted": self.admitted, "left_out": self.left_out, "refused": dict(self.refused),
                "here": self.here}


@runtime_checkable
class RoutedRows(Protocol):
    """Optional extension of :class:`SparseState` for a table that routes ids to processes by its own
    rule and holds at most a fixed number of them per process (TorchRec's managed-collision tables:
    raw ids routed by range, each shard with its own slots).

    Before anything is applied a loader hands every id of the checkpoint's table (with the slots
    :meth:`plan_slots` names that the checkpoint has, or the slot ``rank_by`` names, for the buckets
    that can hold this process's ids: see :meth:`id_space`; other ids come without slots) to
    :meth:`plan_rows`, which decides which ids this process keeps as :class:`Admission`
    says, and raises :class:`~recckpt.errors.IncompatibleCheckpointError` (naming the table and the
    counts) when they do not fit and ``overflow`` is ``"error"``, or when ids it cannot hold are found
    under ``strict``. Then, while applying, ``clear_rows`` installs the planned ids, ``reset_slots(slots)``
    (as for :class:`FixedSize`) starts the slots the load leaves out over in the rows of those ids, and
    :meth:`import_rows` gets only the rows :meth:`keep` selects."""

    def plan_slots(self) -> Sequence[str]:
        """Slots (besides the ids) :meth:`plan_rows` needs to rank ids for eviction by its own policy."""
        ...

    def plan_rows(self, chunks: Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]],
                  loaded_slots: Sequence[str], admission: Admission) -> Admitted:
        """See every ``(ids, columns)`` of the checkpoint's table once (a chunk holding none of the ids
        of :meth:`owned_ids` may come with no columns); decide which ids this process keeps.
        ``loaded_slots`` are the slots the load will import."""
        ...

    def keep(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask over ``ids``: the rows this process keeps (as planned)."""
        ...

    def id_space(self) -> int:
        """H > 0 when the table's ids lie in [0, H) and processes own contiguous ranges of it: the saver
        then buckets the table "id_range" over [0, H) (docs/FORMAT.md), so that a loader reads only the
        buckets of its range. 0: "hash" buckets."""
        ...

    def owned_ids(self) -> Tuple[int, int] | None:
        """The ids [a, b) this process can keep (its range of the id space), or None for any id."""
        ...


_MEMBERS: Dict[type, Tuple[Tuple[str, bool], ...]] = {}
_CLASS_IMPLEMENTS: set = set()   # (class, protocol): the class itself defines every method
_CLASS_LACKS: Dict[tuple, tuple] = {}   # (class, protocol) -> the members the class does not define


def implements(obj: Any, proto: type) -> bool:
    """``isinstance(obj, proto)`` for the runtime-checkable protocols of this module (all of them have
    only methods), by typing's rule: the class names the protocol as a base or defines every method
    (not as None), or the object itself has every method (none set to None). The members are listed
    once per protocol; typing lists them again on every check, walking the protocol's bases: about
    15 us a call, asked several times per table by every save, snapshot and load of a thousand tables."""
    if isinstance(obj, torch.Tensor):
        return False
    cls = type(obj)
    if proto in cls.__mro__:
        return True
    members = _MEMBERS.get(proto)
    if members is None:
        names = set()
        for base in proto.__mro__:
            if base in (object, Protocol) or base.__module__ == "typing":
                continue
            names |= {n for n in list(vars(base)) + list(getattr(base, "__annotations__", {}))
                      if not n.startswith("_")}
        members = _MEMBERS[proto] = tuple((n, callable(getattr(proto, n, None))) for n in sorted(names))
    if (cls, proto) in _CLASS_IMPLEMENTS:
        return True
    lacks = _CLASS_LACKS.get((cls, proto))
    if lacks is None:
        lacks = tuple((name, method) for name, method in members if not (method and _class_defines(cls, name)))
        _CLASS_LACKS[(cls, proto)] = lacks
        if not lacks:
            _CLASS_IMPLEMENTS.add((cls, proto))   # classes do not drop their methods
            return True
    # What the class lacks decides it in the common case (a HashTable is not FixedSize), without asking
    # the object for every other member first; only an object that has those asks for the rest.
    for name, method in lacks:
        if not _has(obj, name):
            return False
    for name, method in lacks + members:
        if not hasattr(obj, name) or (method and getattr(obj, name) is None):
            return False
    return True


def _has(obj: Any, name: str) -> bool:
    """`hasattr(obj, name)` for a name its class does not define. A torch module's own `__getattr__`
    answers a missing name with an exception (several microseconds, for each of a thousand tables,
    several times a save or load); its lookup (submodules, parameters, buffers) is asked directly."""
    d = getattr(obj, "__dict__", None)
    if d is not None and name in d:
        return True
    if d is not None and getattr(type(obj), "__getattr__", None) is torch.nn.Module.__getattr__:
        return any(name in (d.get(k) or ()) for k in ("_parameters", "_buffers", "_modules"))
    return hasattr(obj, name)


def _class_defines(cls: type, name: str) -> bool:
    for base in cls.__mro__:
        if name in vars(base):
            return vars(base)[name] is not None
    return False


def column_split_slots(meta: SparseTableMeta) -> Tuple[str, ...]:
    """The slots of a fixed-size table that a column-wise plan splits along their last dim: those of
    shape ``(D,)`` where ``D`` is the embedding's dim (the embedding, elementwise optimizer state).
    One home for the rule, shared by the saver, the loader and the adapters."""
    emb = meta.slots.get("embedding")
    if emb is None or len(emb.shape) != 1:
        return ()
    d = emb.shape[0]
    return tuple(k for k, s in meta.slots.items() if len(s.shape) == 1 and s.shape[0] == d)


#: The key suffix under which ``torch.nn.Module.state_dict()`` stores ``get_extra_state()``.
_EXTRA_STATE_SUFFIX = "_extra_state"


def split_sparse_dense_state_dict(
    state_dict: Mapping[str, Any],
) -> Tuple[Dict[str, SparseState], Dict[str, Any]]:
    """Split a ``state_dict`` into sparse tables and everything else.

    Returns ``(sparse, dense)``. Every value that implements :class:`SparseState` goes to
    ``sparse`` under its table name (``value.sparse_meta().name``), not under its state_dict key;
    every other entry goes to ``dense`` under its original key, unchanged and in the original
    order. The input mapping is not modified. Two tables with the same name raise
    ``InvalidArgumentError`` naming both state_dict keys. One table object reachable under two keys
    (a table shared by two modules, as torch shares a module between towers) is one table: it is
    saved and loaded once, and neither key's parameters are dense state.

    A table found as a module's extra state (key ``<prefix>_extra_state``) owns that module's own
    parameters and buffers (keys ``<prefix><name>`` with no further dot): they are its storage,
    saved and loaded through the protocol, so they are left out of ``dense``. Saving them as dense
    state too would store the table twice, and on load the dense copy would overwrite the rows
    just loaded. A submodule's entries (``<prefix><child>.<name>``) stay dense.
    """
    sparse: Dict[str, SparseState] = {}
    sparse_keys: Dict[str, str] = {}
    table_prefixes = set()
    shared_keys = set()   # further keys of a table already taken
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor) and implements(value, SparseState):
            name = value.sparse_meta().name
            if sparse.get(name) is value:
                shared_keys.add(key)
            elif name in sparse:
                raise InvalidArgumentError(
                    f"two sparse tables named {name!r} in the state_dict: keys "
                    f"{sparse_keys[name]!r} and {key!r}; give every table a unique name"
                )
            else:
                sparse[name] = value
                sparse_keys[name] = key
            if key.endswith(_EXTRA_STATE_SUFFIX):
                table_prefixes.add(key[: -len(_EXTRA_STATE_SUFFIX)])
    table_keys = set(sparse_keys.values()) | shared_keys
    dense: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key in table_keys or _owned_by_table(key, table_prefixes):
            continue
        dense[key] = value
    return sparse, dense


def _owned_by_table(key: str, table_prefixes: set) -> bool:
    """True for a direct parameter or buffer of a module whose extra state is a sparse table."""
    prefix, _, _leaf = key.rpartition(".")
    return (prefix + "." if prefix else "") in table_prefixes
