"""A HashTable's rows: the id map, the id and slot storage, its growth, and the slots themselves.

:class:`RowStore` owns everything that decides *where* a row lives: the engine's ``IdMap`` (id ->
row, rows assigned densely in insertion order), the host ``int64`` ids in row order, one
C-contiguous ``[capacity, *shape]`` tensor per slot on the table's device, each slot's
:class:`SlotSpec` and init, the geometric growth (x1.5) of all of them together, and a version that
every modification bumps (running exports check it). It does not know about gradients, counters or
checkpoints. Rows carry one more column that is not a slot, the change stamps of
:mod:`.changes`: the store tells that log when rows are allocated, created or moved, and the log
decides what the stamps mean.
"""
from __future__ import annotations

import numbers
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from recckpt import _C
from recckpt.state.protocol import SlotSpec

from ...errors import InvalidArgumentError
from .changes import ChangeLog

#: Name of the embedding slot (always the first slot of a HashTable).
EMBEDDING = "embedding"

SlotInit = Union[float, Callable[[torch.Tensor], object]]


def unique_inverse(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(unique values in first-occurrence order, inverse) of a 1-D int64 CPU tensor, hash based."""
    local = _C.IdMap(x.numel())
    inv, is_new = local.insert(x.numpy())
    return x[torch.from_numpy(is_new)], torch.from_numpy(inv)


def flat_ids(ids: torch.Tensor, what: str, table: str) -> torch.Tensor:
    """``ids`` checked to be an int64 tensor and flattened into a contiguous host tensor."""
    if not isinstance(ids, torch.Tensor):
        raise InvalidArgumentError(f"table {table!r}: {what} must be a torch.Tensor, got {type(ids)}")
    if ids.dtype != torch.int64:
        raise InvalidArgumentError(f"table {table!r}: {what} must be int64, got {ids.dtype}")
    return ids.detach().reshape(-1).cpu().contiguous()


def check_rows_arg(table: str, what: str, value: object, lo: int) -> int:
    """``value`` as an int >= ``lo`` (bools refused), or the error naming the table and argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise InvalidArgumentError(f"table {table!r}: {what} must be an int >= {lo}, got {value!r}")
    return int(value)


#: Host storage of at least this many bytes starts on a page boundary (`empty_rows`).
ALIGN_FROM_BYTES = 1 << 20
PAGE = 4096


def empty_rows(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised ``shape`` storage; on the host, from ``ALIGN_FROM_BYTES`` up, starting on a page
    boundary (torch's allocator only promises 64 bytes): a cold load then reads its rows from the device
    straight into it (O_DIRECT needs block-aligned memory; docs/ENGINE.md, Direct reads), where otherwise
    they would go through a bounce buffer and one more copy. Costs at most a page of memory a column."""
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * dtype.itemsize   # (no scratch tensor to ask: a load of a thousand tables asks four times each)
    if nbytes < ALIGN_FROM_BYTES or torch.device(device).type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip:skip + nbytes].view(dtype).view(tuple(shape))


def init_rows(view: torch.Tensor, init: SlotInit) -> None:
    """Fill new rows of a slot with its init: a number, or a callable filling a tensor in place."""
    if view.numel() == 0 and view.shape[0] == 0:
        return
    if callable(init):
        init(view)
    else:
        view.fill_(init)


def table_device(name: str, device: Union[str, torch.device]) -> torch.device:
    """The device a table's slots live on, with the index made explicit (``"cuda"`` -> the current
    CUDA device), so that comparing devices later is exact."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"HashTable {name!r}: device must be a torch device or its name, "
                         f"got {device!r} ({e})") from None
    if dev.type == "meta":
        raise InvalidArgumentError(f"HashTable {name!r}: device 'meta' holds no data; use 'cpu' or a CUDA device")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"HashTable {name!r}: device {device!r} asked for, but torch sees no CUDA device; "
                             f"use device='cpu' on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class RowStore:
    """The id map and the storage of one table (see the module docstring).

    Attributes (shared by the table's parts; only this class reallocates or reorders them):
        table: the table's name, for errors.
        device: where the slots live; the map and ids stay on the host.
        specs, inits: each slot's :class:`SlotSpec` and init, in slot order (``"embedding"`` first).
        columns: slot name -> ``[capacity, *shape]`` tensor; rows ``[0, size)`` are the table.
        ids: host ``int64[capacity]``; ``ids[i]`` is the id of row ``i``.
        map: the engine's ``IdMap`` over ``ids[:size]``.
        capacity, size: rows allocated, rows in use.
        version: bumped by every modification (exports and bulk appends check it).
        change_log: the table's :class:`~.changes.ChangeLog`, told about new and moved rows.
    """

    def __init__(self, table: str, device: torch.device, specs: Dict[str, SlotSpec], inits: Dict[str, SlotInit],
                 columns: Dict[str, torch.Tensor], ids: torch.Tensor, size: int, change_log: ChangeLog,
                 version: int = 0) -> None:
        self.table = table
        self.device = device
        self.specs = specs
        self.inits = inits
        self.columns = columns
        self.ids = ids
        self.capacity = int(ids.numel())
        self.size = int(size)
        self.change_log = change_log
        self.version = version
        self.map = _C.IdMap(self.capacity)
        if self.size:
            self.map.insert(ids[: self.size].numpy())

    @classmethod
    def empty(cls, table: str, device: torch.device, spec: SlotSpec, init: SlotInit, capacity: int,
              change_log: ChangeLog) -> "RowStore":
        """A store with the embedding slot only and room for ``capacity`` rows."""
        with torch.inference_mode(False):  # see realloc
            columns = {EMBEDDING: empty_rows((capacity, *spec.shape), spec.dtype, device)}
            ids = empty_rows((capacity,), torch.int64, "cpu")
        return cls(table, device, {EMBEDDING: spec}, {EMBEDDING: init}, columns, ids, 0, change_log)

    def modified(self) -> None:
        """Record a modification: views handed out by a running export stop being valid."""
        self.version += 1

    # ------------------------------------------------------------------ slots
    def check_slot(self, name: str) -> None:
        if name not in self.specs:
            raise InvalidArgumentError(
                f"table {self.table!r}: no slot {name!r} (slots: {', '.join(self.specs)})"
            )

    def add_slot(self, name: str, spec: SlotSpec, init: SlotInit) -> None:
        """A new column with every row in use initialised to ``init``."""
        with torch.inference_mode(False):  # see realloc
            data = empty_rows((self.capacity, *spec.shape), spec.dtype, self.device)
            init_rows(data[: self.size], init)
        self.specs[name] = spec
        self.inits[name] = init
        self.columns[name] = data
        self.modified()

    def init_new_rows(self, old: int, new: int, skip: Sequence[str] = ()) -> None:
        """Initialise rows ``[old, new)`` of every slot not in ``skip``; on failure forget them."""
        try:
            for k, data in self.columns.items():
                if k not in skip:
                    init_rows(data[old:new], self.inits[k])
        except BaseException:
            self.rollback(old)
            raise

    # ------------------------------------------------------------------ growth
    def reserve(self, rows: int) -> None:
        """Make room for at least ``rows`` rows in total without further reallocation."""
        if rows > self.capacity:
            self.realloc(int(rows))

    def grow_for(self, rows: int) -> None:
        """Make room for ``rows`` rows, growing geometrically so that inserts stay amortised O(1)."""
        if rows > self.capacity:
            self.realloc(max(rows, self.capacity + self.capacity // 2, 64))

    def realloc(self, cap: int) -> None:
        n = self.size
        new_columns = {}
        # Storage must be normal tensors even when growth happens under torch.inference_mode()
        # (inference tensors cannot be updated in place outside it, e.g. by an optimizer step).
        with torch.inference_mode(False):
            for k, t in self.columns.items():
                nt = empty_rows((cap, *t.shape[1:]), t.dtype, t.device)
                if n:   # (an emptied table being loaded: nothing to copy, a call per slot saved)
                    nt[:n].copy_(t[:n])
                new_columns[k] = nt
            new_ids = empty_rows((cap,), torch.int64, "cpu")
            if n:
                new_ids[:n].copy_(self.ids[:n])
            self.change_log.resize(cap, n)
        self.map.reserve(cap)
        self.columns, self.ids, self.capacity = new_columns, new_ids, cap
        self.modified()

    # ------------------------------------------------------------------ insertion and removal
    def rollback(self, size: int) -> None:
        """Forget rows >= size (after a failure part-way through an insertion)."""
        self.size = size
        self.map.clear()
        if size:
            self.map.insert(self.ids[:size].numpy())
        self.modified()

    def insert_raw(self, ids: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
        """Insert ``ids`` (1-D contiguous int64, repeats allowed) into the map, grow the storage
        and record the new ids. Returns (rows, old_size, new_size); rows ``[old, new)`` are new
        and NOT initialised: the caller initialises them or calls ``rollback(old)``."""
        old = self.size
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64), old, old
        rows_np, is_new_np = self.map.insert(ids.numpy())
        rows = torch.from_numpy(rows_np)
        new = len(self.map)
        if new != old:
            try:
                self.grow_for(new)
                self.ids[old:new] = ids[torch.from_numpy(is_new_np)]
                self.change_log.stamp_range(old, new)
            except BaseException:
                self.rollback(old)
                raise
            self.size = new
            self.modified()
        return rows, old, new

    def insert(self, ids: torch.Tensor) -> torch.Tensor:
        """Insert ids and initialise every slot of the new rows; returns the rows of ``ids``."""
        rows, old, new = self.insert_raw(ids)
        if new != old:
            self.init_new_rows(old, new)
        return rows

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (1-D contiguous host int64), -1 where absent."""
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        return torch.from_numpy(self.map.lookup(ids.numpy()))

    def keep_rows(self, kept: torch.Tensor) -> None:
        """Keep only rows ``kept`` (increasing), moved down to stay dense; the map is rebuilt."""
        k = kept.numel()
        for t in [*self.columns.values(), self.ids]:
            t[:k] = t.index_select(0, kept)
        self.change_log.keep(kept)
        self.size = k
        self.map.clear()
        if k:
            self.map.insert(self.ids[:k].numpy())
        self.modified()

    def clear(self) -> None:
        """Remove every id; the storage (capacity) is kept."""
        self.map.clear()
        self.size = 0
        self.modified()

    def replace(self, id_map, ids: torch.Tensor, columns: Dict[str, torch.Tensor], size: int) -> None:
        """Take ``ids`` and ``columns`` (every slot, ``ids.numel()`` rows) as the storage, the first
        ``size`` rows in use and already in ``id_map``."""
        self.map, self.columns, self.ids, self.capacity, self.size = id_map, columns, ids, ids.numel(), size
        self.modified()

    # ------------------------------------------------------------------ views for exports
    def check_version(self, version: int) -> None:
        if self.version != version:
            raise RuntimeError(f"table {self.table!r} was modified while export_chunks was being iterated")

    def chunks(self, slots: List[str], max_rows: int, version: int, rows: Optional[torch.Tensor] = None
               ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """``max_rows`` rows at a time: zero-copy views of rows ``[0, size)`` in order, or copies of
        ``rows`` when given; raises if the store is modified (``version``) while iterated."""
        if rows is None:
            n = self.size
            for start in range(0, n, max_rows):
                self.check_version(version)
                end = min(n, start + max_rows)
                yield self.ids[start:end], {s: self.columns[s][start:end] for s in slots}
        else:
            for start in range(0, rows.numel(), max_rows):
                self.check_version(version)
                r = rows[start:start + max_rows]
                yield self.ids.index_select(0, r), {s: self.columns[s].index_select(0, r) for s in slots}
        # Also after the last chunk: a consumer that reads every chunk and asks for the next one
        # learns that the last chunk's views changed while it held them.
        self.check_version(version)
