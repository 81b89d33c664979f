"""The training path of a HashTable: lookup, forward, gradients and the row access optimizers use.

:class:`TrainingPath` maps ids to rows (inserting unseen ids in training mode), gathers embeddings,
and records gradients: embeddings are not ``nn.Parameter``s, so a forward with autograd enabled
gathers the unique rows into a fresh leaf tensor whose post-accumulate-grad hook hands the gradient
to the table's :class:`GradBuffer` as a pending ``(rows, grad)`` pair (see the package docstring).
Sparse optimizers consume those pairs and write rows back through :meth:`TrainingPath.write_slots`.
Counting lookups is :mod:`.counters`' job; this module only tells it.
"""
from __future__ import annotations

import weakref
from typing import List, Mapping, Optional, Tuple

import torch

from .storage import EMBEDDING, flat_ids, unique_inverse


def gather_masked(data: torch.Tensor, rows: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
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


class GradBuffer:
    """The gradients recorded by ``backward()`` and not yet consumed by an optimizer.

    Attributes:
        pending: ``(rows int64[k] unique, grad [k, dim] in the compute dtype)`` pairs, one per backward.
        epoch: bumped when row numbers change (clear, removal): gradients of forwards run before are
            dropped when their backward runs.
    """

    def __init__(self, epoch: int = 0) -> None:
        self.pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.epoch = epoch

    def invalidate(self) -> None:
        """Row numbers changed: drop what is pending and what earlier forwards will record."""
        self.pending = []
        self.epoch += 1

    def attach(self, leaf: torch.Tensor, rows: torch.Tensor, valid: Optional[torch.Tensor],
               cdtype: torch.dtype) -> None:
        """Record ``leaf``'s gradient for ``rows`` (of the ``valid`` leaf rows) when backward reaches it."""
        buffer_ref = weakref.ref(self)  # a graph kept alive must not keep the table alive
        epoch = self.epoch

        def hook(t: torch.Tensor) -> None:
            g = t.grad
            t.grad = None
            buffer = buffer_ref()
            if g is None or buffer is None or buffer.epoch != epoch:
                return
            if valid is not None:
                g = g[valid]
            buffer.pending.append((rows, g.detach().to(cdtype).contiguous()))

        leaf.register_post_accumulate_grad_hook(hook)

    def coalesced(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The pending pairs summed per row, or None when nothing is pending."""
        pending = self.pending
        if not pending:
            return None
        if len(pending) == 1:  # rows of one backward are already unique
            return pending[0]
        rows = torch.cat([r for r, _ in pending])
        grads = torch.cat([g for _, g in pending])
        if rows.numel() == 0:
            return rows, grads
        uniq, inv = unique_inverse(rows)
        out = torch.zeros((uniq.numel(), *grads.shape[1:]), dtype=grads.dtype, device=grads.device)
        out.index_add_(0, inv.to(grads.device), grads)
        return uniq, out


class TrainingPath:
    """The table's training-path methods (a mixin of :class:`~recckpt.state.hashtable.HashTable`,
    over its ``store``, ``change_log``, ``counting`` and ``grads``)."""

    # ------------------------------------------------------------------ lookup
    def lookup(self, ids: torch.Tensor, insert: bool = False) -> torch.Tensor:
        """Rows of ``ids`` (int64, any shape) as an int64 tensor of the same shape, -1 where absent.

        With ``insert=True`` absent ids are inserted (and initialised) first, whatever the mode.
        """
        flat = flat_ids(ids, "ids", self.name)
        rows = self.store.insert(flat) if insert else self.store.lookup(flat)
        return rows.reshape(ids.shape)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[*ids.shape, dim]`` of int64 ``ids`` (see the class docstring)."""
        flat = flat_ids(ids, "ids", self.name)
        n = flat.numel()
        if self.training:
            old = self.store.size
            rows = self.store.insert(flat)
            self.counting.looked_up(self.store, self.change_log, rows, old, self.step)
        else:
            rows = self.store.lookup(flat)
        emb = self.store.columns[EMBEDDING]  # after insertion: it may have been reallocated

        if torch.is_grad_enabled():
            uniq, inv = unique_inverse(rows) if n else (rows, rows)
            values, valid = gather_masked(emb, uniq)
            # The leaf is in the compute dtype so that autograd sums the gradients of repeated ids
            # in float32 (a hot id can occur thousands of times in a batch), not in bf16/fp16.
            leaf = values.to(self.compute_dtype).requires_grad_(True)
            # Pending rows stay on the host (coalescing uses the host IdMap); the mask follows them.
            self.grads.attach(leaf, uniq if valid is None else uniq[valid.cpu()], valid, self.compute_dtype)
            out = leaf.index_select(0, inv.to(emb.device)).to(emb.dtype)
        else:
            out, _ = gather_masked(emb, rows)
        out = out.view(*ids.shape, self.dim)
        if ids.device != out.device:
            out = out.to(ids.device)
        return out

    # ------------------------------------------------------------------ gradients
    def has_grad(self) -> bool:
        """True when gradients are pending (recorded by backward, not yet consumed)."""
        return bool(self.grads.pending)

    def sparse_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The pending gradient, coalesced, without consuming it.

        Returns ``(rows, grad)``: unique rows (int64[k], in no particular order) and the summed
        gradient of each (``[k, dim]`` in :attr:`compute_dtype`), or ``None`` when nothing is
        pending. Map rows to ids with ``table.ids()[rows]``.
        """
        return self.grads.coalesced()

    def pop_sparse_grad(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Like :meth:`sparse_grad` but also drops the pending gradient (what optimizers call)."""
        out = self.sparse_grad()
        self.grads.pending = []
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop pending sparse gradients (and clear grads of any parameters, as ``Module`` does)."""
        super().zero_grad(set_to_none=set_to_none)
        self.grads.pending = []

    # ------------------------------------------------------------------ row access for optimizers
    def read_rows(self, slot: str, rows: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Copy of slot ``slot`` at ``rows`` (int64[k], each in ``[0, len(self))``, on any device),
        optionally cast; the copy is on the table's device."""
        self.store.check_slot(slot)
        data = self.store.columns[slot]
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
            self.store.check_slot(slot)
        for slot, v in values.items():
            data = self.store.columns[slot]
            data.index_copy_(0, rows.to(data.device), v.to(device=data.device, dtype=data.dtype))
        self.change_log.stamp(rows)
        if EMBEDDING in values:
            self.counting.written(self.store, rows, self.step)
        self.store.modified()
