"""A fixed-size table of which one process holds several column ranges (`ColumnPieces`: TorchRec's
column-wise plans with several column shards on a rank), through the generic save and load paths in one
process: each range is its own column block with its own per-row value, in sync saves, async snapshots,
loads into the same ranges, into whole rows, and the model-free reader. (Real DMP sharding on gloo:
tests/torchrec_tests/test_column_pieces.py.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

import recckpt
from helpers.fake_tables import OwnExtraState
from recckpt import Saver
from recckpt.errors import InvalidArgumentError
from recckpt.state.protocol import RowRangeLayout, SlotSpec, SparseTableMeta, pieces_of
from recckpt.train.snapshot import HostBuffers

N, D = 37, 6
BLOCKS = ((0, 2), (2, 4), (4, 6))


def _meta(name):
    return SparseTableMeta(name, {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
                                  "rowwise_adagrad.acc": SlotSpec(torch.float32, (), "sparse_opt")}, N)


class Piece:
    """Columns [c0, c1) of every row, and that column shard's own per-row value."""

    def __init__(self, name, c0, c1, seed):
        g = torch.Generator().manual_seed(seed)
        self.name, self.c0, self.c1 = name, c0, c1
        self.emb, self.acc = torch.randn(N, c1 - c0, generator=g), torch.rand(N, generator=g)

    def sparse_meta(self):
        return _meta(self.name)

    def row_layout(self):
        return RowRangeLayout(N, ((0, N),), (self.c0, self.c1), False, BLOCKS)

    def export_chunks(self, slots, max_rows):
        for s in range(0, N, max_rows):
            cols = {"embedding": self.emb[s:s + max_rows], "rowwise_adagrad.acc": self.acc[s:s + max_rows]}
            yield torch.arange(s, min(N, s + max_rows)), {k: cols[k] for k in slots}

    def import_rows(self, ids, columns):
        if "embedding" in columns:
            self.emb[ids] = columns["embedding"]
        if "rowwise_adagrad.acc" in columns:
            self.acc[ids] = columns["rowwise_adagrad.acc"]

    def clear_rows(self):
        pass


class PiecedTable(OwnExtraState, torch.nn.Module):
    """One process holding every column shard of a table, each its own range (`ColumnPieces`)."""

    def __init__(self, name="t", seed=0):
        super().__init__()
        self.name = name
        self.pieces = [Piece(name, c0, c1, seed + k) for k, (c0, c1) in enumerate(BLOCKS)]

    def sparse_meta(self):
        return _meta(self.name)

    def column_pieces(self):
        return self.pieces

    def row_layout(self):
        raise InvalidArgumentError("several column ranges: use pieces_of")

    def export_chunks(self, slots, max_rows):
        raise InvalidArgumentError("several column ranges: use pieces_of")

    def import_rows(self, ids, columns):
        raise InvalidArgumentError("several column ranges: use pieces_of")

    def whole(self):
        return torch.cat([p.emb for p in self.pieces], dim=1)


class WholeRows(PiecedTable):
    """The same table, every column in one range (a row-wise or unsharded load)."""

    def __init__(self, name="t"):
        super().__init__(name, seed=99)
        self.piece = Piece(name, 0, D, 99)
        self.piece.row_layout = lambda: RowRangeLayout(N, ((0, N),))

    def column_pieces(self):
        return [self.piece]

    def row_layout(self):
        return self.piece.row_layout()

    def export_chunks(self, slots, max_rows):
        return self.piece.export_chunks(slots, max_rows)

    def import_rows(self, ids, columns):
        self.piece.import_rows(ids, columns)


def _model(table):
    m = torch.nn.Module()
    m.t = table
    return m


def _same_pieces(a: PiecedTable, b: PiecedTable):
    for pa, pb in zip(a.pieces, b.pieces):
        assert torch.equal(pa.emb, pb.emb), (pa.c0, pa.c1)
        assert torch.equal(pa.acc, pb.acc), f"columns [{pa.c0}, {pa.c1}): the shard's own per-row value"


def test_pieces_of_gives_the_ranges_or_the_table_itself():
    t = PiecedTable()
    assert pieces_of(t) == t.pieces
    one = WholeRows()
    assert pieces_of(one) == [one]


@pytest.mark.parametrize("snapshot", [False, True], ids=["sync", "async_snapshot"])
def test_each_range_is_its_own_block_and_loads_back_exactly(tmp_path, snapshot):
    src = PiecedTable(seed=1)
    s = Saver(_model(src), output_dir=str(tmp_path))
    if snapshot:
        s.write("c1", s.capture_copy(HostBuffers()))
    else:
        s.save("c1")
    with open(tmp_path / "c1" / "manifest.json") as f:
        blocks = json.load(f)["tables"]["t"]["column_blocks"]["blocks"]
    assert [tuple(b) for b in blocks] == list(BLOCKS)
    recckpt.verify(str(tmp_path / "c1")).raise_if_failed()

    dst = PiecedTable(seed=50)
    r = Saver(_model(dst), output_dir=str(tmp_path)).load()
    assert r.tables == ["t"] and r.sparse_rows == N, r
    _same_pieces(src, dst)


def test_a_whole_row_load_joins_the_ranges_and_averages_the_per_row_values(tmp_path):
    src = PiecedTable(seed=2)
    Saver(_model(src), output_dir=str(tmp_path)).save("c1")
    dst = WholeRows()
    Saver(_model(dst), output_dir=str(tmp_path)).load()
    assert torch.equal(dst.piece.emb, src.whole())
    want = sum(p.acc.double() * (p.c1 - p.c0) for p in src.pieces) / D
    assert torch.allclose(dst.piece.acc.double(), want, rtol=1e-6, atol=0)
    # and back: a whole-row save gives every range the row's value
    Saver(_model(dst), output_dir=str(tmp_path / "w")).save("c2")
    back = PiecedTable(seed=7)
    Saver(_model(back), output_dir=str(tmp_path / "w")).load()
    assert torch.equal(back.whole(), dst.piece.emb)
    for p in back.pieces:
        assert torch.equal(p.acc, dst.piece.acc)


def test_the_model_free_reader_joins_the_blocks(tmp_path):
    src = PiecedTable(seed=3)
    Saver(_model(src), output_dir=str(tmp_path)).save("c1")
    view = recckpt.open(os.path.join(str(tmp_path), "c1"))
    found, got = view.lookup("t", torch.arange(N), slots=["embedding"], as_torch=True)
    assert bool(torch.as_tensor(found).all())
    assert torch.equal(got["embedding"], src.whole())
