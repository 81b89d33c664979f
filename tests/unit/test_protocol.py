"""The SparseState protocol, SlotSpec/SparseTableMeta validation and split_sparse_dense_state_dict.

The protocol is exercised with a small dict-backed implementation defined here, to show that nothing
in the protocol layer depends on HashTable.
"""
import copy
from typing import Dict, Iterator, Sequence, Tuple

import numpy as np
import pytest
import torch

from recckpt.state.protocol import (
    SlotSpec,
    SparseState,
    SparseTableMeta,
    split_sparse_dense_state_dict,
)


class DictTable:
    """Minimal SparseState: a dict id -> {slot: tensor row}. Deliberately not a torch Module."""

    def __init__(self, name: str, slots: Dict[str, SlotSpec], inits: Dict[str, float] = None):
        self.name = name
        self.slots = dict(slots)
        self.inits = inits or {k: 0.0 for k in slots}
        self.rows: Dict[int, Dict[str, torch.Tensor]] = {}

    def sparse_meta(self) -> SparseTableMeta:
        return SparseTableMeta(self.name, self.slots, len(self.rows))

    def export_chunks(self, slots: Sequence[str], max_rows: int) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        keys = list(self.rows)
        for s in range(0, len(keys), max_rows):
            part = keys[s : s + max_rows]
            ids = torch.tensor(part, dtype=torch.int64)
            cols = {
                k: torch.stack([self.rows[i][k] for i in part]).contiguous() for k in slots
            }
            yield ids, cols

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        for j, i in enumerate(ids.tolist()):
            row = {}
            for k, spec in self.slots.items():
                if k in columns:
                    row[k] = columns[k][j].clone()
                else:
                    row[k] = torch.full(spec.shape, self.inits[k], dtype=spec.dtype)
            self.rows[i] = row

    def clear_rows(self) -> None:
        self.rows.clear()


EMB = SlotSpec(torch.float32, (4,), "sparse")


# ---------------------------------------------------------------- SlotSpec
def test_slotspec_normalises_shape_and_allows_scalar_rows():
    s = SlotSpec(torch.float32, [3, np.int64(2)], "sparse")
    assert s.shape == (3, 2) and all(type(d) is int for d in s.shape)
    assert s.row_numel == 6 and s.row_bytes == 24
    scalar = SlotSpec(torch.int64, (), "sparse")
    assert scalar.shape == () and scalar.row_numel == 1 and scalar.row_bytes == 8
    assert SlotSpec(torch.bfloat16, (0,), "sparse_opt").row_bytes == 0


@pytest.mark.parametrize(
    "args, exc",
    [
        ((torch.float32, (4,), "dense"), ValueError),
        ((torch.float32, (4,), "Sparse"), ValueError),
        ((torch.float32, (-1,), "sparse"), ValueError),
        ((torch.float32, (2.0,), "sparse"), TypeError),
        ((torch.float32, (True,), "sparse"), TypeError),
        ((torch.float32, 4, "sparse"), TypeError),
        ((torch.float32, "4", "sparse"), TypeError),
        (("float32", (4,), "sparse"), TypeError),
        ((np.float32, (4,), "sparse"), TypeError),
    ],
)
def test_slotspec_rejects_invalid(args, exc):
    with pytest.raises(exc):
        SlotSpec(*args)


def test_slotspec_is_frozen_and_comparable():
    a = SlotSpec(torch.float32, (4,), "sparse")
    assert a == SlotSpec(torch.float32, (4,), "sparse")
    assert a != SlotSpec(torch.float32, (4,), "sparse_opt")
    with pytest.raises(Exception):
        a.dtype = torch.float64


# ---------------------------------------------------------------- SparseTableMeta
def test_meta_copies_slots_and_validates():
    slots = {"embedding": EMB}
    m = SparseTableMeta("t", slots, 3)
    slots["other"] = EMB
    assert list(m.slots) == ["embedding"]
    with pytest.raises(ValueError):
        SparseTableMeta("", {"embedding": EMB}, 0)
    with pytest.raises(ValueError):
        SparseTableMeta("t", {"embedding": EMB}, -1)
    with pytest.raises(TypeError):
        SparseTableMeta("t", {"embedding": "float32"}, 0)
    with pytest.raises(TypeError):
        SparseTableMeta("t", {"embedding": EMB}, True)


# ---------------------------------------------------------------- protocol
def test_runtime_protocol_check():
    assert isinstance(DictTable("a", {"embedding": EMB}), SparseState)
    assert not isinstance(torch.zeros(3), SparseState)
    assert not isinstance({"a": 1}, SparseState)

    class Partial:
        def sparse_meta(self):
            return None

        def export_chunks(self, slots, max_rows):
            return iter(())

    assert not isinstance(Partial(), SparseState)


def test_dict_table_round_trip_through_protocol():
    """The documented contract works for a non-HashTable implementation."""
    a = DictTable("a", {"embedding": EMB, "cnt": SlotSpec(torch.int64, (), "sparse")}, {"embedding": 0.0, "cnt": 7})
    a.import_rows(torch.tensor([5, -3]), {"embedding": torch.ones(2, 4)})
    assert a.rows[5]["cnt"].item() == 7
    chunks = list(a.export_chunks(["embedding", "cnt"], 1))
    assert [c[0].tolist() for c in chunks] == [[5], [-3]]
    a.clear_rows()
    assert a.sparse_meta().num_rows == 0


# ---------------------------------------------------------------- split_sparse_dense_state_dict
def test_split_routes_by_type_keeps_order_and_does_not_mutate():
    t1 = DictTable("users", {"embedding": EMB})
    t2 = DictTable("items", {"embedding": EMB})
    w = torch.randn(3)
    sd = {
        "mlp.weight": w,
        "emb.u._extra_state": t1,
        "step": 5,
        "emb.i._extra_state": t2,
        "mlp.bias": torch.zeros(2),
        "nested": {"x": [1, 2]},
    }
    before_keys = list(sd)
    before_ids = {k: id(v) for k, v in sd.items()}
    nested_copy = copy.deepcopy(sd["nested"])

    sparse, dense = split_sparse_dense_state_dict(sd)

    assert list(sd) == before_keys
    assert {k: id(v) for k, v in sd.items()} == before_ids
    assert sd["nested"] == nested_copy
    assert list(sparse) == ["users", "items"]
    assert sparse["users"] is t1 and sparse["items"] is t2
    assert list(dense) == ["mlp.weight", "step", "mlp.bias", "nested"]
    assert dense["mlp.weight"] is w and dense["nested"] is sd["nested"]
    assert dense is not sd


def test_split_rejects_duplicate_table_names_naming_both_keys():
    sd = {
        "a._extra_state": DictTable("same", {"embedding": EMB}),
        "dense": torch.zeros(1),
        "b._extra_state": DictTable("same", {"embedding": EMB}),
    }
    with pytest.raises(ValueError) as e:
        split_sparse_dense_state_dict(sd)
    msg = str(e.value)
    assert "a._extra_state" in msg and "b._extra_state" in msg and "same" in msg


def test_a_table_shared_by_two_modules_is_one_table_saved_and_loaded_once(tmp_path):
    """One HashTable in two towers (torch shares a module so): its state_dict holds it under both keys.
    Before, every save and load refused it as "two sparse tables named 'user'", telling the user to
    rename what is one table."""
    hashtable = pytest.importorskip("recckpt.state.hashtable")
    from recckpt import Saver

    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Module(), torch.nn.Module()
            self.a.emb = self.b.emb = hashtable.HashTable("user", 4)
            self.b.lin = torch.nn.Linear(4, 1)

    src = Towers()
    src.a.emb(torch.arange(10))
    sparse, dense = split_sparse_dense_state_dict(src.state_dict())
    assert list(sparse) == ["user"] and sparse["user"] is src.a.emb
    assert list(dense) == ["b.lin.weight", "b.lin.bias"]
    Saver(src, output_dir=str(tmp_path), max_keep=None).save("c")
    src.b.emb(torch.arange(10, 15))
    Saver(src, output_dir=str(tmp_path), max_keep=None).save("d")
    dst = Towers()
    Saver(dst, output_dir=str(tmp_path)).load(ckpt_id="d")
    assert dst.a.emb is dst.b.emb and sorted(dst.a.emb.ids().tolist()) == list(range(15))
    ids = src.a.emb.ids()
    assert torch.equal(dst.a.emb.read_rows("embedding", dst.a.emb.lookup(ids)),
                       src.a.emb.read_rows("embedding", src.a.emb.lookup(ids)))


def test_split_empty_and_all_dense():
    assert split_sparse_dense_state_dict({}) == ({}, {})
    sparse, dense = split_sparse_dense_state_dict({"x": torch.ones(1)})
    assert sparse == {} and list(dense) == ["x"]


def test_split_finds_hashtable_in_module_state_dict():
    hashtable = pytest.importorskip("recckpt.state.hashtable")
    model = torch.nn.ModuleDict(
        {"users": hashtable.HashTable("users", 4), "mlp": torch.nn.Linear(4, 1)}
    )
    sd = model.state_dict()
    sparse, dense = split_sparse_dense_state_dict(sd)
    assert list(sparse) == ["users"] and sparse["users"] is model["users"]
    assert list(dense) == ["mlp.weight", "mlp.bias"]
    assert "users._extra_state" in sd


# ------------------------------------------------- a table's own parameters are not dense state
def test_split_leaves_a_tables_own_parameters_and_buffers_out_of_dense():
    from helpers.tables import ParamTable
    model = torch.nn.ModuleDict({"emb": ParamTable("users", 4), "mlp": torch.nn.Linear(4, 1)})
    model["emb"].register_buffer("hits", torch.zeros(3))
    sd = model.state_dict()
    assert "emb.weight" in sd and "emb.hits" in sd   # the case: the table's storage is in state_dict
    sparse, dense = split_sparse_dense_state_dict(sd)
    assert list(sparse) == ["users"] and sparse["users"] is model["emb"]
    assert list(dense) == ["mlp.weight", "mlp.bias"]


def test_split_leaves_a_root_tables_own_parameters_out_but_keeps_submodules():
    from helpers.tables import ParamTable
    root = ParamTable("root", 2)
    root.mlp = torch.nn.Linear(2, 1)   # a submodule's parameters are not the table's
    sparse, dense = split_sparse_dense_state_dict(root.state_dict())
    assert list(sparse) == ["root"]
    assert list(dense) == ["mlp.weight", "mlp.bias"]


def test_parameter_backed_table_round_trips_through_saver(tmp_path):
    """Before the fix the table was saved twice and on load the dense copy of the full storage
    silently overwrote the rows just loaded."""
    import recckpt
    from helpers.tables import ParamTable

    def make():
        return torch.nn.ModuleDict({"emb": ParamTable("users", 4), "mlp": torch.nn.Linear(4, 1)})

    model = make()
    ids = torch.tensor([7, -3, 2**62, 0, 11, -2**63, 123456789, 5, 6, 1])
    model["emb"].import_rows(ids, {"embedding": torch.randn(len(ids), 4)})
    saver = recckpt.Saver(model, output_dir=str(tmp_path))
    saver.save("c1")

    fresh = make()
    fresh["emb"].import_rows(torch.tensor([99]), {"embedding": torch.full((1, 4), 5.0)})
    result = recckpt.Saver(fresh, output_dir=str(tmp_path)).load()
    got = dict(zip(fresh["emb"].ids[:fresh["emb"].n].tolist(), fresh["emb"].weight.detach()[:fresh["emb"].n]))
    assert set(got) == set(ids.tolist())
    for i, row in zip(ids.tolist(), model["emb"].weight.detach()[:len(ids)]):
        assert torch.equal(got[i], row)
    assert torch.equal(fresh["mlp"].weight, model["mlp"].weight)
    assert sorted(result.dense_keys) == ["mlp.bias", "mlp.weight"]


# ---------------------------------------------------------------- RowRangeLayout / FixedSize
def test_row_range_layout_normalises_and_counts():
    from recckpt.state.protocol import RowRangeLayout

    lay = RowRangeLayout(np.int64(100), [[0, 10], (np.int32(50), 60)], columns=[2, 6])
    assert lay.num_rows == 100 and type(lay.num_rows) is int
    assert lay.owned_rows == ((0, 10), (50, 60)) and lay.owned_count == 20
    assert lay.columns == (2, 6) and lay.replicated is False
    assert RowRangeLayout(5, ()).owned_count == 0
    full = RowRangeLayout(5, ((0, 5),), replicated=True)
    assert full.columns is None and full.replicated


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_rows=-1, owned_rows=()),
        dict(num_rows=True, owned_rows=()),
        dict(num_rows=10, owned_rows=((0, 11),)),
        dict(num_rows=10, owned_rows=((3, 3),)),
        dict(num_rows=10, owned_rows=((-1, 3),)),
        dict(num_rows=10, owned_rows=((5, 8), (0, 2))),
        dict(num_rows=10, owned_rows=((0, 5), (4, 8))),
        dict(num_rows=10, owned_rows=((0, 5, 6),)),
        dict(num_rows=10, owned_rows=((0.0, 5),)),
        dict(num_rows=10, owned_rows="0-5"),
        dict(num_rows=10, owned_rows=(), columns=(4, 4)),
        dict(num_rows=10, owned_rows=(), columns=(-1, 4)),
        dict(num_rows=10, owned_rows=(), columns=(0,)),
        dict(num_rows=10, owned_rows=(), replicated=1),
        # column blocks: sorted, non-empty, from 0 without gaps; this process's columns among them
        dict(num_rows=10, owned_rows=((0, 10),), columns=(0, 4), column_blocks=()),
        dict(num_rows=10, owned_rows=((0, 10),), columns=(0, 4), column_blocks=((0, 4), (5, 8))),
        dict(num_rows=10, owned_rows=((0, 10),), columns=(0, 4), column_blocks=((1, 4), (4, 8))),
        dict(num_rows=10, owned_rows=((0, 10),), columns=(0, 4), column_blocks=((4, 8), (0, 4))),
        dict(num_rows=10, owned_rows=((0, 10),), columns=(0, 5), column_blocks=((0, 4), (4, 8))),
        dict(num_rows=10, owned_rows=((0, 10),), columns=None, column_blocks=((0, 4), (4, 8))),
        dict(num_rows=10, owned_rows=((0, 10),), replicated=True, column_blocks=((0, 8),)),
    ],
)
def test_row_range_layout_rejects_bad_values(kwargs):
    from recckpt.errors import InvalidArgumentError
    from recckpt.state.protocol import RowRangeLayout

    with pytest.raises(InvalidArgumentError):
        RowRangeLayout(**kwargs)


def test_row_range_layout_column_blocks_normalised():
    from recckpt.state.protocol import RowRangeLayout

    lay = RowRangeLayout(10, ((0, 10),), columns=[4, 8], column_blocks=[[0, 4], (np.int64(4), 8)])
    assert lay.column_blocks == ((0, 4), (4, 8)) and lay.columns == (4, 8)
    assert RowRangeLayout(10, (), column_blocks=((0, 4), (4, 8))).column_blocks == ((0, 4), (4, 8))


def test_fixed_size_protocol_is_runtime_checkable():
    from recckpt.state.protocol import FixedSize, RowRangeLayout

    class Fixed(DictTable):
        def row_layout(self):
            return RowRangeLayout(8, ((0, 4),))

    assert isinstance(Fixed("t", {"embedding": EMB}), FixedSize)
    assert not isinstance(DictTable("t", {"embedding": EMB}), FixedSize)
    # RowRangeLayout is frozen: a plan cannot be changed behind the saver's back.
    with pytest.raises(Exception):
        Fixed("t", {"embedding": EMB}).row_layout().num_rows = 9


def test_implements_agrees_with_isinstance_on_every_protocol():
    """`implements` (the protocol check of the save, snapshot and load loops, with members listed once)
    gives isinstance's answer: tables, plain objects, a class missing a member, one whose instance opts
    out by setting a method to None, and snapshot copies (FixedSize by subclassing)."""
    from recckpt import HashTable
    from recckpt.state import protocol as P
    from recckpt.train.snapshot import HostBuffers, Snapshot, copy_snapshot

    class Partial:
        def sparse_meta(self):
            return None

        def export_chunks(self, slots, max_rows):
            return iter(())

    class OptedOut(Partial):
        def import_rows(self, ids, cols):
            pass

        def clear_rows(self):
            pass

        def row_layout(self):
            return None

    opted = OptedOut()
    opted.row_layout = None   # the class still defines it: typing says FixedSize
    own = Partial()
    own.row_layout = lambda: None   # the instance alone has it: FixedSize
    withdrawn = Partial()
    withdrawn.row_layout = None     # an instance attribute set to None: not FixedSize
    t = HashTable("t", dim=4)
    t(torch.arange(3))
    frozen = copy_snapshot(Snapshot([t], None, None, None), HostBuffers()).tables[0]
    protos = [P.SparseState, P.BulkAppend, P.ChangeTracking, P.AdoptStorage, P.FixedSize, P.RoutedRows]
    seen = set()
    for obj in (t, frozen, Partial(), OptedOut(), opted, own, withdrawn, object(), 3, "s", torch.nn.Linear(2, 2)):
        for proto in protos:
            want = isinstance(obj, proto)
            assert P.implements(obj, proto) == want, (type(obj).__name__, proto.__name__)
            seen.add(want)
    assert seen == {True, False}
    assert P.implements(own, P.FixedSize) and not P.implements(withdrawn, P.FixedSize)
