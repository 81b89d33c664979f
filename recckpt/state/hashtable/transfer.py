"""Export and import of a HashTable: the SparseState protocol and the bulk-load paths.

:class:`Transfer` is how rows leave and enter a table as a whole: ``sparse_meta``/``export_chunks``
(zero-copy views for a save), ``import_rows``/``clear_rows`` (upserts for a load), the optional
``append_views``/``commit_append`` (a loader reads straight into the table's storage) and
``adopt_storage`` (a mapped load hands over its storage), and ``get_extra_state``/``set_extra_state``
(``model.state_dict()``). It validates what comes in and leaves where rows live to :mod:`.storage`.
"""
from __future__ import annotations

import numbers
from typing import Dict, Iterator, Mapping, Sequence, Tuple

import torch

from recckpt import _C
from recckpt.state.protocol import SparseState, SparseTableMeta

from ...errors import InvalidArgumentError
from .storage import empty_rows, init_rows

#: Rows per host-to-device copy when a device table adopts host storage (bounds the transient
#: device memory of one copy step, not the table).
ADOPT_COPY_ROWS = 1 << 16


class Transfer:
    """The table's export and import methods (a mixin of :class:`~recckpt.state.hashtable.HashTable`,
    over its ``store``, ``change_log`` and ``grads``)."""

    # ------------------------------------------------------------------ SparseState
    def sparse_meta(self) -> SparseTableMeta:
        """Name, slots (``"embedding"`` first, then in the order added) and number of rows."""
        return SparseTableMeta(self.name, dict(self.store.specs), self.store.size)

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
            self.store.check_slot(s)
        if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1:
            raise InvalidArgumentError(f"table {self.name!r}: max_rows must be an int >= 1, got {max_rows!r}")
        return self.store.chunks(slots, int(max_rows), self.store.version)

    def import_rows(self, ids: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> None:
        """Upsert rows; see :meth:`recckpt.state.protocol.SparseState.import_rows`.

        Columns on another device are copied to the table's device. Slots not in ``columns`` keep their values
        for ids that already existed and start at their initial value for new ids.
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
            raise InvalidArgumentError(f"table {self.name!r}: import_rows ids must be int64 [n], got {got}")
        n = ids.numel()
        specs = self.store.specs
        for k, col in columns.items():
            if k not in specs:
                raise InvalidArgumentError(
                    f"table {self.name!r}: import_rows got unknown slot {k!r} "
                    f"(slots: {', '.join(specs)})"
                )
            spec = specs[k]
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
        local.insert(ids.numpy())
        if len(local) != n:
            raise InvalidArgumentError(
                f"table {self.name!r}: import_rows ids contain {n - len(local)} repeated id(s)"
            )
        store = self.store
        rows, old, new = store.insert_raw(ids)
        all_new = new - old == n  # then rows == arange(old, new)
        try:
            for k, data in store.columns.items():
                col = columns.get(k)
                if all_new:
                    if col is None:
                        init_rows(data[old:new], store.inits[k])
                    else:
                        data[old:new].copy_(col)
                elif col is None:
                    # existing ids keep their values; only the new rows [old, new) start fresh
                    init_rows(data[old:new], store.inits[k])
                else:
                    data.index_copy_(0, rows.to(data.device), col.detach().to(data.device))
        except BaseException:
            if new != old:
                store.rollback(old)
            raise
        self.counting.inserted(store, old, new, columns, self.step)
        self.change_log.stamp(rows)
        store.modified()

    def clear_rows(self) -> None:
        """Remove every id (capacity is kept). Pending gradients are dropped, and gradients of
        forwards run before the clear are ignored when their backward runs."""
        self.store.clear()
        self.grads.invalidate()
        self.change_log.forget()

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
            self.store.check_slot(s)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise InvalidArgumentError(f"table {self.name!r}: append_views n must be an int >= 0, got {n!r}")
        n = int(n)
        store = self.store
        old = store.size
        store.grow_for(old + n)
        store.modified()  # a pending append invalidates running exports
        self._append = (n, tuple(slots), store.version)
        return store.ids[old:old + n], {s: store.columns[s][old:old + n] for s in slots}

    def commit_append(self) -> None:
        """Make the rows filled through the last :meth:`append_views` part of the table; see
        :meth:`recckpt.state.protocol.BulkAppend.commit_append`."""
        pending, self._append = getattr(self, "_append", None), None
        store = self.store
        if pending is None or pending[2] != store.version:
            raise RuntimeError(
                f"table {self.name!r}: commit_append without a matching append_views (or the table "
                f"changed in between)"
            )
        n, slots, _ = pending
        old = store.size
        new = old + n
        if n == 0:
            return
        bad = store.map.insert_new(store.ids[old:new].numpy())
        if bad != n:
            dup = int(store.ids[old + bad])
            store.rollback(old)
            raise InvalidArgumentError(
                f"table {self.name!r}: commit_append: id {dup} (row {bad} of {n} appended) is already "
                f"in the table or repeated; nothing was appended"
            )
        store.init_new_rows(old, new, skip=slots)
        self.counting.inserted(store, old, new, slots, self.step)
        self.change_log.stamp_range(old, new)
        store.size = new
        store.modified()

    def adopt_storage(self, rows: int, ids: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> None:
        """Take ``ids`` and ``columns`` as the table's storage, their first ``rows`` rows being its
        contents; see :meth:`recckpt.state.protocol.AdoptStorage.adopt_storage`.

        A mapped load passes copy-on-write mappings of the checkpoint: rows are shared with the page
        cache until written, and growing past their capacity copies them into ordinary memory. A table
        on a device copies the first ``rows`` rows to the device instead (in bounded steps)."""
        store = self.store
        if store.size:
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage needs an empty table, it holds {store.size} rows")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage ids must be int64 [capacity], got {got}")
        cap = ids.numel()
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 0 <= rows <= cap:
            raise InvalidArgumentError(f"table {self.name!r}: adopt_storage rows must be an int in [0, {cap}], got {rows!r}")
        rows = int(rows)
        for k, col in columns.items():
            store.check_slot(k)
            spec = store.specs[k]
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
            bad = id_map.insert_new(ids[:rows].numpy())
            if bad != rows:
                raise InvalidArgumentError(f"table {self.name!r}: adopt_storage: id {int(ids[bad])} (row {bad}) is repeated; "
                                 f"nothing was adopted")
        data = {}
        with torch.inference_mode(False):  # see RowStore.realloc
            for k, spec in store.specs.items():
                if k in columns and self.device.type == "cpu":
                    data[k] = columns[k]
                elif k in columns:  # a device table copies the host storage over, chunk by chunk
                    data[k] = empty_rows((cap, *spec.shape), spec.dtype, self.device)
                    for s in range(0, rows, ADOPT_COPY_ROWS):
                        data[k][s:s + ADOPT_COPY_ROWS].copy_(columns[k][s:min(rows, s + ADOPT_COPY_ROWS)])
                else:
                    data[k] = empty_rows((cap, *spec.shape), spec.dtype, self.device)
                    init_rows(data[k][:rows], store.inits[k])
        self.change_log.adopt(cap)
        store.replace(id_map, ids, data, rows)
        self.counting.inserted(store, 0, rows, columns, self.step)
        self.change_log.forget()

    # ------------------------------------------------------------------ state_dict integration
    def get_extra_state(self) -> SparseState:
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
        specs = self.store.specs
        for k, spec in meta.slots.items():
            mine = specs.get(k)
            if mine is not None and mine.shape != spec.shape:
                raise InvalidArgumentError(
                    f"table {self.name!r}, slot {k!r}: row shape {mine.shape} here, "
                    f"{spec.shape} in the state being loaded (table {meta.name!r})"
                )
        for k, spec in meta.slots.items():
            if k not in specs:
                self.add_slot(k, spec.dtype, spec.shape, 0.0, spec.category)
        self.clear_rows()
        self.reserve(meta.num_rows)
        for ids, cols in state.export_chunks(list(meta.slots), 1 << 16):
            self.import_rows(
                ids, {k: v.to(specs[k].dtype) for k, v in cols.items()}
            )
