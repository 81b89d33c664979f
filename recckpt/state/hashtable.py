"""``HashTable``: a growable embedding table keyed by arbitrary int64 ids.

The table is the reference implementation of :class:`~recckpt.state.protocol.SparseState`.

Storage
    One C-contiguous tensor per slot on the table's ``device``, with ``capacity`` rows
    (``[capacity, *shape]``), plus a host ``int64`` tensor of ids in row order: row ``i`` of every
    slot belongs to ``ids[i]``, the ``i``-th distinct id inserted (the engine's ``recckpt._C.IdMap``
    assigns rows densely in insertion order).
    All slots grow together, geometrically (x1.5), when new ids need more rows. Rows are never
    removed one by one; :meth:`HashTable.clear_rows` removes all of them.

Device
    Slots (embedding and optimizer state) live on ``device``; the id map and the ids stay on the
    host, where ids arrive from the data loader (docs/SPARSE_STATE.md, "Tables on a device"). A
    lookup maps ids to row numbers on the host and moves those to the device; gathers, gradients
    and optimizer updates are torch ops on the device. ``export_chunks`` yields host ids with
    device columns (the saver stages them to the host, :mod:`recckpt.state.staging`).

Gradients
    Embeddings are not ``nn.Parameter``s, so a dense optimizer over ``model.parameters()`` never
    sees them. In a forward pass with autograd enabled the unique rows looked up are gathered into
    a fresh leaf tensor (in the table's compute dtype, float32 for low-precision tables) that
    requires grad; the output is gathered from that leaf and cast to the embedding dtype. When
    ``backward()`` reaches the leaf, a post-accumulate-grad hook moves its gradient (one row per
    unique looked-up row, duplicates already summed by autograd) onto the table as a pending
    ``(rows, grad)`` pair and clears ``leaf.grad``. Several forwards/backwards before an optimizer
    step accumulate (pairs are summed per row when read). Sparse optimizers
    (:mod:`recckpt.state.optim`) consume the pending pairs in ``step()``.
"""
from __future__ import annotations

import numbers
import weakref
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from recckpt import _C
from recckpt.state import initializers
from recckpt.state.eviction import FREQ, LAST_STEP
from recckpt.state.protocol import Changes, SlotSpec, SparseState, SparseTableMeta

from ..errors import InvalidArgumentError

__all__ = ["HashTable", "EMBEDDING", "FREQ", "LAST_STEP"]

#: Name of the embedding slot (always the first slot of a HashTable).
EMBEDDING = "embedding"

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

SlotInit = Union[float, Callable[[torch.Tensor], object]]


#: dtype of the change-tracking stamps: one generation number a row (a mark per save fits 2**31 saves);
#: 4 bytes rather than 8 keeps the stamps of a training step's random rows in fewer cache lines.
_STAMP_DTYPE = torch.int32


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def _unique_inverse(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(unique values in first-occurrence order, inverse) of a 1-D int64 CPU tensor, hash based."""
    local = _C.IdMap(x.numel())
    inv, is_new = local.insert(_np(x))
    return x[torch.from_numpy(is_new)], torch.from_numpy(inv)


def _table_device(name: str, device: Union[str, torch.device]) -> torch.device:
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


#: Rows per host-to-device copy when a device table adopts host storage (bounds the transient
#: device memory of one copy step, not the table).
_ADOPT_COPY_ROWS = 1 << 16


class HashTable(nn.Module):
    """An embedding table over arbitrary int64 ids that grows as new ids arrive.

    Args:
        name: the table's name, unique among the tables of a checkpoint (the key it is saved and
            loaded under).
        dim: embedding dimension (>= 1).
        dtype: floating dtype of the embedding (float32, bfloat16, float16 or float64).
        initializer: callable filling a tensor of new embedding rows in place, like the
            ``torch.nn.init`` functions (see :mod:`recckpt.state.initializers`). ``None`` means
            the default ``initializers.normal(0.0, 0.01)``.
        capacity: number of rows to allocate up front.
        counters: keep the per-row counters ``freq`` (int64: lookups in training mode) and
            ``last_step`` (int64: the value of :attr:`step` when the row was inserted or last
            written) as slots of category ``"sparse"``, saved with the table; eviction policies
            (:mod:`recckpt.state.eviction`) read them. Set :attr:`step` every training step.
        track_changes: keep a per-row change stamp (8 bytes a row) and a log of removed ids, so
            that an incremental save writes only the rows changed since its parent (see
            :meth:`mark_changes`). ``False`` saves the table in full in every checkpoint.
        device: where the slots live (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``); the
            id map stays on the host. ``"cuda"`` means the current CUDA device.

    Calling the table (``table(ids)``) maps int64 ids of any shape and any value to embeddings of
    shape ``[*ids.shape, dim]`` in the embedding dtype:

    * in training mode (``table.train()``, the default) unseen ids are inserted and their rows
      initialised (the embedding by the initializer, every other slot by its init value) -- also
      under ``torch.no_grad()``;
    * in eval mode (``table.eval()``) unseen ids are *not* inserted and their output rows are zeros
      (no gradient is recorded for them).

    When autograd is enabled the output requires grad and ``backward()`` records gradients for the
    looked-up rows on the table (see the module docstring); use :class:`recckpt.state.optim.SparseAdagrad`
    or :class:`~recckpt.state.optim.SparseAdam` to apply them. Slots live on ``device``; ids on
    another device are copied to the host (for the id map) and the output is moved to the ids'
    device. ``Module.to()``/``.half()`` do not affect the table.

    ``model.state_dict()`` holds the table itself under ``<prefix>_extra_state`` (see
    :meth:`get_extra_state`), which is how recckpt finds it.
    """

    def __init__(
        self,
        name: str,
        dim: int,
        dtype: torch.dtype = torch.float32,
        initializer: Optional[Callable[[torch.Tensor], object]] = None,
        capacity: int = 0,
        *,
        counters: bool = False,
        track_changes: bool = True,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        super().__init__()
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"HashTable: name must be a non-empty str, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
            raise InvalidArgumentError(f"HashTable {name!r}: dim must be an int >= 1, got {dim!r}")
        if dtype not in _FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"HashTable {name!r}: dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 0:
            raise InvalidArgumentError(f"HashTable {name!r}: capacity must be an int >= 0, got {capacity!r}")
        if initializer is None:
            initializer = initializers.default()
        if not callable(initializer):
            raise InvalidArgumentError(f"HashTable {name!r}: initializer must be callable, got {initializer!r}")
        self.device = _table_device(name, device)
        self.name = name
        self.dim = int(dim)
        self.initializer = initializer
        capacity = int(capacity)
        self._specs: Dict[str, SlotSpec] = {EMBEDDING: SlotSpec(dtype, (self.dim,), "sparse")}
        self._inits: Dict[str, SlotInit] = {EMBEDDING: initializer}
        with torch.inference_mode(False):  # see _realloc
            self._data: Dict[str, torch.Tensor] = {
                EMBEDDING: torch.empty(capacity, self.dim, dtype=dtype, device=self.device)}
            self._ids = torch.empty(capacity, dtype=torch.int64)
        self._capacity = capacity
        self._size = 0
        self._map = _C.IdMap(capacity)
        # Pending gradients: list of (rows int64[k] unique, grad [k, dim] in compute_dtype).
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._version = 0  # bumped by every modification (checked by export_chunks)
        self._epoch = 0  # bumped by clear_rows: gradients recorded before it are dropped
        # Change tracking: row i was last written in generation _stamps[i]; mark_changes() closes
        # the current generation. Removed ids are logged with the generation they left in.
        if not isinstance(track_changes, bool):
            raise InvalidArgumentError(f"HashTable {name!r}: track_changes must be a bool, got {track_changes!r}")
        self._gen = 1
        self._valid_from = 0  # marks older than this cannot describe the changes (cleared, slot added)
        self._removed_log: List[Tuple[int, torch.Tensor]] = []
        with torch.inference_mode(False):
            self._stamps: Optional[torch.Tensor] = (torch.zeros(capacity, dtype=_STAMP_DTYPE)
                                                    if track_changes else None)
        #: The training step, as the user sets it; ``last_step`` records it (with ``counters``).
        self.step = 0
        self._counters = False
        if not isinstance(counters, bool):
            raise InvalidArgumentError(f"HashTable {name!r}: counters must be a bool, got {counters!r}")
        if counters:
            self.enable_counters()

    # ------------------------------------------------------------------ basic properties
    @property
    def dtype(self) -> torch.dtype:
        """dtype of the embedding slot."""
        return self._specs[EMBEDDING].dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype gradients and optimizer updates are computed in: float64 for a float64 table,
        else float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def capacity(self) -> int:
        """Number of rows allocated (>= ``len(self)``)."""
        return self._capacity

    def __len__(self) -> int:
        """Number of ids (rows) in the table."""
        return self._size

    def __bool__(self) -> bool:  # a Module is truthy even when the table is empty
        return True

    @property
    def slot_names(self) -> List[str]:
        """Slot names in order (``"embedding"`` first)."""
        return list(self._specs)

    def slot_spec(self, name: str) -> SlotSpec:
        """The :class:`SlotSpec` of slot ``name``."""
        self._check_slot(name)
        return self._specs[name]

    def slot(self, name: str) -> torch.Tensor:
        """Live view ``[len(self), *shape]`` of slot ``name``, row ``i`` belonging to ``ids()[i]``.

        Writes through the view change the table (e.g. counters). The view is invalidated (stops
        aliasing the table) when the table grows or is cleared.
        """
        self._check_slot(name)
        return self._data[name][: self._size]

    @property
    def weight(self) -> torch.Tensor:
        """Live view of the embedding slot, ``[len(self), dim]`` (same caveats as :meth:`slot`)."""
        return self.slot(EMBEDDING)

    def ids(self) -> torch.Tensor:
        """Copy of the ids in row order (``int64[len(self)]``)."""
        return self._ids[: self._size].clone()

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, dim={self.dim}, dtype={self.dtype}, device={self.device}, "
            f"rows={self._size}, capacity={self._capacity}, slots={self.slot_names}, "
            f"initializer={self.initializer!r}"
        )

    def _check_slot(self, name: str) -> None:
        if name not in self._specs:
            raise InvalidArgumentError(
                f"table {self.name!r}: no slot {name!r} (slots: {', '.join(self._specs)})"
            )

    # ------------------------------------------------------------------ slots
    def add_slot(
        self,
        name: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        init: SlotInit = 0.0,
        category: str = "sparse_opt",
        *,
        exist_ok: bool = False,
    ) -> None:
        """Add a per-id column ``name`` with rows of ``shape`` in ``dtype``.

        ``init`` is a number (every row set to it) or a callable filling a tensor of rows in place;
        it initialises the rows of existing ids now and of ids inserted later. ``category`` is
        ``"sparse_opt"`` for optimizer state or ``"sparse"`` for model state such as counters.

        If the slot exists: with ``exist_ok=True`` and the same dtype, shape and category the
        existing values are kept and ``init`` becomes the slot's init for future rows; otherwise
        ``ValueError``.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"table {self.name!r}: slot name must be a non-empty str, got {name!r}")
        spec = SlotSpec(dtype, tuple(shape) if not isinstance(shape, int) else (shape,), category)
        if not callable(init) and (isinstance(init, bool) or not isinstance(init, numbers.Number)):
            raise InvalidArgumentError(
                f"table {self.name!r}: slot {name!r} init must be a number or a callable, got {init!r}"
            )
        if name in self._specs:
            old = self._specs[name]
            if exist_ok and old == spec:
                self._inits[name] = init
                return
            raise InvalidArgumentError(
                f"table {self.name!r}: slot {name!r} already exists as {old}"
                + ("" if not exist_ok else f", requested {spec}")
            )
        with torch.inference_mode(False):  # see _realloc
            data = torch.empty((self._capacity, *spec.shape), dtype=spec.dtype, device=self.device)
            self._init_rows(data[: self._size], init)
        self._specs[name] = spec
        self._inits[name] = init
        self._data[name] = data
        self._version += 1
        self._forget_marks()  # the new column's values are not in any earlier checkpoint

    @staticmethod
    def _init_rows(view: torch.Tensor, init: SlotInit) -> None:
        if view.numel() == 0 and view.shape[0] == 0:
            return
        if callable(init):
            init(view)
        else:
            view.fill_(init)

    # ------------------------------------------------------------------ growth and insertion
    def reserve(self, rows: int) -> None:
        """Make room for at least ``rows`` rows in total without further reallocation."""
        if rows > self._capacity:
            self._realloc(int(rows))

    def _grow_for(self, rows: int) -> None:
        if rows > self._capacity:
            self._realloc(max(rows, self._capacity + self._capacity // 2, 64))

    def _realloc(self, cap: int) -> None:
        n = self._size
        new_data = {}
        # Storage must be normal tensors even when growth happens under torch.inference_mode()
        # (inference tensors cannot be updated in place outside it, e.g. by an optimizer step).
        with torch.inference_mode(False):
            for k, t in self._data.items():
                nt = torch.empty((cap, *t.shape[1:]), dtype=t.dtype, device=t.device)
                nt[:n].copy_(t[:n])
                new_data[k] = nt
            new_ids = torch.empty(cap, dtype=torch.int64)
            new_ids[:n].copy_(self._ids[:n])
            if self._stamps is not None:
                new_stamps = torch.zeros(cap, dtype=_STAMP_DTYPE)
                new_stamps[:n].copy_(self._stamps[:n])
                self._stamps = new_stamps
        self._map.reserve(cap)
        self._data, self._ids, self._capacity = new_data, new_ids, cap
        self._version += 1

    def _rollback(self, size: int) -> None:
        """Forget rows >= size (after a failure part-way through an insertion)."""
        self._size = size
        self._map.clear()
        if size:
            self._map.insert(_np(self._ids[:size]))
        self._version += 1

    def _insert_raw(self, ids: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
        """Insert ``ids`` (1-D contiguous int64, repeats allowed) into the map, grow the storage
        and record the new ids. Returns (rows, old_size, new_size); rows ``[old, new)`` are new
        and NOT initialised: the caller initialises them or calls ``_rollback(old)``."""
        old = self._size
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64), old, old
        rows_np, is_new_np = self._map.insert(_np(ids))
        rows = torch.from_numpy(rows_np)
        new = len(self._map)
        if new != old:
            try:
                self._grow_for(new)
                self._ids[old:new] = ids[torch.from_numpy(is_new_np)]
                if self._stamps is not None:
                    self._stamps[old:new] = self._gen
            except BaseException:
                self._rollback(old)
                raise
            self._size = new
            self._version += 1
        return rows, old, new

    def _insert(self, ids: torch.Tensor) -> torch.Tensor:
        """Insert ids and initialise every slot of the new rows; returns the rows of ``ids``."""
        rows, old, new = self._insert_raw(ids)
        if new != old:
            try:
                for k, t in self._data.items():
                    self._init_rows(t[old:new], self._inits[k])
            except BaseException:
                self._rollback(old)
                raise
        return rows

    @staticmethod
    def _flat_ids(ids: torch.Tensor, what: str, table: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise InvalidArgumentError(f"table {table!r}: {what} must be a torch.Tensor, got {type(ids)}")
        if ids.dtype != torch.int64:
            raise InvalidArgumentError(f"table {table!r}: {what} must be int64, got {ids.dtype}")
        return ids.detach().reshape(-1).cpu().contiguous()

    def lookup(self, ids: torch.Tensor, insert: bool = False) -> torch.Tensor:
        """Rows of ``ids`` (int64, any shape) as an int64 tensor of the same shape, -1 where absent.

        With ``insert=True`` absent ids are inserted (and initialised) first, whatever the mode.
        """
        flat = self._flat_ids(ids, "ids", self.name)
        if insert:
            rows = self._insert(flat)
        elif flat.numel() == 0:
            rows = torch.empty(0, dtype=torch.int64)
        else:
            rows = torch.from_numpy(self._map.lookup(_np(flat)))
        return rows.reshape(ids.shape)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[*ids.shape, dim]`` of int64 ``ids`` (see the class docstring)."""
        flat = self._flat_ids(ids, "ids", self.name)
        n = flat.numel()
        if self.training:
            old = self._size
            rows = self._insert(flat)
            if self._counters and n:
                self._count_lookups(rows, old)
        elif n:
            rows = torch.from_numpy(self._map.lookup(_np(flat)))
        else:
            rows = torch.empty(0, dtype=torch.int64)
        emb = self._data[EMBEDDING]  # after insertion: it may have been reallocated

        if torch.is_grad_enabled():
            uniq, inv = _unique_inverse(rows) if n else (rows, rows)
            values, valid = self._gather_masked(emb, uniq)
            # The leaf is in the compute dtype so that autograd sums the gradients of repeated ids
            # in float32 (a hot id can occur thousands of times in a batch), not in bf16/fp16.
            leaf = values.to(self.compute_dtype).requires_grad_(True)
            # Pending rows stay on the host (coalescing uses the host IdMap); the mask follows them.
            self._attach_grad_hook(leaf, uniq if valid is None else uniq[valid.cpu()], valid)
            out = leaf.index_select(0, inv.to(emb.device)).to(emb.dtype)
        else:
            out, _ = self._gather_masked(emb, rows)
        out = out.view(*ids.shape, self.dim)
        if ids.device != out.device:
            out = out.to(ids.device)
        return out

    def _count_lookups(self, rows: torch.Tensor, old: int) -> None:
        """freq += lookups per row; rows inserted now (>= old) start their last_step at the step."""
        uniq, inv = _unique_inverse(rows)
        self._data[FREQ].index_add_(0, uniq, torch.bincount(inv, minlength=uniq.numel()))
        self._data[LAST_STEP][old:self._size] = self.step
        if self._stamps is not None:  # the counters are part of the row: a looked-up row changed
            self._stamps.index_fill_(0, uniq, self._gen)

    def _gather_masked(
        self, data: torch.Tensor, rows: torch.Tensor
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``data[rows]`` with zero rows where ``rows == -1``; also returns the mask of valid rows
        (None when all are valid)."""
        if rows.numel() == 0:
            return data.new_empty((0, *data.shape[1:])), None
        rows = rows.to(data.device)  # host row numbers -> the storage's device (no-op on CPU)
        valid = rows >= 0
        if bool(valid.all()):
            return data.index_select(0, rows), None
        out = torch.zeros((rows.numel(), *data.shape[1:]), dtype=data.dtype, device=data.device)
        if bool(valid.any()):
            out[valid] = data.index_select(0, rows[valid])
        return out, valid

    def _attach_grad_hook(
        self, leaf: torch.Tensor, rows: torch.Tensor, valid: Optional[torch.Tensor]
    ) -> None:
        table_ref = weakref.ref(self)
        epoch = self._epoch
        cdtype = self.compute_dtype

        def hook(t: torch.Tensor) -> None:
            g = t.grad
            t.grad = None
            table = table_ref()
            if g is None or table is None or table._epoch != epoch:
                return
            if valid is not None:
                g = g[valid]
            table._pending.append((rows, g.detach().to(cdtype).contiguous()))

        leaf.register_post_accumulate_grad_hook(hook)

    # ------------------------------------------------------------------ gradients
    def has_grad(self) -> bool:
        """True when gradients are pending (recorded by backward, not yet consumed)."""
        return bool(self._pending)

    def sparse_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The pending gradient, coalesced, without consuming it.

        Returns ``(rows, grad)``: unique rows (int64[k], in no particular order) and the summed
        gradient of each (``[k, dim]`` in :attr:`compute_dtype`), or ``None`` when nothing is
        pending. Map rows to ids with ``table.ids()[rows]``.
        """
        if not self._pending:
            return None
        return self._coalesce(self._pending)

    def pop_sparse_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Like :meth:`sparse_grad` but also drops the pending gradient (what optimizers call)."""
        out = self.sparse_grad()
        self._pending = []
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop pending sparse gradients (and clear grads of any parameters, as ``Module`` does)."""
        super().zero_grad(set_to_none=set_to_none)
        self._pending = []

    def _coalesce(
        self, pending: List[Tuple[torch.Tensor, torch.Tensor]]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(pending) == 1:  # rows of one backward are already unique
            return pending[0]
        rows = torch.cat([r for r, _ in pending])
        grads = torch.cat([g for _, g in pending])
        if rows.numel() == 0:
            return rows, grads
        uniq, inv = _unique_inverse(rows)
        out = torch.zeros((uniq.numel(), self.dim), dtype=grads.dtype, device=grads.device)
        out.index_add_(0, inv.to(grads.device), grads)
        return uniq, out

    # ------------------------------------------------------------------ row access for optimizers
    def read_rows(self, slot: str, rows: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Copy of slot ``slot`` at ``rows`` (int64[k], each in ``[0, len(self))``, on any device),
        optionally cast; the copy is on the table's device."""
        self._check_slot(slot)
        data = self._data[slot]
        out = data.index_select(0, rows.to(data.device))
        return out if dtype is None else out.to(dtype)

    def write_rows(self, slot: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Set slot ``slot`` at ``rows`` (unique, in range) to ``values`` (cast to the slot dtype)."""
        self.write_slots(rows, {slot: values})

    def write_slots(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Set several slots at the same ``rows`` (unique, in range): ``values`` maps slot names to
        ``[len(rows), *shape]`` tensors (cast to each slot's dtype). What an optimizer step calls: the
        rows are marked changed once, not once per slot."""
        for slot in values:
            self._check_slot(slot)
        for slot, v in values.items():
            data = self._data[slot]
            data.index_copy_(0, rows.to(data.device), v.to(device=data.device, dtype=data.dtype))
        if self._stamps is not None:
            self._stamps.index_fill_(0, rows.to(self._stamps.device), self._gen)
        if self._counters and EMBEDDING in values:
            last = self._data[LAST_STEP]
            last.index_fill_(0, rows.to(last.device), self.step)
        self._version += 1

    # ------------------------------------------------------------------ SparseState
    def sparse_meta(self) -> SparseTableMeta:
        """Name, slots (``"embedding"`` first, then in the order added) and number of rows."""
        return SparseTableMeta(self.name, dict(self._specs), self._size)

    def export_chunks(
        self, slots: Sequence[str], max_rows: int
    ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """Zero-copy views of the storage in row order, ``max_rows`` rows at a time (ids on the
        host, slots on the table's device).

        See :meth:`recckpt.state.protocol.SparseState.export_chunks`. Arguments are checked when
        called; iterating after the table was modified raises ``RuntimeError``.
        """
        slots = list(slots)
        for s in slots:
            self._check_slot(s)
        if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
            raise InvalidArgumentError(f"table {self.name!r}: max_rows must be an int >= 1, got {max_rows!r}")
        return self._export(slots, int(max_rows), self._version)

    def _export(
        self, slots: List[str], max_rows: int, version: int
    ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        n = self._size
        for start in range(0, n, max_rows):
            self._check_export_version(version)
            end = min(n, start + max_rows)
            yield self._ids[start:end], {s: self._data[s][start:end] for s in slots}
        # Also after the last chunk: a consumer that reads every chunk and asks for the next one
        # learns that the last chunk's views changed while it held them.
        self._check_export_version(version)

    def _check_export_version(self, version: int) -> None:
        if self._version != version:
            raise RuntimeError(f"table {self.name!r} was modified while export_chunks was being iterated")

    def import_rows(self, ids: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> None:
        """Upsert rows; see :meth:`recckpt.state.protocol.SparseState.import_rows`.

        Columns on another device are copied to the table's device. Slots not in ``columns`` keep their values
        for ids that already existed and start at their initial value for new ids.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
            raise InvalidArgumentError(f"table {self.name!r}: import_rows ids must be int64 [n], got {got}")
        n = ids.numel()
        for k, col in columns.items():
            if k not in self._specs:
                raise InvalidArgumentError(
                    f"table {self.name!r}: import_rows got unknown slot {k!r} "
                    f"(slots: {', '.join(self._specs)})"
                )
            spec = self._specs[k]
            want = (n, *spec.shape)
            if not isinstance(col, torch.Tensor):
                raise InvalidArgumentError(
                    f"table {self.name!r}, slot {k!r}: expected a tensor of shape {want} "
                    f"dtype {spec.dtype}, got {type(col)}"
                )
            if tuple(col.shape) != want or col.dtype != spec.dtype:
                raise InvalidArgumentError(
                    f"table {self.name!r}, slot {k!r}: expected shape {want} dtype {spec.dtype}, "
                    f"got shape {tuple(col.shape)} dtype {col.dtype}"
                )
        if n == 0:
            return
        ids = ids.detach().cpu().contiguous()
        local = _C.IdMap(n)
        local.insert(_np(ids))
        if len(local) != n:
            raise InvalidArgumentError(
                f"table {self.name!r}: import_rows ids contain {n - len(local)} repeated id(s)"
            )
        rows, old, new = self._insert_raw(ids)
        all_new = new - old == n  # then rows == arange(old, new)
        try:
            for k, data in self._data.items():
                col = columns.get(k)
                if all_new:
                    if col is None:
                        self._init_rows(data[old:new], self._inits[k])
                    else:
                        data[old:new].copy_(col)
                elif col is None:
                    # existing ids keep their values; only the new rows [old, new) start fresh
                    self._init_rows(data[old:new], self._inits[k])
                else:
                    data.index_copy_(0, rows.to(data.device), col.detach().to(data.device))
        except BaseException:
            if new != old:
                self._rollback(old)
            raise
        if self._stamps is not None:
            self._stamps.index_fill_(0, rows, self._gen)
        self._version += 1

    def clear_rows(self) -> None:
        """Remove every id (capacity is kept). Pending gradients are dropped, and gradients of
        forwards run before the clear are ignored when their backward runs."""
        self._map.clear()
        self._size = 0
        self._pending = []
        self._epoch += 1
        self._version += 1
        self._forget_marks()

    # ------------------------------------------------------------------ change tracking (optional protocol)
    @property
    def tracks_changes(self) -> bool:
        """Whether the table keeps change stamps (the ``track_changes`` constructor argument)."""
        return self._stamps is not None

    def _forget_marks(self) -> None:
        """Every earlier mark stops describing the table (it was cleared, replaced or got a slot)."""
        self._valid_from = self._gen
        self._removed_log = []

    def mark_changes(self) -> int:
        """Close the current generation of changes and return its mark; see
        :meth:`recckpt.state.protocol.ChangeTracking.mark_changes`."""
        mark = self._gen
        self._gen += 1
        return mark

    def export_changes(self, since: int, slots: Sequence[str], max_rows: int) -> Optional[Changes]:
        """Rows inserted or written after mark ``since`` and ids removed since it; ``None`` if the
        table does not track changes or ``since`` no longer describes it. See
        :meth:`recckpt.state.protocol.ChangeTracking.export_changes`."""
        slots = list(slots)
        for s in slots:
            self._check_slot(s)
        if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
            raise InvalidArgumentError(f"table {self.name!r}: max_rows must be an int >= 1, got {max_rows!r}")
        if self._stamps is None or not isinstance(since, int) or not self._valid_from <= since < self._gen:
            return None
        rows = torch.nonzero(self._stamps[: self._size] > since).reshape(-1)
        gone = [ids for gen, ids in self._removed_log if gen > since]
        removed = torch.unique(torch.cat(gone)) if gone else torch.empty(0, dtype=torch.int64)
        if removed.numel():  # an id removed and inserted again since the mark is a changed row
            removed = removed[torch.from_numpy(self._map.lookup(_np(removed))) < 0]
        return Changes(rows.numel(), self._export_rows(rows, slots, int(max_rows), self._version), removed)

    def _export_rows(self, rows: torch.Tensor, slots: List[str], max_rows: int, version: int
                     ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        for start in range(0, rows.numel(), max_rows):
            self._check_export_version(version)
            r = rows[start:start + max_rows]
            yield self._ids.index_select(0, r), {s: self._data[s].index_select(0, r) for s in slots}
        self._check_export_version(version)

    def forget_changes(self, upto: int) -> None:
        """Drop the removal records of generations up to mark ``upto`` (a checkpoint holding them is
        committed); see :meth:`recckpt.state.protocol.ChangeTracking.forget_changes`."""
        self._removed_log = [(g, ids) for g, ids in self._removed_log if g > upto]

    def enable_counters(self) -> None:
        """Add the ``freq`` and ``last_step`` counter slots (kept if present) and start counting; see
        the ``counters`` constructor argument. Existing rows start at ``freq = 0`` and
        ``last_step = step``."""
        self.add_slot(FREQ, torch.int64, (), 0, "sparse", exist_ok=True)
        self.add_slot(LAST_STEP, torch.int64, (), 0, "sparse", exist_ok=True)
        if not self._counters:
            self._data[LAST_STEP][: self._size] = self.step
        self._counters = True

    def evict(self, policy, step: Optional[int] = None) -> int:
        """Remove the rows `policy` (an :class:`recckpt.state.eviction.EvictionPolicy`) selects at
        ``step`` (default :attr:`step`); returns how many. Needs the counters (``counters=True``)."""
        if not self._counters:
            raise InvalidArgumentError(f"table {self.name!r}: eviction needs the freq/last_step counters: create it "
                             f"with HashTable(..., counters=True) or call enable_counters()")
        step = self.step if step is None else step
        n = self._size
        doomed = policy.select(self._data[FREQ][:n], self._data[LAST_STEP][:n], step)
        if not bool(doomed.any()):
            return 0
        return self.remove_ids(self._ids[:n][doomed])

    def remove_ids(self, ids: torch.Tensor) -> int:
        """Remove ``ids`` (int64, any shape; absent ids are ignored) from the table; returns how many
        were removed. The remaining rows move down to stay dense (vectorised, O(len(self))), so row
        numbers change: pending gradients are dropped. Removed ids are recorded for the next
        incremental checkpoint."""
        flat = self._flat_ids(ids, "ids", self.name)
        if flat.numel() == 0 or self._size == 0:
            return 0
        rows = torch.from_numpy(self._map.lookup(_np(flat)))
        rows = torch.unique(rows[rows >= 0])
        if rows.numel() == 0:
            return 0
        n = self._size
        keep = torch.ones(n, dtype=torch.bool)
        keep[rows] = False
        kept = torch.nonzero(keep).reshape(-1)
        gone_ids = self._ids.index_select(0, rows)
        k = kept.numel()
        for t in [*self._data.values(), self._ids] + ([self._stamps] if self._stamps is not None else []):
            t[:k] = t.index_select(0, kept)
        self._size = k
        self._map.clear()
        if k:
            self._map.insert(_np(self._ids[:k]))
        self._pending = []
        self._epoch += 1  # gradients of earlier forwards point at old row numbers
        self._version += 1
        if self._stamps is not None:
            self._removed_log.append((self._gen, gone_ids))
        return int(rows.numel())

    # ------------------------------------------------------------------ bulk load (optional protocol)
    def append_views(
        self, n: int, slots: Sequence[str]
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Writable storage for ``n`` rows after the last one; see
        :meth:`recckpt.state.protocol.BulkAppend.append_views`.

        The views are rows ``[len(self), len(self) + n)`` of the table's own storage (grown if
        needed), so a loader reads the checkpoint straight into the table with no staging copy. On a
        device table the ids are host memory and the slot views device memory: the loader reads into
        host buffers and copies them over (:func:`recckpt.load.sparse_load.load_table_rows`).
        """
        slots = list(slots)
        for s in slots:
            self._check_slot(s)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise InvalidArgumentError(f"table {self.name!r}: append_views n must be an int >= 0, got {n!r}")
        n = int(n)
        old = self._size
        self._grow_for(old + n)
        self._version += 1  # a pending append invalidates running exports
        self._append = (n, tuple(slots), self._version)
        return self._ids[old:old + n], {s: self._data[s][old:old + n] for s in slots}

    def commit_append(self) -> None:
        """Make the rows filled through the last :meth:`append_views` part of the table; see
        :meth:`recckpt.state.protocol.BulkAppend.commit_append`."""
        pending, self._append = getattr(self, "_append", None), None
        if pending is None or pending[2] != self._version:
            raise RuntimeError(
                f"table {self.name!r}: commit_append without a matching append_views (or the table "
                f"changed in between)"
            )
        n, slots, _ = pending
        old = self._size
        new = old + n
        if n == 0:
            return
        bad = self._map.insert_new(_np(self._ids[old:new]))
        if bad != n:
            dup = int(self._ids[old + bad])
            self._rollback(old)
            raise InvalidArgumentError(
                f"table {self.name!r}: commit_append: id {dup} (row {bad} of {n} appended) is already "
                f"in the table or repeated; nothing was appended"
            )
        try:
            for k, data in self._data.items():
                if k not in slots:
                    self._init_rows(data[old:new], self._inits[k])
        except BaseException:
            self._rollback(old)
            raise
        if self._stamps is not None:
            self._stamps[old:new] = self._gen
        self._size = new
        self._version += 1

    def adopt_storage(self, rows: int, ids: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> None:
        """Take ``ids`` and ``columns`` as the table's storage, their first ``rows`` rows being its
        contents; see :meth:`recckpt.state.protocol.AdoptStorage.adopt_storage`.

        A mapped load passes copy-on-write mappings of the checkpoint: rows are shared with the page
        cache until written, and growing past their capacity copies them into ordinary memory. A table
        on a device copies the first ``rows`` rows to the device instead (in bounded steps)."""
        if self._size:
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage needs an empty table, it holds {self._size} rows")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage ids must be int64 [capacity], got {got}")
        cap = ids.numel()
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 0 <= rows <= cap:
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage rows must be an int in [0, {cap}], got {rows!r}")
        rows = int(rows)
        for k, col in columns.items():
            self._check_slot(k)
            spec = self._specs[k]
            want = (cap, *spec.shape)
            if not isinstance(col, torch.Tensor) or tuple(col.shape) != want or col.dtype != spec.dtype \
                    or col.device.type != "cpu" or not col.is_contiguous():
                got = f"{tuple(col.shape)} {col.dtype} on {col.device}" if isinstance(col, torch.Tensor) else type(col)
                raise InvalidArgumentError(f"table {self.name!r}, slot {k!r}: adopt_storage expects a C-contiguous CPU "
                                 f"tensor of shape {want} dtype {spec.dtype}, got {got}")
        if ids.device.type != "cpu" or not ids.is_contiguous():
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage ids must be a C-contiguous CPU tensor")
        if ids.is_inference() or any(c.is_inference() for c in columns.values()):
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage got inference tensors (made under "
                             f"torch.inference_mode()), which training could not update in place")
        id_map = _C.IdMap(cap)  # sized for the storage, so the first new ids do not rehash it
        if rows:
            bad = id_map.insert_new(_np(ids[:rows]))
            if bad != rows:
                raise InvalidArgumentError(f"table {self.name!r}: adopt_storage: id {int(ids[bad])} (row {bad}) is repeated; "
                                 f"nothing was adopted")
        data = {}
        with torch.inference_mode(False):  # see _realloc
            for k, spec in self._specs.items():
                if k in columns and self.device.type == "cpu":
                    data[k] = columns[k]
                elif k in columns:  # a device table copies the host storage over, chunk by chunk
                    data[k] = torch.empty((cap, *spec.shape), dtype=spec.dtype, device=self.device)
                    for s in range(0, rows, _ADOPT_COPY_ROWS):
                        data[k][s:s + _ADOPT_COPY_ROWS].copy_(columns[k][s:min(rows, s + _ADOPT_COPY_ROWS)])
                else:
                    data[k] = torch.empty((cap, *spec.shape), dtype=spec.dtype, device=self.device)
                    self._init_rows(data[k][:rows], self._inits[k])
            stamps = torch.full((cap,), self._gen, dtype=_STAMP_DTYPE) if self._stamps is not None else None
        self._map, self._data, self._ids, self._capacity, self._size = id_map, data, ids, cap, rows
        self._stamps = stamps
        self._version += 1
        self._forget_marks()

    # ------------------------------------------------------------------ state_dict integration
    def get_extra_state(self) -> "HashTable":
        """Return the table itself, so ``model.state_dict()`` holds it under
        ``<prefix>_extra_state`` (recckpt saves it through :class:`SparseState`)."""
        return self

    def set_extra_state(self, state: object) -> None:
        """Replace this table's rows with those of another :class:`SparseState` (``load_state_dict``).

        Slots of ``state`` this table lacks are added (same dtype, shape, category; init 0); values
        are cast to this table's slot dtypes; slots this table has and ``state`` lacks get their
        initial values. Row shapes must match (``ValueError`` otherwise). Passing the table itself
        is a no-op.
        """
        if state is self:
            return
        if not isinstance(state, SparseState):
            raise InvalidArgumentError(
                f"table {self.name!r}: set_extra_state expects a SparseState, got {type(state)}"
            )
        meta = state.sparse_meta()
        for k, spec in meta.slots.items():
            mine = self._specs.get(k)
            if mine is not None and mine.shape != spec.shape:
                raise InvalidArgumentError(
                    f"table {self.name!r}, slot {k!r}: row shape {mine.shape} here, "
                    f"{spec.shape} in the state being loaded (table {meta.name!r})"
                )
        for k, spec in meta.slots.items():
            if k not in self._specs:
                self.add_slot(k, spec.dtype, spec.shape, 0.0, spec.category)
        self.clear_rows()
        self.reserve(meta.num_rows)
        for ids, cols in state.export_chunks(list(meta.slots), 1 << 16):
            self.import_rows(
                ids, {k: v.to(self._specs[k].dtype) for k, v in cols.items()}
            )

    # ------------------------------------------------------------------ pickling / deepcopy
    def __getstate__(self):
        state = self.__dict__.copy()
        n = self._size
        state["_map"] = None
        state["_data"] = {k: v[:n].clone() for k, v in self._data.items()}
        state["_ids"] = self._ids[:n].clone()
        if self._stamps is not None:
            state["_stamps"] = self._stamps[:n].clone()
        state["_capacity"] = n
        state["_pending"] = []
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if self.__dict__.get("_stamps") is not None and self._stamps.dtype != _STAMP_DTYPE:
            self._stamps = self._stamps.to(_STAMP_DTYPE)   # pickled before the stamps were int32
        self._map = _C.IdMap(self._capacity)
        if self._size:
            self._map.insert(_np(self._ids[: self._size]))
