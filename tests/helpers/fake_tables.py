"""What the unit tests' hand-written sparse tables share: the rows a load imports, recorded by id and
each at most once, and a module that registers one table."""
from __future__ import annotations

import torch


class RecordsImports:
    """Mixin (before torch.nn.Module in the bases): `import_rows` records every row in `self.rows`
    ({id: {slot: tensor}}) and fails on an id imported twice; the table is its own extra state."""

    def import_rows(self, ids, columns):
        for j, i in enumerate(ids.tolist()):
            assert i not in self.rows, f"row {i} imported twice"
            self.rows[i] = {k: v[j].clone() for k, v in columns.items()}

    def clear_rows(self):
        self.rows.clear()

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass


class OwnExtraState:
    """Mixin (before torch.nn.Module in the bases): a table that keeps its rows through a load
    (`clear_rows` does nothing) and is its own extra state."""

    def clear_rows(self):
        pass

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass


class Holder(torch.nn.Module):
    """A model of one sparse table, registered as `t`."""

    def __init__(self, table):
        super().__init__()
        self.t = table


class FixedRows(OwnExtraState, torch.nn.Module):
    """A fixed-size table (the protocol TorchRec's tables implement) named `name`: rows 0..n-1, all held by
    this process, an embedding and an elementwise Adagrad state of dim d (saved with format version 5's
    row_range buckets, column groups and row runs); loads write into it."""

    def __init__(self, name: str = "fixed", n: int = 500, d: int = 8):
        super().__init__()
        from recckpt.state.protocol import RowRangeLayout
        self.name = name
        self.layout = RowRangeLayout(n, ((0, n),))
        self.cols = {"embedding": torch.randn(n, d), "adagrad.acc": torch.rand(n, d)}

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        from recckpt.state.protocol import SlotSpec, SparseTableMeta
        n, d = self.cols["embedding"].shape
        return SparseTableMeta(self.name, {"embedding": SlotSpec(torch.float32, (d,), "sparse"),
                                           "adagrad.acc": SlotSpec(torch.float32, (d,), "sparse_opt")}, n)

    def export_chunks(self, slots, max_rows):
        n = self.cols["embedding"].shape[0]
        for s in range(0, n, max_rows):
            yield torch.arange(s, min(n, s + max_rows)), {k: self.cols[k][s:s + max_rows] for k in slots}

    def import_rows(self, ids, columns):
        for k, v in columns.items():
            self.cols[k][ids] = v
