"""SparseAdagrad / SparseAdam: parity with torch optimizers, growth, state_dict, bookkeeping."""
import json

import pytest
import torch

from recckpt.state import initializers
from recckpt.state.hashtable import HashTable
from recckpt.state.optim import SparseAdagrad, SparseAdam
from recckpt.state.protocol import SlotSpec

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
DIM = 5
N = 40
INIT_C = 0.03125  # exactly representable in bf16/fp16


def T(xs):
    return torch.tensor(xs, dtype=torch.int64)


class Setup:
    """A HashTable and an equivalent dense nn.Embedding (row i <-> id_list[i])."""

    def __init__(self, dtype, sparse_dense, grow, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.dtype = dtype
        self.id_list = torch.randint(I64_MIN, I64_MAX, (N,), generator=g)
        self.id_list[:3] = T([I64_MIN, I64_MAX, -1])
        init_vals = (torch.randn(N, DIM, generator=g) * 0.1).to(dtype)
        self.first = N // 2 if grow else N
        self.table = HashTable("t", DIM, dtype=dtype, initializer=initializers.constant(INIT_C))
        self.table.import_rows(self.id_list[: self.first], {"embedding": init_vals[: self.first]})
        ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.emb = torch.nn.Embedding(N, DIM, sparse=sparse_dense, dtype=ref_dtype)
        with torch.no_grad():
            self.emb.weight.copy_(init_vals.to(ref_dtype))
            self.emb.weight[self.first :] = INIT_C

    def batch(self, step, size=12):
        avail = N if step >= 2 else self.first  # new ids appear from step 2 on when growing
        idx = torch.randint(0, avail, (size,), generator=self.g)
        idx[1] = idx[0]  # always a repeated id in the batch
        coef = torch.tensor([-1.0, -0.5, 0.5, 1.0, 2.0])[torch.randint(0, 5, (size, DIM), generator=self.g)]
        return idx, coef

    def loss(self, out, coef, nonlinear):
        out = out.to(coef.dtype) if out.dtype != torch.float64 else out
        loss = (out * coef.to(out.dtype)).sum()
        if nonlinear:
            loss = loss + (out**2).sum() * 3.0
        return loss

    def compare(self, rtol, atol, slot_pairs=()):
        rows = self.table.lookup(self.id_list)
        present = rows >= 0
        assert int(present.sum()) == len(self.table)
        w_t = self.table.weight[rows[present]].double()
        w_d = self.emb.weight.detach()[present].double()
        torch.testing.assert_close(w_t, w_d, rtol=rtol, atol=atol)
        for slot, ref in slot_pairs:
            torch.testing.assert_close(
                self.table.slot(slot)[rows[present]].double(), ref[present].double(), rtol=rtol, atol=atol
            )


def _train(s, opt_t, opt_d, steps, nonlinear, round_ref):
    for step in range(steps):
        for _ in range(2):  # two forward/backward passes accumulate before each step
            idx, coef = s.batch(step)
            s.loss(s.table(s.id_list[idx]), coef, nonlinear).backward()
            s.loss(s.emb(idx), coef, nonlinear).backward()
        opt_t.step()
        opt_d.step()
        opt_t.zero_grad()
        opt_d.zero_grad()
        if round_ref is not None:  # the table stores low precision: round the reference the same way
            with torch.no_grad():
                s.emb.weight.copy_(s.emb.weight.to(round_ref).to(s.emb.weight.dtype))


ADAGRAD_KW = dict(lr=0.1, eps=1e-6, initial_accumulator_value=0.05, lr_decay=0.01)


@pytest.mark.parametrize("grow", [False, True])
@pytest.mark.parametrize(
    "dtype, nonlinear, tol",
    [
        (torch.float32, True, dict(rtol=1e-5, atol=1e-6)),
        (torch.float64, True, dict(rtol=1e-12, atol=1e-13)),
        (torch.bfloat16, False, dict(rtol=1e-2, atol=1e-3)),
        (torch.float16, False, dict(rtol=2e-3, atol=1e-4)),
    ],
)
def test_adagrad_matches_torch_dense_adagrad(dtype, nonlinear, tol, grow):
    s = Setup(dtype, sparse_dense=False, grow=grow)
    opt_t = SparseAdagrad(s.table, **ADAGRAD_KW)
    opt_d = torch.optim.Adagrad(s.emb.parameters(), **ADAGRAD_KW)
    low = dtype in (torch.bfloat16, torch.float16)
    _train(s, opt_t, opt_d, steps=6, nonlinear=nonlinear, round_ref=dtype if low else None)
    state = opt_d.state[s.emb.weight]
    assert opt_t.steps() == {"t": int(state["step"])} == {"t": 6}
    s.compare(**tol, slot_pairs=[("adagrad.acc", state["sum"])])
    # something actually moved, and some rows did not get gradients
    assert not torch.allclose(s.table.weight.float(), s.table.weight.float().mean())


ADAM_KW = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6)


@pytest.mark.parametrize("grow", [False, True])
@pytest.mark.parametrize(
    "dtype, nonlinear, tol",
    [
        (torch.float32, True, dict(rtol=1e-5, atol=1e-6)),
        (torch.float64, True, dict(rtol=1e-12, atol=1e-13)),
        (torch.bfloat16, False, dict(rtol=1e-2, atol=1e-3)),
    ],
)
def test_adam_matches_torch_sparse_adam(dtype, nonlinear, tol, grow):
    s = Setup(dtype, sparse_dense=True, grow=grow)
    opt_t = SparseAdam(s.table, **ADAM_KW)
    opt_d = torch.optim.SparseAdam(list(s.emb.parameters()), **ADAM_KW)
    low = dtype in (torch.bfloat16, torch.float16)
    _train(s, opt_t, opt_d, steps=6, nonlinear=nonlinear, round_ref=dtype if low else None)
    state = opt_d.state[s.emb.weight]
    assert opt_t.steps() == {"t": state["step"]} == {"t": 6}
    s.compare(**tol, slot_pairs=[("adam.m", state["exp_avg"]), ("adam.v", state["exp_avg_sq"])])


def test_fp32_parity_is_tight_not_vacuous():
    """The tolerance above must detect a wrong hyper-parameter."""
    s = Setup(torch.float32, sparse_dense=True, grow=False)
    opt_t = SparseAdam(s.table, lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    opt_d = torch.optim.SparseAdam(list(s.emb.parameters()), lr=0.05, betas=(0.8, 0.951), eps=1e-6)
    _train(s, opt_t, opt_d, steps=3, nonlinear=True, round_ref=None)
    with pytest.raises(AssertionError):
        s.compare(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- slots and bookkeeping
def test_slots_added_at_construction():
    t = HashTable("t", 4)
    t.lookup(T([1, 2]), insert=True)
    SparseAdagrad(t, initial_accumulator_value=0.25)
    SparseAdam([t])
    assert t.slot_names == ["embedding", "adagrad.acc", "adam.m", "adam.v"]
    for name in ("adagrad.acc", "adam.m", "adam.v"):
        assert t.slot_spec(name) == SlotSpec(torch.float32, (4,), "sparse_opt")
    for dtype, slot_dtype in [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                              (torch.float64, torch.float64)]:
        t2 = HashTable("t", 3, dtype=dtype)
        SparseAdam(t2)
        SparseAdagrad(t2)
        for name in ("adagrad.acc", "adam.m", "adam.v"):
            assert t2.slot_spec(name) == SlotSpec(slot_dtype, (3,), "sparse_opt")
    assert bool((t.slot("adagrad.acc") == 0.25).all()) and bool((t.slot("adam.v") == 0).all())
    t.lookup(T([3]), insert=True)
    assert t.slot("adagrad.acc")[2].tolist() == [0.25] * 4


def test_finds_tables_in_module_and_ignores_dense_params():
    model = torch.nn.ModuleDict(
        {"a": HashTable("a", 2), "b": torch.nn.Sequential(torch.nn.Linear(2, 2), HashTable("b", 3))}
    )
    opt = SparseAdam(model)
    assert [t.name for t in opt.tables] == ["a", "b"]
    assert list(opt.state_dict()["tables"]) == ["a", "b"]
    with pytest.raises(ValueError, match="no HashTable"):
        SparseAdam(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="named 'x'"):
        SparseAdagrad([HashTable("x", 2), HashTable("x", 2)])
    with pytest.raises(TypeError):
        SparseAdagrad([torch.nn.Linear(2, 2)])
    t = HashTable("y", 2)
    assert len(SparseAdagrad([t, t]).tables) == 1


def test_hyperparameter_validation():
    t = HashTable("t", 2)
    for kw in (dict(lr=-1.0), dict(eps=-1e-3), dict(lr_decay=-0.1), dict(initial_accumulator_value=-1.0)):
        with pytest.raises(ValueError):
            SparseAdagrad(t, **kw)
    for kw in (dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)), dict(betas=(0.9,)), dict(lr=float("nan"))):
        with pytest.raises(ValueError):
            SparseAdam(t, **kw)


def test_zero_grad_and_step_without_grad():
    t = HashTable("t", 3)
    opt = SparseAdagrad(t, lr=1.0)
    t(T([1, 2])).sum().backward()
    before = t.weight.clone()
    opt.zero_grad()
    opt.step()
    assert torch.equal(t.weight, before) and opt.steps() == {"t": 0}
    t(T([1])).sum().backward()
    opt.step()
    assert opt.steps() == {"t": 1}
    assert not torch.equal(t.weight[0], before[0]) and torch.equal(t.weight[1], before[1])
    assert not t.has_grad()
    opt.step()  # nothing pending: no change, step unchanged
    assert opt.steps() == {"t": 1}


def test_step_with_closure():
    t = HashTable("t", 2)
    opt = SparseAdam(t)

    def closure():
        loss = t(T([5])).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.ndim == 0 and opt.steps() == {"t": 1}


def test_only_rows_with_gradients_change():
    t = HashTable("t", 3)
    opt = SparseAdam(t, lr=0.1)
    t.lookup(torch.arange(100), insert=True)
    before = {k: t.slot(k).clone() for k in t.slot_names}
    t(T([3, 50, 3])).pow(2).sum().backward()
    opt.step()
    changed = set()
    for k in t.slot_names:
        diff = (t.slot(k) != before[k]).any(dim=1).nonzero().flatten().tolist()
        changed |= set(diff)
    assert changed == {3, 50}


# ---------------------------------------------------------------- state_dict
@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_checkpoint_resume_is_exact(kind):
    """Save (model state_dict + optimizer state_dict through JSON), restore into fresh objects,
    continue: identical to not stopping. Fails if step counts are not restored."""

    def make(seed):
        torch.manual_seed(seed)
        t = HashTable("t", 4)
        t.lookup(torch.arange(30), insert=True)  # every id the batches use; no RNG use later
        opt = (SparseAdagrad(t, lr=0.1, lr_decay=0.5) if kind == "adagrad"
               else SparseAdam(t, lr=0.1, betas=(0.5, 0.6)))
        return torch.nn.ModuleDict({"t": t}), opt

    def train(model, opt, batches):
        for ids in batches:
            (model["t"](ids) ** 2).sum().backward()
            opt.step()

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 30, (16,), generator=g) for _ in range(8)]
    model, opt = make(0)
    train(model, opt, batches[:4])

    sd_model = model.state_dict()
    sd_opt = json.loads(json.dumps(opt.state_dict()))
    model2, opt2 = make(123)
    model2.load_state_dict(sd_model)
    opt2.load_state_dict(sd_opt)
    assert opt2.steps() == opt.steps() == {"t": 4}
    assert opt2.state_dict() == opt.state_dict()

    train(model, opt, batches[4:])
    train(model2, opt2, batches[4:])
    a, b = model["t"], model2["t"]
    assert torch.equal(a.ids(), b.ids())
    for k in a.slot_names:
        assert torch.equal(a.slot(k), b.slot(k)), k


def test_load_state_dict_validation():
    t = HashTable("t", 2)
    opt = SparseAdam(t)
    sd = opt.state_dict()
    assert sd == {"optimizer": "SparseAdam", "hyperparams": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8},
                  "tables": {"t": {"step": 0}}}
    with pytest.raises(ValueError, match="SparseAdagrad"):
        SparseAdagrad(t).load_state_dict(sd)
    bad = json.loads(json.dumps(sd))
    bad["tables"] = {"other": {"step": 3}}
    with pytest.raises(ValueError, match="other"):
        opt.load_state_dict(bad)
    opt.load_state_dict(bad, strict=False)
    assert opt.steps() == {"t": 0}
    bad = json.loads(json.dumps(sd))
    bad["tables"]["t"]["step"] = -2
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(bad)
    bad = json.loads(json.dumps(sd))
    del bad["hyperparams"]["betas"]
    with pytest.raises(ValueError, match="betas"):
        opt.load_state_dict(bad)
    good = json.loads(json.dumps(sd))
    good["hyperparams"]["lr"] = 0.5
    good["tables"]["t"]["step"] = 9
    opt.load_state_dict(good)
    assert opt.lr == 0.5 and opt.steps() == {"t": 9}


def test_adagrad_loaded_initial_accumulator_applies_to_new_rows():
    t = HashTable("t", 2)
    opt = SparseAdagrad(t, initial_accumulator_value=0.0)
    sd = opt.state_dict()
    sd["hyperparams"]["initial_accumulator_value"] = 0.75
    opt.load_state_dict(sd)
    t.lookup(T([1]), insert=True)
    assert t.slot("adagrad.acc")[0].tolist() == [0.75, 0.75]


def test_large_batch_step_is_vectorised_and_correct():
    """Many rows, many duplicates: compare with dense Adagrad on the touched rows."""
    t = HashTable("t", 16, initializer=initializers.zeros())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (200_000,), generator=g)
    opt = SparseAdagrad(t, lr=0.1)
    t(ids).sum().backward()
    opt.step()
    rows = t.lookup(ids)
    counts = torch.bincount(rows, minlength=len(t)).float()
    # acc = count^2, w = -lr * count / (count + eps)
    torch.testing.assert_close(t.slot("adagrad.acc")[:, 0], counts**2)
    torch.testing.assert_close(t.weight[:, 0], torch.full((len(t),), -0.1))


def test_empty_batch_counts_a_step_like_torch():
    """torch.optim.SparseAdam advances a parameter's step whenever it has a (possibly empty) grad."""
    t = HashTable("t", 2)
    opt = SparseAdam(t)
    emb = torch.nn.Embedding(3, 2, sparse=True)
    ref = torch.optim.SparseAdam(list(emb.parameters()))
    empty = torch.empty(0, dtype=torch.int64)
    t(empty).sum().backward()
    emb(empty).sum().backward()
    opt.step()
    ref.step()
    assert opt.steps() == {"t": ref.state[emb.weight]["step"]} == {"t": 1}
    assert len(t) == 0


def test_a_table_worker_0_did_not_hold_has_no_saved_step_count_and_a_strict_load_says_so(tmp_path):
    """Only worker 0's sparse optimizer state is saved. A table that only another worker held (a model
    whose ranks differ) had its Adam moments loaded with step 0 and nothing said: a strict load now
    refuses it, naming the table; a non-strict one loads and warns."""
    import warnings

    import recckpt

    def model_for(names):
        return torch.nn.ModuleDict({n: recckpt.HashTable(n, dim=4) for n in names})

    for rank, names in ((0, ["a"]), (1, ["a", "b"])):   # two workers' shards, saved from this process
        m = model_for(names)
        opt = recckpt.SparseAdam(list(m.values()), lr=0.1)
        ids = torch.arange(100)
        for _ in range(3):
            sum(t(ids[recckpt.partition(ids, 2) == rank]).sum() for t in m.values()).backward()
            opt.step()
        recckpt.Saver(m, opt, output_dir=str(tmp_path)).save("c", shard_id=rank, shard_num=2, step=3)
    m = model_for(["a", "b"])
    opt = recckpt.SparseAdam(list(m.values()), lr=0.1)
    with pytest.raises(recckpt.errors.IncompatibleCheckpointError, match=r"step counts of tables \['b'\]"):
        recckpt.Saver(m, opt, output_dir=str(tmp_path)).load(ckpt_id="c")
    assert len(m["b"]) == 0 and opt.steps() == {"a": 0, "b": 0}   # nothing loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recckpt.Saver(m, opt, output_dir=str(tmp_path)).load(ckpt_id="c", load_conf={"strict": False})
    assert any("step counts of tables ['b']" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert opt.steps()["a"] == 3 and len(m["b"]) > 0
