"""Test-only helpers: a minimal SparseState that holds any dtype (to prove the protocol is all the
library relies on), and ways to read a table's contents as {id: row} for comparisons."""
from __future__ import annotations

import torch

from recckpt.state.protocol import SlotSpec, SparseTableMeta


class DictTable(torch.nn.Module):
    """Rows kept as plain tensors, re-sorted on every import; any slot dtypes/shapes."""

    def __init__(self, name: str, slots: dict[str, SlotSpec], init: float = 0.0):
        super().__init__()
        self.name, self.slots, self.init = name, dict(slots), init
        self.clear_rows()

    def sparse_meta(self):
        return SparseTableMeta(self.name, self.slots, int(self.ids.numel()))

    def export_chunks(self, slots, max_rows):
        for s in range(0, self.ids.numel(), max_rows):
            yield self.ids[s:s + max_rows], {k: self.cols[k][s:s + max_rows] for k in slots}

    def import_rows(self, ids, columns):
        for k, c in columns.items():
            spec = self.slots[k]
            if c.dtype != spec.dtype or tuple(c.shape) != (ids.numel(), *spec.shape):
                raise ValueError(f"table {self.name!r} slot {k!r}: got {c.dtype} {tuple(c.shape)}")
        keep = ~torch.isin(self.ids, ids)
        new_cols = {}
        for k, spec in self.slots.items():
            given = columns.get(k)
            if given is None:
                given = torch.full((ids.numel(), *spec.shape), self.init).to(spec.dtype)
            new_cols[k] = torch.cat([self.cols[k][keep], given])
        self.ids = torch.cat([self.ids[keep], ids])
        self.cols = new_cols

    def clear_rows(self):
        self.ids = torch.empty(0, dtype=torch.int64)
        self.cols = {k: torch.empty((0, *s.shape), dtype=s.dtype) for k, s in self.slots.items()}

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass

    def set_rows(self, ids, cols):
        self.clear_rows()
        self.import_rows(ids, cols)


def table_contents(table) -> dict[str, dict[int, torch.Tensor]]:
    """slot -> {id: row} through the protocol only."""
    meta = table.sparse_meta()
    out = {k: {} for k in meta.slots}
    for ids, cols in table.export_chunks(list(meta.slots), 1 << 20):
        for k, c in cols.items():
            for i, row in zip(ids.tolist(), c):
                out[k][i] = row.clone()
    return out


def assert_tables_equal(a, b, slots=None):
    ca, cb = table_contents(a), table_contents(b)
    for k in (slots or ca):
        assert set(ca[k]) == set(cb[k]), f"slot {k}: id sets differ"
        for i, row in ca[k].items():
            other = cb[k][i]
            assert row.dtype == other.dtype and row.shape == other.shape, (k, i)
            # compare bit patterns, so NaN payloads and -0.0 count too
            assert torch.equal(row.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), (k, i)
