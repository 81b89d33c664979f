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


class _HashModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = recckpt.HashTable("user", dim=D)


@pytest.mark.parametrize("world", [1, 2])
def test_a_hashtable_warm_starts_from_the_joined_blocks_each_rank_its_own_ids(tmp_path, world):
    """A column-split table into a HashTable (a model-bank warm start by row index): whole rows, the
    blocks' per-row values by their width-weighted mean (left out here: the HashTable has no such slot);
    on two processes each keeps the ids recckpt.partition gives it, and together they hold every row."""
    src = PiecedTable(seed=4)
    Saver(_model(src), output_dir=str(tmp_path)).save("c1")
    got = {}
    for rank in range(world):
        m = _HashModel()
        r = Saver(m, output_dir=str(tmp_path / "run")).load(
            ckpt_path=str(tmp_path / "c1"), direct_path=True, shard_id=rank, shard_num=world,
            load_conf={"rename": {"t": "user"}, "slots": ["embedding"]})
        ids = m.user.ids()
        assert r.tables == ["user"] and r.sparse_rows == len(ids)
        if world > 1:
            assert bool((recckpt.partition(ids, world) == rank).all()), "rank keeps its own ids"
        for i, row in zip(ids.tolist(), m.user.read_rows("embedding", m.user.lookup(ids))):
            assert i not in got
            got[i] = row
    assert sorted(got) == list(range(N))
    assert torch.equal(torch.stack([got[i] for i in range(N)]), src.whole())


class Flip(PiecedTable):
    """A table saved as column blocks, then (the layout changed under it) as whole rows with change
    tracking: how code before increments held such tables whole after a load wrote a chain that no
    load can fold. Only to build such a chain."""

    split = True

    def column_pieces(self):
        return self.pieces if self.split else [self]

    def row_layout(self):
        return RowRangeLayout(N, ((0, N),))

    def export_chunks(self, slots, max_rows):
        yield torch.arange(N), {"embedding": self.whole(), "rowwise_adagrad.acc": self.pieces[0].acc}

    def mark_changes(self):
        return 1

    def export_changes(self, since, slots, max_rows):
        from recckpt.state.protocol import Changes
        cols = {"embedding": self.whole()[:3], "rowwise_adagrad.acc": self.pieces[0].acc[:3]}
        return Changes(3, iter([(torch.arange(3), {k: cols[k] for k in slots})]), torch.empty(0, dtype=torch.int64))

    def forget_changes(self, upto):
        pass


def test_a_chain_folding_row_changes_onto_column_blocks_is_refused_before_anything_is_applied(tmp_path):
    src = Flip(seed=5)
    s = Saver(_model(src), output_dir=str(tmp_path))
    s.save("c1")
    src.split = False
    s.save("c2", incremental=True)
    with open(tmp_path / "c2" / "manifest.json") as f:
        assert json.load(f)["tables"]["t"].get("changes"), "the increment holds row changes (the chain to refuse)"
    dst = WholeRows()
    before = dst.piece.emb.clone()
    with pytest.raises(recckpt.errors.IncompatibleCheckpointError,
                       match="holds it as column blocks and the later link .* holds its row changes"):
        Saver(_model(dst), output_dir=str(tmp_path)).load(ckpt_id="c2")
    assert torch.equal(dst.piece.emb, before), "nothing applied"
    # every other tool says the same, by the same rule (chain.table_links), and verify no longer says OK
    why = "cannot be read through its chain: link .*c1 holds it as column blocks"
    c2 = str(tmp_path / "c2")
    report = recckpt.verify(c2)
    assert not report.ok and any("cannot be read through its chain" in p for p in report.problems), report
    for tool in (lambda: recckpt.open(c2).lookup("t", [1]), lambda: recckpt.export(c2, str(tmp_path / "x")),
                 lambda: recckpt.compact(c2, str(tmp_path / "elsewhere" / "c3"))):
        with pytest.raises(recckpt.errors.IncompatibleCheckpointError, match=why):
            tool()
    assert Saver(_model(WholeRows()), output_dir=str(tmp_path)).load(ckpt_id="c1").tables == ["t"], \
        "the link the message names loads"


class _Routed(OwnExtraState, torch.nn.Module):
    """A managed-collision-like table (`RoutedRows`: rows keyed by raw id in [0, H)); nothing may reach it."""

    def sparse_meta(self):
        return SparseTableMeta("mch", {"embedding": SlotSpec(torch.float32, (D,), "sparse")}, 0)

    def export_chunks(self, slots, max_rows):
        return iter(())

    def import_rows(self, ids, columns):
        raise AssertionError("no row may be imported")

    def id_space(self):
        return 1000

    def owned_ids(self):
        return None

    def plan_slots(self):
        return []

    def plan_rows(self, chunks, loaded_slots, admission):
        raise AssertionError("refused before planning")

    def keep(self, ids):
        raise AssertionError("refused before reading")


def test_a_managed_collision_table_is_refused_column_blocks_before_anything_is_applied(tmp_path):
    Saver(_model(PiecedTable(seed=6)), output_dir=str(tmp_path)).save("c1")
    with pytest.raises(recckpt.errors.IncompatibleCheckpointError,
                       match="table 't' was saved column-split .* managed-collision table 'mch' cannot read it"):
        Saver(_model(_Routed()), output_dir=str(tmp_path / "run")).load(
            ckpt_path=str(tmp_path / "c1"), direct_path=True, load_conf={"rename": {"t": "mch"}, "slots": ["embedding"]})


def test_whole_rows_of_a_hash_keyed_checkpoint_are_read_once_for_every_range(tmp_path):
    """A hash-keyed table (ids 0..N-1, hash buckets: no column groups to read a range's columns alone) into
    the ranges: every range gets its columns and the row's value, and each row is read once, not once a
    range."""
    from helpers.tables import DictTable
    src = DictTable("t", _meta("t").slots)
    whole = torch.randn(N, D)
    acc = torch.rand(N)
    src.import_rows(torch.arange(N), {"embedding": whole, "rowwise_adagrad.acc": acc})
    Saver(_model(src), output_dir=str(tmp_path)).save("c1")
    dst = PiecedTable(seed=8)
    r = Saver(_model(dst), output_dir=str(tmp_path)).load()
    assert r.sparse_rows == N
    assert torch.equal(dst.whole(), whole)
    for p in dst.pieces:
        assert torch.equal(p.acc, acc)
    one = Saver(_model(WholeRows()), output_dir=str(tmp_path)).load()   # the same rows into one range
    assert r.bytes_read <= 1.1 * one.bytes_read, (r.bytes_read, one.bytes_read)


def test_diff_compares_every_blocks_own_per_row_values(tmp_path):
    """The digests hold block 0's per-row value alone: a difference in another block's is not called the
    same without values, and is found with them (column range by column range of both sides' blocks)."""
    a = PiecedTable(seed=1)
    Saver(_model(a), output_dir=str(tmp_path / "a")).save("c1")
    Saver(_model(a), output_dir=str(tmp_path / "same")).save("c1")
    a.pieces[1].acc += 1.0                      # only block [2, 4)'s own value
    Saver(_model(a), output_dir=str(tmp_path / "b")).save("c1")
    pa, pb, ps = (str(tmp_path / d / "c1") for d in ("a", "b", "same"))
    r = recckpt.diff(pa, pb)
    assert not r.same and "t" in r.not_compared and "rowwise_adagrad.acc" in r.not_compared["t"]
    r = recckpt.diff(pa, pb, values=True)
    assert not r.same and r.values["t"].slots["rowwise_adagrad.acc"].changed_rows == N
    assert r.values["t"].slots["rowwise_adagrad.acc"].max_abs_diff == pytest.approx(1.0)
    assert r.values["t"].slots["embedding"].changed_rows == 0
    assert recckpt.diff(pa, ps, values=True).same
    # a whole-row checkpoint whose one value a row is every block's value: the same content
    w = WholeRows()
    w.piece.emb.copy_(a.whole())
    w.piece.acc.copy_(a.pieces[1].acc)
    for p in a.pieces:
        p.acc.copy_(a.pieces[1].acc)
    Saver(_model(a), output_dir=str(tmp_path / "even")).save("c1")
    Saver(_model(w), output_dir=str(tmp_path / "whole")).save("c1")
    r = recckpt.diff(str(tmp_path / "even" / "c1"), str(tmp_path / "whole" / "c1"), values=True)
    assert r.same, r
    w.piece.acc[3] += 1.0
    Saver(_model(w), output_dir=str(tmp_path / "whole2")).save("c1")
    r = recckpt.diff(str(tmp_path / "even" / "c1"), str(tmp_path / "whole2" / "c1"), values=True)
    assert r.values["t"].slots["rowwise_adagrad.acc"].changed_rows == 1
