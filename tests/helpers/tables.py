"""Test-only helpers: a minimal SparseState that holds any dtype (to prove the protocol is all the
library relies on), ways to read a table's contents as {id: row} for comparisons, and a model of many small tables."""
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


class ParamTable(torch.nn.Module):
    """A custom embedding written to docs/SPARSE_STATE.md whose storage is an ``nn.Parameter`` and
    whose ids are a plain tensor: the parameter shows up in ``state_dict()`` next to the table itself,
    which is the case the state split must not save (and load) twice."""

    def __init__(self, name: str, dim: int, capacity: int = 16):
        super().__init__()
        self.name = name
        self.weight = torch.nn.Parameter(torch.zeros(capacity, dim))
        self.ids = torch.zeros(capacity, dtype=torch.int64)
        self.n = 0

    def sparse_meta(self):
        return SparseTableMeta(self.name, {"embedding": SlotSpec(self.weight.dtype, (self.weight.shape[1],), "sparse")},
                               self.n)

    def export_chunks(self, slots, max_rows):
        for s in range(0, self.n, max_rows):
            e = min(self.n, s + max_rows)
            yield self.ids[s:e], {k: self.weight.detach()[s:e] for k in slots}

    def import_rows(self, ids, columns):
        rows = torch.full_like(ids, -1)
        if self.n:
            order = torch.argsort(self.ids[:self.n])
            known = self.ids[:self.n][order]
            at = torch.searchsorted(known, ids).clamp(max=self.n - 1)
            hit = known[at] == ids
            rows[hit] = order[at[hit]]
        new = rows < 0
        k = int(new.sum())
        if self.n + k > self.ids.numel():
            raise ValueError(f"table {self.name!r} is full")
        rows[new] = torch.arange(self.n, self.n + k)
        self.ids[self.n:self.n + k] = ids[new]
        with torch.no_grad():
            self.weight[rows[new]] = 0.0
            if "embedding" in columns:
                self.weight[rows] = columns["embedding"]
        self.n += k

    def clear_rows(self):
        self.n = 0

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass


def small_tables(n: int = 300, rows: int = 50, dim: int = 16) -> torch.nn.Module:
    """A model of `n` HashTables (dim `dim`, SparseAdam's two slots) of `rows` rows each (ids 1000 * t + i),
    or empty ones with rows=0: a model of many small tables (issue 26)."""
    from recckpt import HashTable, SparseAdam
    m = torch.nn.Module()
    for t in range(n):
        m.add_module(f"t{t}", HashTable(f"t{t}", dim=dim))
    SparseAdam(m, lr=0.01)
    with torch.no_grad():
        for t, table in enumerate(m.children()):
            if rows:
                table(torch.arange(rows) + 1000 * t)
    return m
