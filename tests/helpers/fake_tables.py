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


class Holder(torch.nn.Module):
    """A model of one sparse table, registered as `t`."""

    def __init__(self, table):
        super().__init__()
        self.t = table
