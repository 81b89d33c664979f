"""Which rows of a sharded TorchRec table changed since a mark: recckpt's own tracking on the lookup path.

A fused optimizer updates, in backward, exactly the rows its kernel looked up in forward. So a forward
pre-hook on each embedding kernel of a sharded collection (the modules that receive the ids AFTER the
input distribution, as local row indices of this rank's shards) stamps the looked-up rows of each table
with the table's current generation: one int32 a local row, `stamps[ids] = gen`, vectorized, once per
kernel call. A mark is a generation; the rows changed since mark m are those stamped > m.

Why not TorchRec 1.8's `ModelDeltaTrackerTrec` (ID_ONLY): it hooks the same kernels, but under row-wise
plans it reports shard-local ids and under table-wise/column-wise global ones, `get_unique()` raises
after a table had no lookups unless `clear()` follows every read, and it keeps every id of every step
until read (memory grows with steps between saves); here the stamps are fixed at 4 bytes a local row,
whatever the number of steps. Measured cost per training step: benchmarks/README.md ("TorchRec").

Not tracked (their increments hold them whole): data-parallel tables, whose rows the dense optimizer
updates on every rank from its own batch only, and unsharded modules.
The hooks are installed by the first mark (a save, or the end of a load), so nothing is paid by a model
that is never checkpointed; rows looked up before the first mark are covered by that first (full) save.
"""
from __future__ import annotations

import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .table import TorchRecTable

_trackers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class TableTracker:
    """One table's stamps on this rank: {first row of a local row range: int32[rows]}."""

    def __init__(self, owner: "CollectionTracker"):
        self._owner = owner
        self.gen = 1                 # stamps start at 0: "not looked up since the hooks went in"
        self.first: Optional[int] = None
        self.stamps: Dict[int, torch.Tensor] = {}

    def _stamps(self, row0: int, rows: int) -> torch.Tensor:
        st = self.stamps.get(row0)
        if st is None or st.shape[0] != rows:
            st = self.stamps[row0] = torch.zeros(rows, dtype=torch.int32)
        return st

    def mark(self) -> int:
        self._owner.install()
        if self.first is None:
            self.first = self.gen
        m = self.gen
        self.gen += 1
        return m

    def changed(self, row0: int, rows: int, since: int) -> Optional[torch.Tensor]:
        """Local indices (int64) of rows [row0, row0 + rows) stamped after mark `since`; None when the
        marks do not go back that far (the caller then saves the table whole)."""
        if self.first is None or since < self.first or since >= self.gen:
            return None
        return torch.nonzero(self._stamps(row0, rows) > since).reshape(-1)

    def touch(self, row0: int, rows: int, local: torch.Tensor) -> None:
        """Rows written other than by training (a load): changes since every earlier mark."""
        if self.first is not None:
            self._stamps(row0, rows).numpy()[local.numpy()] = self.gen

    def touch_range(self, row0: int, rows: int, lo: int, hi: int) -> None:
        """Local rows [lo, hi) of the range starting at `row0` written other than by training (a load)."""
        if self.first is not None:
            self._stamps(row0, rows).numpy()[lo:hi] = self.gen   # numpy: see looked_up

    def looked_up(self, row0: int, rows: int, local: torch.Tensor) -> None:
        # numpy's fancy assignment: a few µs for thousands of ids, where torch's index_put under
        # intra-op threads on a busy CPU took milliseconds (measured: benchmarks/README.md, TorchRec)
        self._stamps(row0, rows).numpy()[local.numpy()] = self.gen


class CollectionTracker:
    """The trackers of one sharded collection's tables and the hooks that feed them."""

    def __init__(self, module):
        self._module = weakref.ref(module)
        self.tables: Dict[str, TableTracker] = {}
        self._handles: List = []
        self.seconds = 0.0           # time spent in the hooks (what tracking costs training)

    def table(self, name: str) -> TableTracker:
        t = self.tables.get(name)
        if t is None:
            t = self.tables[name] = TableTracker(self)
        return t

    def install(self) -> None:
        module = self._module()
        if self._handles or module is None:
            return
        from torchrec.distributed.embedding_kernel import BaseEmbedding
        # A sharded collection keeps its lookups in a plain list (`_lookups`, not registered as children:
        # TorchRec's own ModelDeltaTracker reads the same attribute); each holds one kernel per group.
        for lookup in getattr(module, "_lookups", None) or []:
            for m in lookup.modules():
                config = getattr(m, "config", None)
                if isinstance(m, BaseEmbedding) and config is not None and hasattr(config, "embedding_tables"):
                    self._handles.append(m.register_forward_pre_hook(self._hook_for(config)))

    def _hook_for(self, config):
        # (table tracker, row0, local rows, features of the table) in the order of the kernel's KJT keys
        plan: List[Tuple[Optional[TableTracker], int, int, int]] = []
        for t in config.embedding_tables:
            meta = t.local_metadata
            row0 = int(meta.shard_offsets[0]) if meta is not None else 0
            tracker = self.tables.get(t.name)
            plan.append((tracker, row0, int(t.local_rows), int(t.num_features())))

        def hook(_module, args):
            features = args[0] if args else None
            if features is None or not hasattr(features, "length_per_key"):
                return
            t0 = time.perf_counter()
            values = features.values()
            counts = features.length_per_key()
            k = pos = 0
            for tracker, row0, rows, nf in plan:
                n = sum(counts[k:k + nf])
                if tracker is not None and n:
                    tracker.looked_up(row0, rows, values[pos:pos + n])
                k += nf
                pos += n
            self.seconds += time.perf_counter() - t0
        return hook


def hook_seconds(model) -> float:
    """Seconds the tracking hooks of `model`'s sharded collections have run so far (for measurements)."""
    return sum(ct.seconds for m, ct in list(_trackers.items()) if any(x is m for x in model.modules()))


def attach(found, tables) -> None:
    """Give each table of a sharded, non-replicated collection its tracker (kept for the module's life)."""
    for f in found:
        if not f.sharded:
            continue
        ct = _trackers.get(f.module)
        if ct is None:
            ct = _trackers[f.module] = CollectionTracker(f.module)
        head = f"{f.prefix}{f.tables_attr}."
        for t in tables:
            # an MCH table (keyed by raw id, its own type) is not tracked: its increments hold it whole; so
            # is a table on a non-fused kernel, whose optimizer may move rows no lookup touched
            if isinstance(t, TorchRecTable) and t.name.startswith(head) and not t.replicated and t.trackable:
                t.tracker = ct.table(t.name[len(head):])
