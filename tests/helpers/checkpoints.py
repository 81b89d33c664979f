"""Test-only: real checkpoints with known contents for the reader, export and CLI tests.

`make_checkpoint` saves one table ('user': embedding, adagrad.acc, freq, last_step) with a Saver, from
one worker or from `workers` shards saved by this process (Saver.save(shard_id=i, shard_num=n)), so
the expected rows are known exactly."""
from __future__ import annotations

import numpy as np
import torch

from helpers.tables import DictTable
from recckpt import SaveOptions, Saver
from recckpt.state.protocol import SlotSpec

DIM = 8
SPEC = {"embedding": SlotSpec(torch.float32, (DIM,), "sparse"),
        "adagrad.acc": SlotSpec(torch.float32, (DIM,), "sparse_opt"),
        "freq": SlotSpec(torch.int64, (), "sparse"),
        "last_step": SlotSpec(torch.int64, (), "sparse")}
FAST = SaveOptions(fsync=False)


class Model(torch.nn.Module):
    def __init__(self, table: DictTable):
        super().__init__()
        self.user = table
        self.lin = torch.nn.Linear(4, 3)


class Pos:
    """IO state: a reader position."""

    def __init__(self, pos):
        self.pos = pos

    def dump_io_state(self):
        return {"pos": self.pos}

    def load_io_state(self, s):
        self.pos = s["pos"]


def table_rows(n: int = 1000, seed: int = 0) -> dict[str, np.ndarray]:
    """ids (spread over the int64 range, including negatives) and one array per slot."""
    g = np.random.default_rng(seed)
    ids = np.unique(g.integers(-(1 << 62), 1 << 62, size=n, dtype=np.int64))
    m = len(ids)
    emb = g.standard_normal((m, DIM), dtype=np.float32) * np.float32(3)
    emb[0] = 0.0                # a constant row: int8 scale 0
    emb[1] = np.float32(1e-3) * g.standard_normal(DIM, dtype=np.float32)
    return {"ids": ids, "embedding": emb, "adagrad.acc": np.abs(g.standard_normal((m, DIM), dtype=np.float32)),
            "freq": g.integers(0, 20, size=m, dtype=np.int64), "last_step": g.integers(0, 100, size=m, dtype=np.int64)}


def make_checkpoint(out: str, ckpt_id: str, rows: dict[str, np.ndarray], workers: int = 1, dense_value=0.5,
                    extras: dict | None = None) -> None:
    """Save `rows` as checkpoint `ckpt_id` under `out` (a path or fsspec URL), split over `workers` shards."""
    for w in range(workers):
        sel = np.arange(len(rows["ids"]))[w::workers]
        t = DictTable("user", SPEC)
        t.set_rows(torch.from_numpy(rows["ids"][sel]), {k: torch.from_numpy(rows[k][sel]) for k in SPEC})
        m = Model(t)
        with torch.no_grad():
            m.lin.weight.fill_(dense_value)
            m.lin.bias.fill_(dense_value)
        s = Saver(m, output_dir=out, options=FAST, max_keep=None)
        for k, v in (extras or {}).items():
            s.register_for_checkpointing(k, v)
        s.register_io_state("reader", Pos(100 + w))
        if workers == 1:
            s.save(ckpt_id)
        else:
            s.save(ckpt_id, shard_id=w, shard_num=workers)


def by_id(ids: np.ndarray, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows sorted by id (reader output comes in bucket order)."""
    o = np.argsort(ids, kind="stable")
    return {"ids": ids[o], **{k: v[o] for k, v in cols.items()}}
