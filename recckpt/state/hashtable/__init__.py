"""``HashTable``: a growable embedding table keyed by arbitrary int64 ids.

The table is the reference implementation of :class:`~recckpt.state.protocol.SparseState`. This
package is the table split by job, each module with one reason to change: :mod:`.storage` owns the
id map and where rows live (ids, one column per slot, slot specs and inits, growth, the version that
exports check); :mod:`.training` the training path (lookup, forward, the gradient hook and pending
gradients, row reads and writes for the optimizers); :mod:`.changes` change tracking (row stamps,
marks, removed ids); :mod:`.counters` the ``freq``/``last_step`` counters and removing rows
(eviction, ``remove_ids``); :mod:`.transfer` export and import (the protocol's chunks and upserts,
bulk append, adopting storage, ``state_dict``). This module assembles :class:`HashTable` from their
mixins and keeps what belongs to the table as a whole: construction, properties, adding slots, and
the pickle layout. The parts share the table's state through small objects with public attributes
(``store``, ``change_log``, ``counting``, ``grads``), never through each other's private fields.

Storage
    One C-contiguous tensor per slot on the table's ``device``, with ``capacity`` rows
    (``[capacity, *shape]``), plus a host ``int64`` tensor of ids in row order: row ``i`` of every
    slot belongs to ``ids[i]``, the ``i``-th distinct id inserted (the engine's ``recckpt._C.IdMap``
    assigns rows densely in insertion order).
    All slots grow together, geometrically (x1.5), when new ids need more rows. Removing ids
    (:meth:`HashTable.remove_ids`, eviction) moves the remaining rows down to stay dense;
    :meth:`HashTable.clear_rows` removes all of them.

Pickles
    A pickled table (``torch.save`` of a model, or of a ``state_dict``, which holds the table) names
    only the class ``recckpt.state.hashtable.HashTable`` and holds the attributes the table had when
    it was one module (``_ids``, ``_data``, ``_stamps``, ...), trimmed to the rows in use: pickles made
    before and after the split load in either version (tests/unit/test_hashtable_pickle.py).

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
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from recckpt.state import initializers
from recckpt.state.eviction import FREQ, LAST_STEP
from recckpt.state.protocol import SlotSpec

from ...errors import InvalidArgumentError
from .changes import ChangeLog, ChangeTracking
from .counters import CountersAndEviction, Counting
from .storage import EMBEDDING, RowStore, SlotInit, table_device
from .training import GradBuffer, TrainingPath
from .transfer import Transfer

__all__ = ["HashTable", "EMBEDDING", "FREQ", "LAST_STEP"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class HashTable(TrainingPath, CountersAndEviction, ChangeTracking, Transfer, nn.Module):
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

    The attributes ``store``, ``change_log``, ``counting`` and ``grads`` are the table's internals,
    shared by its parts (see the package docstring); use the methods above instead.
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
        self.device = table_device(name, device)
        self.name = name
        self.dim = int(dim)
        self.initializer = initializer
        capacity = int(capacity)
        # Change tracking: row i was last written in generation stamps[i]; mark_changes() closes
        # the current generation. Removed ids are logged with the generation they left in.
        if not isinstance(track_changes, bool):
            raise InvalidArgumentError(f"HashTable {name!r}: track_changes must be a bool, got {track_changes!r}")
        self.change_log = ChangeLog.new(track_changes, capacity)
        self.store = RowStore.empty(name, self.device, SlotSpec(dtype, (self.dim,), "sparse"), initializer,
                                   capacity, self.change_log)
        self.grads = GradBuffer()
        #: The training step, as the user sets it; ``last_step`` records it (with ``counters``).
        self.step = 0
        self.counting = Counting()
        if not isinstance(counters, bool):
            raise InvalidArgumentError(f"HashTable {name!r}: counters must be a bool, got {counters!r}")
        if counters:
            self.enable_counters()

    # ------------------------------------------------------------------ basic properties
    @property
    def dtype(self) -> torch.dtype:
        """dtype of the embedding slot."""
        return self.store.specs[EMBEDDING].dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype gradients and optimizer updates are computed in: float64 for a float64 table,
        else float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def has_counters(self) -> bool:
        """Whether the table keeps the ``freq``/``last_step`` counters (``counters=True`` or
        :meth:`enable_counters`): what :meth:`evict` needs."""
        return self.counting.enabled

    @property
    def capacity(self) -> int:
        """Number of rows allocated (>= ``len(self)``)."""
        return self.store.capacity

    def __len__(self) -> int:
        """Number of ids (rows) in the table."""
        return self.store.size

    def __bool__(self) -> bool:  # a Module is truthy even when the table is empty
        return True

    @property
    def slot_names(self) -> List[str]:
        """Slot names in order (``"embedding"`` first)."""
        return list(self.store.specs)

    def slot_spec(self, name: str) -> SlotSpec:
        """The :class:`SlotSpec` of slot ``name``."""
        self.store.check_slot(name)
        return self.store.specs[name]

    def slot(self, name: str) -> torch.Tensor:
        """Live view ``[len(self), *shape]`` of slot ``name``, row ``i`` belonging to ``ids()[i]``.

        Writes through the view change the table (e.g. counters). The view is invalidated (stops
        aliasing the table) when the table grows or is cleared.
        """
        self.store.check_slot(name)
        return self.store.columns[name][: self.store.size]

    @property
    def weight(self) -> torch.Tensor:
        """Live view of the embedding slot, ``[len(self), dim]`` (same caveats as :meth:`slot`)."""
        return self.slot(EMBEDDING)

    def ids(self) -> torch.Tensor:
        """Copy of the ids in row order (``int64[len(self)]``)."""
        return self.store.ids[: self.store.size].clone()

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, dim={self.dim}, dtype={self.dtype}, device={self.device}, "
            f"rows={self.store.size}, capacity={self.store.capacity}, slots={self.slot_names}, "
            f"initializer={self.initializer!r}"
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
        if name in self.store.specs:
            old = self.store.specs[name]
            if exist_ok and old == spec:
                self.store.inits[name] = init
                return
            raise InvalidArgumentError(
                f"table {self.name!r}: slot {name!r} already exists as {old}"
                + ("" if not exist_ok else f", requested {spec}")
            )
        self.store.add_slot(name, spec, init)
        self.change_log.forget()  # the new column's values are not in any earlier checkpoint

    # ------------------------------------------------------------------ growth
    def reserve(self, rows: int) -> None:
        """Make room for at least ``rows`` rows in total without further reallocation."""
        self.store.reserve(rows)

    # ------------------------------------------------------------------ pickling / deepcopy
    # A pickle holds the attributes the table had as one module (see "Pickles" in the package
    # docstring), so that pickles made before and after the split load in either version and no
    # helper class of the package is ever named in one (moving a helper cannot break a pickle).
    def __getstate__(self):
        state = self.__dict__.copy()
        store, log = state.pop("store"), state.pop("change_log")
        state["_counters"] = state.pop("counting").enabled
        state["_epoch"] = state.pop("grads").epoch
        n = store.size
        state.update(
            _specs=store.specs, _inits=store.inits, _map=None,
            _data={k: v[:n].clone() for k, v in store.columns.items()},
            _ids=store.ids[:n].clone(), _capacity=n, _size=n, _version=store.version,
            _gen=log.gen, _valid_from=log.valid_from, _removed_log=log.removed_log,
            _stamps=None if log.stamps is None else log.stamps[:n].clone(),
        )
        state.pop("_append", None)
        state["_pending"] = []    # gradients are not state: a restored table has none pending
        return state

    def __setstate__(self, state) -> None:
        state = dict(state)
        log = ChangeLog(state.pop("_stamps", None), state.pop("_gen"), state.pop("_valid_from"),
                        state.pop("_removed_log"))
        ids, size = state.pop("_ids"), state.pop("_size")
        store = RowStore(state["name"], state["device"], state.pop("_specs"), state.pop("_inits"),
                         state.pop("_data"), ids[: state.pop("_capacity")], size, log, state.pop("_version"))
        state.pop("_map")
        counting = Counting(state.pop("_counters"))
        grads = GradBuffer(state.pop("_epoch"))
        state.pop("_pending")
        state.pop("_append", None)
        super().__setstate__(state)
        self.change_log, self.store, self.counting, self.grads = log, store, counting, grads
