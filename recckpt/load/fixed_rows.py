"""Rows of a fixed-size table (FixedSize: TorchRec's) from a source that does not know its layout.

A chain of increments is folded by id over buckets; under format version 3's hash layout a row range
spreads over every bucket, so the fold covers them all and this filter keeps the rows the table's layout
gives this process (all of them when replicated) and, for column-split slots, its columns.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from ..errors import IncompatibleCheckpointError
from ..state.protocol import column_split_slots


class OwnedRows:
    """`import_rows` of a fixed-size table, fed rows of every bucket: keeps this process's rows and columns."""

    def __init__(self, table, target: str, where: str):
        self.table, self.target, self.where = table, target, where
        self.layout = table.row_layout()
        self.split = set(column_split_slots(table.sparse_meta()))
        self._starts = np.array([a for a, _ in self.layout.owned_rows], dtype=np.int64)
        self._ends = np.array([b for _, b in self.layout.owned_rows], dtype=np.int64)
        self.rows = 0

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        lay = self.layout
        a = ids.numpy()
        if len(a) and (int(a.min()) < 0 or int(a.max()) >= lay.num_rows):
            bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
            raise IncompatibleCheckpointError(
                f"checkpoint {self.where}: holds row id {bad}, outside model table {self.target!r}'s "
                f"{lay.num_rows} rows", table=self.target)
        if not lay.replicated:
            if not lay.owned_rows:
                return
            k = np.searchsorted(self._starts, a, side="right") - 1
            keep = torch.from_numpy(np.nonzero((k >= 0) & (a < self._ends[np.maximum(k, 0)]))[0])
            ids, columns = ids[keep], {s: c[keep] for s, c in columns.items()}
        if ids.shape[0] == 0:
            return
        if lay.columns is not None:
            c0, c1 = lay.columns
            columns = {s: (c[:, c0:c1] if s in self.split else c) for s, c in columns.items()}
        self.table.import_rows(ids.contiguous(), {s: c.contiguous() for s, c in columns.items()})
        self.rows += int(ids.shape[0])
