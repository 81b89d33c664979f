"""HashTable: lookup/insert semantics, growth, gradients, slots, the SparseState implementation,
state_dict integration and a scale check."""
import copy
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

from recckpt.state import initializers
from recckpt.state.hashtable import HashTable
from recckpt.state.protocol import SlotSpec, SparseState, SparseTableMeta, split_sparse_dense_state_dict

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREMES = [I64_MIN, I64_MIN + 1, -1, 0, 1, I64_MAX - 1, I64_MAX]

id_values = st.one_of(
    st.integers(I64_MIN, I64_MAX),
    st.integers(-20, 20),  # many repeats
    st.sampled_from(EXTREMES),
)
batches = st.lists(st.lists(id_values, min_size=0, max_size=40), min_size=1, max_size=8)


def T(xs):
    return torch.tensor(xs, dtype=torch.int64)


# ---------------------------------------------------------------- construction
def test_constructor_validation_and_defaults():
    t = HashTable("t", 8)
    assert t.dtype == torch.float32 and t.dim == 8 and len(t) == 0
    assert repr(t.initializer) == "normal(0.0, 0.01)"
    assert t.slot_names == ["embedding"]
    assert list(t.parameters()) == [] and list(t.buffers()) == []
    assert bool(t)  # truthy although empty
    assert "name='t'" in repr(t) and "dim=8" in repr(t)
    for bad in [dict(name="", dim=4), dict(name="t", dim=0), dict(name="t", dim=4, dtype=torch.int32),
                dict(name="t", dim=4, capacity=-1)]:
        with pytest.raises(ValueError):
            HashTable(**bad)
    with pytest.raises(TypeError):
        HashTable("t", 4, initializer=3.0)


def test_default_initializer_is_normal_std_001():
    torch.manual_seed(0)
    t = HashTable("t", 64)
    out = t(torch.arange(4000))
    assert abs(out.mean().item()) < 1e-3
    assert abs(out.std().item() - 0.01) < 5e-4


@pytest.mark.parametrize(
    "init, check",
    [
        (initializers.zeros(), lambda x: bool((x == 0).all())),
        (initializers.constant(0.5), lambda x: bool((x == 0.5).all())),
        (initializers.uniform(-0.2, 0.3), lambda x: x.min() >= -0.2 and x.max() <= 0.3 and x.std() > 0.05),
        (initializers.normal(1.0, 0.1), lambda x: abs(x.mean().item() - 1.0) < 0.02 and abs(x.std().item() - 0.1) < 0.01),
        (lambda t: torch.nn.init.constant_(t, 2.0), lambda x: bool((x == 2).all())),
    ],
)
def test_initializers(init, check):
    t = HashTable("t", 16, initializer=init)
    with torch.no_grad():
        assert check(t(torch.arange(500)))


def test_initializer_factories_pickle_and_validate():
    for init in (initializers.zeros(), initializers.constant(2), initializers.normal(0.5, 2.0),
                 initializers.uniform(-3, 4)):
        again = pickle.loads(pickle.dumps(init))
        assert repr(again) == repr(init)
        a, b = torch.empty(1000), torch.empty(1000)
        torch.manual_seed(3)
        init(a)
        torch.manual_seed(3)
        again(b)
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        initializers.normal(0, -1)
    with pytest.raises(ValueError):
        initializers.uniform(1, 0)


# ---------------------------------------------------------------- lookup/insert semantics
@settings(max_examples=60, deadline=None)
@given(batches=batches, capacity=st.integers(0, 5))
def test_training_lookup_matches_dict_model(batches, capacity):
    t = HashTable("t", 3, initializer=initializers.normal(0, 1), capacity=capacity)
    model = {}  # id -> embedding
    order = []
    for b in batches:
        ids = T(b)
        with torch.no_grad():
            out = t(ids)
        assert out.shape == (len(b), 3) and out.dtype == torch.float32
        for j, i in enumerate(b):
            if i in model:
                assert torch.equal(out[j], model[i]), (i, j)
            else:
                model[i] = out[j].clone()
                order.append(i)
        assert len(t) == len(model)
    assert t.ids().tolist() == order  # rows in first-occurrence order
    all_ids = T(order)
    rows = t.lookup(all_ids)
    assert rows.tolist() == list(range(len(order)))
    for r, i in enumerate(order):
        assert torch.equal(t.weight[r], model[i])
    # distinct ids really have distinct rows (no accidental aliasing)
    if len(order) > 1:
        assert t.weight.unique(dim=0).shape[0] == len(order)


@settings(max_examples=40, deadline=None)
@given(known=st.lists(id_values, max_size=30), query=st.lists(id_values, max_size=30))
def test_eval_mode_does_not_insert_and_returns_zeros(known, query):
    t = HashTable("t", 2, initializer=initializers.constant(1.0))
    t.lookup(T(known), insert=True)
    n = len(t)
    t.eval()
    out = t(T(query))
    assert len(t) == n
    ks = set(known)
    for j, i in enumerate(query):
        expect = 1.0 if i in ks else 0.0
        assert out[j].tolist() == [expect, expect]
    assert t.lookup(T(query)).tolist() == [
        t.ids().tolist().index(i) if i in ks else -1 for i in query
    ]


def test_eval_mode_on_empty_table_and_empty_ids():
    t = HashTable("t", 4).eval()
    assert torch.equal(t(T([1, 2])), torch.zeros(2, 4))
    assert t(T([])).shape == (0, 4)
    with torch.no_grad():
        assert t(T([5])).sum() == 0
    assert len(t) == 0
    t.train()
    assert t(torch.empty(2, 0, dtype=torch.int64)).shape == (2, 0, 4)


def test_any_shape_and_scalar_ids():
    t = HashTable("t", 5)
    ids = torch.tensor([[[3, 4], [3, I64_MIN]], [[I64_MAX, 4], [0, 0]]])
    out = t(ids)
    assert out.shape == (2, 2, 2, 5)
    assert torch.equal(out[0, 0, 0], out[0, 1, 0])
    assert torch.equal(t(torch.tensor(3)), out[0, 0, 0])
    assert t(torch.tensor(3)).shape == (5,)
    # non-contiguous ids
    nc = ids.transpose(0, 2)
    assert torch.equal(t(nc), out.transpose(0, 2))
    assert t.lookup(ids).shape == ids.shape


def test_rejects_non_int64_ids():
    t = HashTable("t", 2)
    with pytest.raises(TypeError):
        t(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError):
        t([1, 2])


def test_lookup_insert_flag():
    t = HashTable("t", 2).eval()
    assert t.lookup(T([7, 8, 7])).tolist() == [-1, -1, -1]
    assert t.lookup(T([7, 8, 7]), insert=True).tolist() == [0, 1, 0]
    assert t.lookup(T([8, 9])).tolist() == [1, -1]
    assert len(t) == 2


def test_growth_past_capacity_keeps_values():
    t = HashTable("t", 4, capacity=2)
    t.add_slot("cnt", torch.int64, (), init=7, category="sparse")
    with torch.no_grad():
        first = t(T([10, 20])).clone()
    caps = {t.capacity}
    for k in range(50):
        with torch.no_grad():
            t(torch.arange(100 + 10 * k, 100 + 10 * k + 10))
        caps.add(t.capacity)
    assert len(caps) > 3 and t.capacity >= len(t) == 502
    with torch.no_grad():
        assert torch.equal(t(T([10, 20])), first)
    assert bool((t.slot("cnt") == 7).all())
    assert t.ids()[:2].tolist() == [10, 20]


def test_reserve_presizes():
    t = HashTable("t", 4)
    t.reserve(1000)
    assert t.capacity == 1000
    t.lookup(torch.arange(1000), insert=True)
    assert t.capacity == 1000


# ---------------------------------------------------------------- gradients
def test_embeddings_are_not_parameters():
    model = torch.nn.Sequential(HashTable("t", 4), torch.nn.Linear(4, 1))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["1.weight", "1.bias"]


def test_gradients_only_for_looked_up_rows_and_match_dense():
    torch.manual_seed(1)
    t = HashTable("t", 3)
    t.lookup(T([100, 200, 300, 400, 500]), insert=True)  # rows 0..4
    ids = T([[300, 100], [300, 900]])  # 900 is new (row 5)
    out = t(ids)
    assert out.requires_grad
    w = torch.randn(2, 2, 3)
    (out * w).sum().backward()
    rows, grad = t.sparse_grad()
    got = dict(zip(t.ids()[rows].tolist(), grad))
    assert set(got) == {300, 100, 900}
    assert torch.allclose(got[300], w[0, 0] + w[1, 0])
    assert torch.allclose(got[100], w[0, 1])
    assert torch.allclose(got[900], w[1, 1])
    # reference: dense embedding over the same rows
    emb = torch.nn.Embedding(6, 3)
    with torch.no_grad():
        emb.weight.copy_(t.weight)
    (emb(t.lookup(ids)) * w).sum().backward()
    dense = torch.zeros(6, 3)
    dense[rows] = grad
    assert torch.allclose(dense, emb.weight.grad)
    assert bool((emb.weight.grad[[1, 3, 4]] == 0).all())


def test_multiple_backwards_accumulate_and_zero_grad():
    t = HashTable("t", 2, initializer=initializers.zeros())
    t(T([1, 2])).sum().backward()
    (3 * t(T([2, 3, 3]))).sum().backward()
    rows, grad = t.sparse_grad()
    got = {i: g.tolist() for i, g in zip(t.ids()[rows].tolist(), grad)}
    assert got == {1: [1, 1], 2: [4, 4], 3: [6, 6]}
    assert t.has_grad()
    # sparse_grad does not consume; pop does
    assert t.pop_sparse_grad() is not None and not t.has_grad() and t.sparse_grad() is None
    t(T([1])).sum().backward()
    t.zero_grad()
    assert t.sparse_grad() is None


def test_no_grad_records_nothing_and_eval_grads_skip_missing():
    t = HashTable("t", 2)
    with torch.no_grad():
        out = t(T([1, 2]))
    assert not out.requires_grad and not t.has_grad()
    t.eval()
    out = t(T([1, 5, 2, 5]))
    out.sum().backward()
    rows, grad = t.sparse_grad()
    assert sorted(t.ids()[rows].tolist()) == [1, 2] and len(t) == 2
    assert bool((grad == 1).all())


def test_grads_from_before_clear_are_dropped():
    t = HashTable("t", 2)
    out = t(T([1, 2]))
    t.clear_rows()
    out.sum().backward()
    assert not t.has_grad()


def test_leaf_grad_is_released():
    t = HashTable("t", 2)
    out = t(T([1, 2]))
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    rows, grad = t.sparse_grad()
    assert bool((grad == 2).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_float_dtypes_forward_backward(dtype):
    t = HashTable("t", 4, dtype=dtype)
    out = t(T([1, 2, 1]))
    assert out.dtype == dtype
    (out.float() * 2).sum().backward()
    rows, grad = t.sparse_grad()
    assert grad.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.tolist() == [[4.0] * 4, [2.0] * 4]


# ---------------------------------------------------------------- slots
def test_add_slot_on_non_empty_table():
    t = HashTable("t", 3)
    t.lookup(T([5, 6, 7]), insert=True)
    t.add_slot("cnt", torch.int32, (), init=4, category="sparse")
    t.add_slot("acc", torch.float32, (3,), init=0.25)
    t.add_slot("m", torch.float64, [2, 2], init=lambda x: x.fill_(-1.0))
    assert t.slot_names == ["embedding", "cnt", "acc", "m"]
    assert t.slot("cnt").tolist() == [4, 4, 4] and t.slot("cnt").dtype == torch.int32
    assert bool((t.slot("acc") == 0.25).all()) and t.slot("acc").shape == (3, 3)
    assert t.slot("m").shape == (3, 2, 2) and bool((t.slot("m") == -1).all())
    meta = t.sparse_meta()
    assert meta.slots["cnt"] == SlotSpec(torch.int32, (), "sparse")
    assert meta.slots["acc"].category == "sparse_opt"
    # new rows get the init too
    t.lookup(torch.arange(1000), insert=True)
    assert bool((t.slot("cnt") == 4).all()) and bool((t.slot("m") == -1).all())
    # slot writes through the live view
    t.slot("cnt")[0] += 1
    assert t.slot("cnt")[0] == 5


def test_add_slot_duplicates_and_exist_ok():
    t = HashTable("t", 3)
    t.lookup(T([1]), insert=True)
    t.add_slot("acc", torch.float32, (3,), init=1.0)
    t.slot("acc")[0] = 9.0
    with pytest.raises(ValueError, match="already exists"):
        t.add_slot("acc", torch.float32, (3,))
    with pytest.raises(ValueError):
        t.add_slot("acc", torch.float64, (3,), exist_ok=True)
    t.add_slot("acc", torch.float32, (3,), init=2.0, exist_ok=True)
    assert bool((t.slot("acc")[0] == 9).all())  # kept
    t.lookup(T([2]), insert=True)
    assert bool((t.slot("acc")[1] == 2).all())  # new init for new rows
    with pytest.raises(ValueError):
        t.add_slot("embedding", torch.float32, (3,))
    with pytest.raises(ValueError):
        t.add_slot("x", torch.float32, (3,), category="dense")
    with pytest.raises(TypeError):
        t.add_slot("x", torch.float32, (3,), init="zero")
    assert t.slot_names == ["embedding", "acc"]


# ---------------------------------------------------------------- SparseState
def test_is_sparse_state_and_meta():
    t = HashTable("items", 6, dtype=torch.bfloat16)
    assert isinstance(t, SparseState)
    t.lookup(T([1, 2, 3]), insert=True)
    m = t.sparse_meta()
    assert isinstance(m, SparseTableMeta)
    assert (m.name, m.num_rows, list(m.slots)) == ("items", 3, ["embedding"])
    assert m.slots["embedding"] == SlotSpec(torch.bfloat16, (6,), "sparse")


@pytest.mark.parametrize("max_rows", [1, 3, 7, 10**9])
def test_export_chunks_cover_every_id_once(max_rows):
    t = HashTable("t", 4)
    t.add_slot("cnt", torch.int64, (), init=3, category="sparse")
    ids = torch.randint(I64_MIN, I64_MAX, (50,))
    ids = torch.cat([ids, T(EXTREMES)])
    t.lookup(ids, insert=True)
    n = len(t)
    seen = []
    for cid, cols in t.export_chunks(["cnt", "embedding"], max_rows):
        assert 1 <= cid.numel() <= max_rows
        assert cid.dtype == torch.int64 and cid.is_contiguous() and cid.device.type == "cpu"
        assert list(cols) == ["cnt", "embedding"]
        assert cols["embedding"].shape == (cid.numel(), 4) and cols["embedding"].is_contiguous()
        assert cols["cnt"].shape == (cid.numel(),) and cols["cnt"].dtype == torch.int64
        assert torch.equal(cols["embedding"], t.weight[t.lookup(cid)])
        seen.extend(cid.tolist())
    assert len(seen) == n and sorted(seen) == sorted(set(ids.tolist()))
    assert seen == t.ids().tolist()  # row order


def test_export_chunks_are_zero_copy_views_and_detect_modification():
    t = HashTable("t", 4)
    t.lookup(torch.arange(10), insert=True)
    it = t.export_chunks(["embedding"], 4)
    ids, cols = next(it)
    assert cols["embedding"].data_ptr() == t.weight.data_ptr()
    assert ids.data_ptr() == t.store.ids.data_ptr()
    t.lookup(T([1000]), insert=True)
    with pytest.raises(RuntimeError, match="modified"):
        next(it)


def test_export_chunks_detect_modification_after_the_last_chunk():
    t = HashTable("t", 4)
    t.lookup(torch.arange(8), insert=True)
    it = t.export_chunks(["embedding"], 4)
    next(it)
    next(it)  # the last chunk: its views are still held by the consumer
    t.write_rows("embedding", T([5]), torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="modified"):
        next(it)
    unchanged = t.export_chunks(["embedding"], 4)
    assert len(list(unchanged)) == 2  # without a modification the iteration simply ends


def test_export_chunks_errors_and_empty():
    t = HashTable("t", 4)
    assert list(t.export_chunks(["embedding"], 5)) == []
    with pytest.raises(ValueError, match="nope"):
        t.export_chunks(["nope"], 5)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            t.export_chunks(["embedding"], bad)
    t.lookup(T([1]), insert=True)
    assert [c[0].tolist() for c in t.export_chunks([], 5)] == [[1]]


def test_import_rows_upsert_and_default_init():
    t = HashTable("t", 2, initializer=initializers.constant(0.5))
    t.add_slot("acc", torch.float32, (2,), init=0.1)
    t.add_slot("cnt", torch.int64, (), init=lambda x: x.fill_(9), category="sparse")
    t.lookup(T([1, 2, 3]), insert=True)
    t.slot("acc")[:] = 7.0
    # upsert: 2 exists, 10 and 11 new; acc not given -> init value for new ids, kept for id 2
    t.import_rows(T([10, 2, 11]), {"embedding": torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
                                   "cnt": T([4, 5, 6])})
    assert len(t) == 5 and t.ids().tolist() == [1, 2, 3, 10, 11]
    def by_id(slot, i):
        return t.slot(slot)[t.lookup(T([i]))[0]].tolist()

    assert by_id("embedding", 2) == [2.0, 2.0] and by_id("embedding", 10) == [1.0, 1.0]
    assert by_id("embedding", 1) == [0.5, 0.5]
    assert by_id("cnt", 2) == 5 and by_id("cnt", 11) == 6 and by_id("cnt", 3) == 9
    assert by_id("acc", 2) == [7.0, 7.0] and by_id("acc", 11) == pytest.approx([0.1, 0.1])
    assert by_id("acc", 1) == [7.0, 7.0]
    # only the embedding missing: existing id 3 keeps its embedding, new id 12 gets the initializer
    t.slot("embedding")[t.lookup(T([3]))[0]] = 4.0
    t.import_rows(T([3, 12]), {"acc": torch.ones(2, 2), "cnt": T([0, 0])})
    assert by_id("embedding", 3) == [4.0, 4.0] and by_id("embedding", 12) == [0.5, 0.5]
    assert by_id("acc", 12) == [1.0, 1.0]
    # all-new fast path, contiguous
    t.import_rows(T([20, 21]), {"embedding": torch.full((2, 2), 8.0)})
    assert by_id("embedding", 21) == [8.0, 8.0] and by_id("cnt", 21) == 9
    t.import_rows(T([]), {})
    assert len(t) == 8


@pytest.mark.parametrize(
    "cols, words",
    [
        ({"embedding": torch.zeros(2, 3)}, ["'t'", "'embedding'", "(2, 2)", "(2, 3)"]),
        ({"embedding": torch.zeros(3, 2)}, ["'t'", "'embedding'", "(2, 2)", "(3, 2)"]),
        ({"embedding": torch.zeros(2, 2, dtype=torch.float64)}, ["'t'", "'embedding'", "float32", "float64"]),
        ({"cnt": torch.zeros(2, 1, dtype=torch.int64)}, ["'t'", "'cnt'", "(2,)", "(2, 1)"]),
        ({"cnt": torch.zeros(2, dtype=torch.int32)}, ["'t'", "'cnt'", "int64", "int32"]),
        ({"bogus": torch.zeros(2)}, ["'t'", "'bogus'"]),
    ],
)
def test_import_rows_mismatch_errors_and_leave_table_unchanged(cols, words):
    t = HashTable("t", 2)
    t.add_slot("cnt", torch.int64, (), category="sparse")
    t.lookup(T([1]), insert=True)
    before = t.weight.clone()
    with pytest.raises(ValueError) as e:
        t.import_rows(T([1, 5]), cols)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert len(t) == 1 and torch.equal(t.weight, before)


def test_import_rows_rejects_bad_ids():
    t = HashTable("t", 2)
    with pytest.raises(ValueError, match="repeated"):
        t.import_rows(T([1, 2, 1]), {})
    with pytest.raises(ValueError):
        t.import_rows(T([[1, 2]]), {})
    with pytest.raises(ValueError):
        t.import_rows(torch.tensor([1, 2], dtype=torch.int32), {})
    assert len(t) == 0


def test_clear_rows():
    t = HashTable("t", 2, capacity=4)
    t.add_slot("acc", torch.float32, (2,))
    t(T([1, 2, 3])).sum().backward()
    cap = t.capacity
    t.clear_rows()
    assert len(t) == 0 and t.sparse_meta().num_rows == 0 and not t.has_grad()
    assert t.lookup(T([1, 2, 3])).tolist() == [-1, -1, -1]
    assert list(t.export_chunks(["embedding"], 10)) == []
    assert t.capacity == cap and t.slot_names == ["embedding", "acc"]
    assert t.lookup(T([3, 4]), insert=True).tolist() == [0, 1]
    assert t.ids().tolist() == [3, 4]


# ---------------------------------------------------------------- state_dict integration
class Model(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.users = HashTable("users", 4, dtype=dtype)
        self.items = HashTable("items", 3)
        self.mlp = torch.nn.Linear(7, 1)

    def forward(self, u, i):
        return self.mlp(torch.cat([self.users(u).float(), self.items(i)], -1))


def _snapshot(t):
    return {k: v.clone() for k, v in zip(["ids"] + t.slot_names, [t.ids()] + [t.slot(s) for s in t.slot_names])}


def test_state_dict_round_trip():
    torch.manual_seed(0)
    a = Model()
    a.users.add_slot("cnt", torch.int64, (), init=3, category="sparse")
    a(torch.randint(-10**12, 10**12, (64,)), torch.randint(0, 50, (64,)))
    sd = a.state_dict()
    assert list(sd) == ["users._extra_state", "items._extra_state", "mlp.weight", "mlp.bias"]
    assert sd["users._extra_state"] is a.users
    sparse, dense = split_sparse_dense_state_dict(sd)
    assert set(sparse) == {"users", "items"} and list(dense) == ["mlp.weight", "mlp.bias"]

    b = Model()
    b.items(T([999999]))  # pre-existing row must disappear on load
    b.load_state_dict(a.state_dict())
    for name in ("users", "items"):
        sa, sb = _snapshot(getattr(a, name)), _snapshot(getattr(b, name))
        assert list(sa) == list(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (name, k)
    assert b.users.slot_spec("cnt") == SlotSpec(torch.int64, (), "sparse")
    assert torch.equal(a.mlp.weight, b.mlp.weight)
    # independent copies
    b.users.weight.add_(1)
    assert not torch.equal(a.users.weight, b.users.weight)
    # loading a state_dict into itself is a no-op
    before = _snapshot(a.users)
    a.load_state_dict(a.state_dict())
    assert all(torch.equal(before[k], v) for k, v in _snapshot(a.users).items())


def test_set_extra_state_casts_and_checks_shapes():
    src = HashTable("users", 4)
    src.lookup(torch.arange(100), insert=True)
    dst = HashTable("users", 4, dtype=torch.bfloat16)
    dst.add_slot("only_here", torch.float32, (), init=2.0)
    dst.set_extra_state(src)
    assert dst.weight.dtype == torch.bfloat16
    assert torch.equal(dst.weight, src.weight.to(torch.bfloat16))
    assert bool((dst.slot("only_here") == 2).all())
    with pytest.raises(ValueError, match="row shape"):
        HashTable("users", 5).set_extra_state(src)
    with pytest.raises(TypeError):
        dst.set_extra_state({"not": "a table"})


def test_missing_extra_state_is_reported_by_strict_load():
    a = Model()
    sd = a.state_dict()
    del sd["users._extra_state"]
    with pytest.raises(RuntimeError, match="users._extra_state"):
        Model().load_state_dict(sd)


def test_deepcopy_and_pickle():
    t = HashTable("t", 3, initializer=initializers.uniform(-1, 1))
    t.add_slot("acc", torch.float32, (3,), init=0.5)
    t.lookup(T(EXTREMES), insert=True)
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert torch.equal(c.ids(), t.ids()) and torch.equal(c.weight, t.weight)
        assert torch.equal(c.slot("acc"), t.slot("acc"))
        assert c.lookup(T(EXTREMES)).tolist() == list(range(len(EXTREMES)))
        c.lookup(T([42]), insert=True)
        assert len(c) == len(t) + 1 and c.slot("acc")[-1].tolist() == [0.5] * 3


# ---------------------------------------------------------------- scale
def test_scale_two_million_ids_in_batches():
    t = HashTable("big", 8, initializer=initializers.zeros())
    gen = torch.Generator().manual_seed(0)
    all_ids = torch.randint(I64_MIN, I64_MAX, (2_000_000,), generator=gen)
    batch = 1 << 16
    with torch.no_grad():
        for s in range(0, all_ids.numel(), batch):
            t(all_ids[s : s + batch])
    uniq = all_ids.unique().numel()
    assert len(t) == uniq
    # every id maps to the row of its first occurrence; row i holds id i
    rows = t.lookup(all_ids)
    assert bool((rows >= 0).all())
    assert torch.equal(t.ids()[rows], all_ids)
    # writing each row's index through import_rows and reading it back through forward
    ids = t.ids()
    t.import_rows(ids, {"embedding": torch.arange(len(t), dtype=torch.float32).unsqueeze(1).expand(-1, 8).contiguous()})
    with torch.no_grad():
        out = t(all_ids[::997])
    assert torch.equal(out[:, 0], rows[::997].float())
    assert len(t) == uniq


def test_growth_under_inference_mode_keeps_storage_trainable():
    t = HashTable("t", 4)
    with torch.inference_mode():
        t(torch.arange(100))  # training mode: inserts and grows inside inference mode
        t.add_slot("acc", torch.float32, (4,))
        assert t(T([1])).shape == (1, 4)
    assert not t.weight.is_inference() and not t.slot("acc").is_inference()
    t(T([1, 2])).sum().backward()
    rows, grad = t.pop_sparse_grad()
    t.write_rows("embedding", rows, t.read_rows("embedding", rows) - grad)  # in-place update works


def test_low_precision_gradient_of_hot_id_is_summed_in_float32():
    t = HashTable("t", 2, dtype=torch.bfloat16)
    ids = torch.zeros(3000, dtype=torch.int64)  # one id, 3000 times
    (t(ids).float() * 1.01).sum().backward()
    rows, grad = t.sparse_grad()
    # bf16 accumulation would stall far below 3030 (spacing of bf16 at 2048 is 16)
    torch.testing.assert_close(grad, torch.full((1, 2), 3000 * float(torch.tensor(1.01).bfloat16())), rtol=1e-5, atol=0)
