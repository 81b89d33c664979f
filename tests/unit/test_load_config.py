"""Selective loading: categories, globs, renames, casts, strictness, model-bank warm start."""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from helpers.tables import assert_tables_equal, table_contents
from recckpt import HashTable, LoadConfig, SaveOptions, Saver, SparseAdam
from recckpt.errors import IncompatibleCheckpointError, LoadConfigError

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)
CATS = ["sparse", "sparse_opt", "dense", "extra", "io_state"]


class M(torch.nn.Module):
    def __init__(self, dim=4, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.user = HashTable("user", dim=dim, dtype=dtype)
        self.item = HashTable("item", dim=dim)
        self.lin = torch.nn.Linear(2 * dim, 1)

    def forward(self, u, i):
        return self.lin(torch.cat([self.user(u).float(), self.item(i)], 1)).sum()


class IO:
    def __init__(self):
        self.pos = 0

    def dump_io_state(self):
        return {"pos": self.pos}

    def load_io_state(self, s):
        self.pos = s["pos"]


def trained(seed=0, dtype=torch.float32):
    m = M(seed=seed, dtype=dtype)
    opt = SparseAdam(m, lr=0.1)
    for k in range(3):
        m(torch.arange(10) + 100 * k, torch.arange(10) % 5).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def saved(tmp_path, seed=0, dtype=torch.float32):
    m, opt = trained(seed, dtype)
    s = Saver(m, sparse_optim=opt, output_dir=tmp_path, options=OPTS)
    extra, io = {"step": 3}, IO()
    io.pos = 42
    s.register_for_checkpointing("meta", extra)
    s.register_io_state("reader", io)
    s.save("c")
    return m, opt


def fresh(tmp_path, dtype=torch.float32):
    m = M(seed=99, dtype=dtype)
    opt = SparseAdam(m, lr=0.1)
    s = Saver(m, sparse_optim=opt, output_dir=tmp_path)
    extra, io = {}, IO()
    s.register_for_checkpointing("meta", extra)
    s.register_io_state("reader", io)
    return m, opt, s, extra, io


def combos():
    subsets = [list(c) for r in range(0, len(CATS) + 1) for c in itertools.combinations(CATS, r)]
    yield from ({"load": ["*"], "exclude": ex} for ex in subsets if len(ex) < len(CATS))   # (all: refused below)
    yield from ({"load": ld} for ld in subsets if ld)


@pytest.mark.parametrize("conf", list(combos()), ids=lambda c: f"load={c.get('load')}-exclude={c.get('exclude', [])}")
def test_every_load_exclude_combination(tmp_path, conf):
    src, src_opt = saved(tmp_path)
    m, opt, s, extra, io = fresh(tmp_path)
    before_w = m.lin.weight.detach().clone()
    cfg = LoadConfig.coerce(conf)
    s.load(load_conf=conf)
    want = {c: cfg.wants(c) for c in CATS}
    for name in ("user", "item"):
        got, exp = table_contents(getattr(m, name)), table_contents(getattr(src, name))
        if want["sparse"]:
            assert set(got["embedding"]) == set(exp["embedding"])
            for i, row in exp["embedding"].items():
                assert torch.equal(got["embedding"][i], row)
        else:
            assert len(got["embedding"]) == (len(exp["embedding"]) if want["sparse_opt"] else 0)
        for slot in ("adam.m", "adam.v"):
            for i, row in got[slot].items():
                if want["sparse_opt"]:
                    assert torch.equal(row, exp[slot][i]), (name, slot, i)
                else:
                    assert torch.count_nonzero(row) == 0, "excluded optimizer state must be fresh"
    if want["sparse_opt"]:
        assert opt.state_dict() == src_opt.state_dict()
    else:
        assert opt.state_dict() != src_opt.state_dict()
    assert torch.equal(m.lin.weight, src.lin.weight) == want["dense"]
    if not want["dense"]:
        assert torch.equal(m.lin.weight, before_w)
    assert (extra == {"step": 3}) == want["extra"]
    assert (io.pos == 42) == want["io_state"]


def test_rename_and_table_glob(tmp_path):
    src, _ = saved(tmp_path)

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.customer = HashTable("customer", dim=4)
            self.item = HashTable("item", dim=4)
            self.head = torch.nn.Linear(8, 1)

    m = Renamed()
    s = Saver(m, output_dir=tmp_path)
    res = s.load(load_conf={"rename": {"user": "customer", "lin.": "head."}, "load": ["sparse", "dense"],
                            "tables": ["user"]})
    assert res.tables == ["customer"]
    assert len(m.item) == 0, "tables glob excluded 'item'"
    assert_tables_equal(src.user, m.customer, slots=["embedding"])
    assert torch.equal(m.head.weight, src.lin.weight) and sorted(res.dense_keys) == ["head.bias", "head.weight"]


def test_a_table_copied_onto_another_leaves_its_own_name_alone_under_strict(tmp_path):
    """rename user -> item with tables [user]: checkpoint 'user' is loaded into model 'item', and model
    'user' (which the checkpoint holds, renamed away) is no target: not reported missing, left as it is.
    A model table the checkpoint does not hold at all is still missing."""
    src, _ = saved(tmp_path)
    m, _, s, _, _ = fresh(tmp_path)
    before = table_contents(m.user)
    res = s.load(load_conf={"rename": {"user": "item"}, "tables": ["user"], "load": ["sparse"], "strict": True})
    assert res.tables == ["item"] and res.missing == [], res
    assert_tables_equal(src.user, m.item, slots=["embedding"])
    assert table_contents(m.user) == before

    class Extra(M):
        def __init__(self):
            super().__init__()
            self.other = HashTable("other", dim=4)

    with pytest.raises(IncompatibleCheckpointError, match="model sparse table 'other' is not in the checkpoint"):
        Saver(Extra(), output_dir=tmp_path).load(load_conf={"load": ["sparse"], "strict": True})


def test_slot_glob(tmp_path):
    src, _ = saved(tmp_path)
    m, opt, s, _, _ = fresh(tmp_path)
    s.load(load_conf={"slots": ["embedding", "adam.m"], "load": ["sparse", "sparse_opt"]})
    got, exp = table_contents(m.user), table_contents(src.user)
    assert all(torch.equal(got["adam.m"][i], exp["adam.m"][i]) for i in exp["adam.m"])
    assert all(torch.count_nonzero(r) == 0 for r in got["adam.v"].values())


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float16)])
def test_cast(tmp_path, src_dtype, dst_dtype):
    src, _ = saved(tmp_path, dtype=src_dtype)
    m, _, s, _, _ = fresh(tmp_path, dtype=dst_dtype)
    s.load(load_conf={"load": ["sparse"]})
    exp = table_contents(src.user)["embedding"]
    got = table_contents(m.user)["embedding"]
    for i, row in exp.items():
        assert got[i].dtype == dst_dtype
        assert torch.equal(got[i], row.to(dst_dtype))


@pytest.mark.parametrize("dst_dtype,overflows", [(torch.float16, True), (torch.bfloat16, False)])
def test_a_cast_that_overflows_to_inf_is_warned_about(tmp_path, dst_dtype, overflows):
    """fp32 values beyond fp16's range become inf in the cast (as torch's copy makes them); the load said
    nothing (a helper's attack with PyTorch idioms). It now warns, naming the dense key and the table slot;
    bf16 has fp32's range, so nothing is lost that way and nothing is said."""
    class Both(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2).to(dtype)
            self.t = HashTable("t", dim=2, dtype=dtype)

    a = Both(torch.float32)
    a.t(torch.tensor([1, 2]))
    with torch.no_grad():
        a.lin.weight.copy_(torch.tensor([[1e6, -7e4], [1e-3, 0.5]]))
        a.t.weight.copy_(torch.tensor([[1e6, 1.0], [3.0, 2.0]]))
    Saver(a, output_dir=tmp_path).save("c")
    b = Both(dst_dtype)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Saver(b, output_dir=tmp_path).load()
    said = [str(w.message) for w in seen if "became inf" in str(w.message)]
    assert bool(said) == overflows
    if overflows:
        assert any("dense key 'lin.weight'" in m for m in said) and any("slot 'embedding' of table 't'" in m for m in said)
    assert torch.equal(b.lin.weight, a.lin.weight.to(dst_dtype))   # the cast itself is torch's


def test_cast_refused_when_off(tmp_path):
    saved(tmp_path, dtype=torch.float32)
    m, _, s, _, _ = fresh(tmp_path, dtype=torch.bfloat16)
    with pytest.raises(IncompatibleCheckpointError, match=r"'user'.*F32.*BF16.*cast"):
        s.load(load_conf={"load": ["sparse"], "cast": False})


def test_dimension_mismatch_names_table_and_shapes(tmp_path):
    saved(tmp_path)

    class Wide(M):
        def __init__(self):
            super().__init__(dim=6)

    m = Wide()
    before = table_contents(m.item)
    with pytest.raises(IncompatibleCheckpointError) as ei:
        Saver(m, output_dir=tmp_path).load(load_conf={"load": ["sparse"]})
    for t in ("user", "item"):
        assert f"table {t!r} slot 'embedding': checkpoint shape (4,) vs model shape (6,)" in str(ei.value)
        assert "load_conf 'tables', 'slots', 'dense_keys' or 'exclude'" in str(ei.value)   # what to do
    assert table_contents(m.item) == before, "a failed load leaves the model unchanged"


def test_strict_lists_everything_missing_nonstrict_warns_once(tmp_path):
    saved(tmp_path)

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = HashTable("user", dim=4)
            self.extra_table = HashTable("extra_table", dim=4)
            self.other = torch.nn.Linear(8, 1)

    m = Other()
    s = Saver(m, output_dir=tmp_path)
    s.register_for_checkpointing("not_saved", {})
    with pytest.raises(IncompatibleCheckpointError) as ei:
        s.load()
    msg = str(ei.value)
    for needle in ("'extra_table'", "'item'", "'other.weight'", "'lin.weight'", "'not_saved'", "'meta'"):
        assert needle in msg
    assert len(m.user) == 0, "strict failure loads nothing"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = s.load(load_conf={"strict": False})
    assert len([x for x in w if "does not match" in str(x.message)]) == 1
    assert len(m.user) > 0 and res.tables == ["user"]
    assert any("extra_table" in x for x in res.missing) and any("'item'" in x for x in res.unexpected)


def test_model_bank_direct_path_merge(tmp_path):
    a_dir, b_dir = tmp_path / "run_a", tmp_path / "run_b"
    src_a, _ = saved(a_dir, seed=1)
    src_b, _ = saved(b_dir, seed=2)
    m, _, s, _, _ = fresh(tmp_path / "new_run")
    s.load(ckpt_path=str(a_dir / "c"), direct_path=True, load_conf={"load": ["sparse"], "tables": ["user"]})
    s.load(ckpt_path=str(b_dir / "c"), direct_path=True, load_conf={"load": ["sparse", "dense"], "tables": ["item"]})
    assert_tables_equal(src_a.user, m.user, slots=["embedding"])
    assert_tables_equal(src_b.item, m.item, slots=["embedding"])
    assert torch.equal(m.lin.weight, src_b.lin.weight)
    # merge: a second source adds rows instead of replacing the table
    extra = HashTable("user", dim=4)
    with torch.no_grad():
        extra(torch.tensor([10 ** 12]))
    Saver(torch.nn.ModuleDict({"u": extra}), output_dir=tmp_path / "run_c", options=OPTS).save("c")
    with pytest.warns(UserWarning, match="model sparse table 'item' is not in the checkpoint"):
        s.load(ckpt_path=str(tmp_path / "run_c" / "c"), direct_path=True,
               load_conf={"load": ["sparse"], "merge": True, "strict": False})
    assert len(m.user) == len(src_a.user) + 1


def test_load_by_config(tmp_path):
    src, _ = saved(tmp_path)
    m, _, s, _, _ = fresh(tmp_path / "elsewhere")
    res = s.load_by_config({"path": str(tmp_path / "c"), "direct_path": True, "load": ["dense"]})
    assert res.dense_keys and torch.equal(m.lin.weight, src.lin.weight)
    with pytest.raises(LoadConfigError, match="unknown keys.*'lod'"):
        s.load_by_config({"path": str(tmp_path), "lod": ["dense"]})


@pytest.mark.parametrize("bad,match", [({"load": ["sprase"]}, "unknown categories"),
                                       ({"exclude": CATS}, "selects nothing"),   # (it loaded nothing, "ok")
                                       ({"load": ["*"], "exclude": CATS}, "selects nothing"),
                                       ({"strict": "yes"}, "strict must be a bool"),
                                       ({"rename": {"a": 1}}, "rename"),
                                       ({"tables": 3}, "tables")])
def test_invalid_load_config(bad, match):
    with pytest.raises(LoadConfigError, match=match):
        LoadConfig.coerce(bad)


def test_loading_only_optimizer_state_keeps_trained_embeddings(tmp_path):
    src, src_opt = saved(tmp_path)
    m, opt = trained(seed=5)             # same ids, different embeddings and optimizer state
    before = table_contents(m.user)["embedding"]
    Saver(m, sparse_optim=opt, output_dir=tmp_path).load(load_conf={"load": ["sparse_opt"]})
    after = table_contents(m.user)
    assert all(torch.equal(after["embedding"][i], row) for i, row in before.items())
    exp = table_contents(src.user)
    assert all(torch.equal(after["adam.m"][i], exp["adam.m"][i]) for i in exp["adam.m"])
    assert opt.state_dict() == src_opt.state_dict()


def test_two_checkpoint_names_renamed_onto_one_model_name_are_refused(tmp_path):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = HashTable("user", dim=4)
            self.user_v1 = HashTable("user_v1", dim=4)
            self.a = torch.nn.Linear(2, 2)
            self.b = torch.nn.Linear(2, 2)

    src = Two()
    with torch.no_grad():
        src.user(torch.arange(10))
        src.user_v1(torch.arange(100, 105))
    Saver(src, output_dir=tmp_path, options=OPTS).save("c")
    m = M()
    before = table_contents(m.user)
    with pytest.raises(IncompatibleCheckpointError, match=r"'user' and 'user_v1' both map to model sparse table 'user'"):
        Saver(m, output_dir=tmp_path).load(load_conf={"rename": {"user_v1": "user"}, "load": ["sparse"],
                                                      "strict": False})
    assert table_contents(m.user) == before, "nothing was loaded"
    with pytest.raises(IncompatibleCheckpointError, match=r"'a.weight' and 'b.weight' both map to model dense key"):
        Saver(torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)}), output_dir=tmp_path).load(
            load_conf={"rename": {"b.": "a."}, "load": ["dense"], "strict": False})


def test_a_registered_object_that_refuses_its_state_leaves_the_model_untouched(tmp_path):
    saved(tmp_path)
    m, opt, s, extra, io = fresh(tmp_path)
    class Refuses:   # (an optimizer's state now maps by parameter name: test_optim_by_name.py)
        def state_dict(self):
            return {"groups": 1}

        def load_state_dict(self, state):
            raise ValueError("loaded state has a different number of parameter groups")

    s.register_for_checkpointing("opt", Refuses())
    s_src = Saver(trained()[0], output_dir=tmp_path / "with_opt", options=OPTS)
    s_src.register_for_checkpointing("opt", Refuses())
    s_src.register_for_checkpointing("meta", {"step": 3})
    s_src.save("c")
    before_w, before_rows = m.lin.weight.detach().clone(), len(m.user)
    with pytest.raises(IncompatibleCheckpointError, match=r"registered object 'opt' failed.*were not touched"):
        s.load(ckpt_path=str(tmp_path / "with_opt"), load_conf={"exclude": ["io_state"], "strict": False})
    assert torch.equal(m.lin.weight, before_w) and len(m.user) == before_rows


def test_model_bank_of_some_tables_takes_their_optimizer_state(tmp_path):
    src, src_opt = saved(tmp_path)                  # SparseAdam over 'user' and 'item'

    class UserOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.customer = HashTable("customer", dim=4)

    m = UserOnly()
    opt = SparseAdam(m, lr=0.1)
    Saver(m, sparse_optim=opt, output_dir=tmp_path / "new").load(
        ckpt_path=str(tmp_path / "c"), direct_path=True,
        load_conf={"load": ["sparse", "sparse_opt"], "tables": ["user"], "rename": {"user": "customer"}})
    assert len(m.customer) == len(src.user)
    assert opt.state_dict()["tables"]["customer"] == src_opt.state_dict()["tables"]["user"]


def test_overflow_option_is_validated():
    """LoadConfig.overflow (bounded tables routed more ids than they hold, e.g. TorchRec MCH): 'error' by
    default, 'evict' on request, anything else refused naming the option."""
    assert LoadConfig().overflow == "error"
    assert LoadConfig.coerce({"overflow": "evict"}).overflow == "evict"
    with pytest.raises(LoadConfigError, match="overflow"):
        LoadConfig(overflow="drop")


def test_strict_refuses_io_state_nobody_registered(tmp_path):
    """A checkpoint holding a reader's position, loaded by a Saver that registered no such reader, loaded
    under strict with nothing reported: the reader would silently start over. Refused now, and listed as
    unexpected under strict=False; the manager's own RNG entry is not counted."""
    saved(tmp_path)
    for register_other in (False, True):
        m = M(seed=99)
        opt = SparseAdam(m, lr=0.1)
        s = Saver(m, sparse_optim=opt, output_dir=tmp_path)
        s.register_for_checkpointing("meta", {})
        if register_other:
            s.register_io_state("other", IO())
        with pytest.raises(IncompatibleCheckpointError, match=r"IO state 'reader' of worker 0 is not registered"):
            s.load()
        with pytest.warns(UserWarning, match="IO state 'reader'"):
            res = s.load(load_conf={"strict": False})
        assert any("'reader'" in u for u in res.unexpected), res.unexpected
        assert res.sparse_rows > 0


def test_strict_refuses_a_sparse_optimizers_state_on_one_side_only(tmp_path):
    """Adam's moment slots loaded without their step counts restart the bias correction on restored
    moments: a Saver given no sparse optimizer, loading a checkpoint that holds one's state, and the
    reverse, both loaded under strict reporting nothing."""
    saved(tmp_path)
    m = M(seed=99)
    SparseAdam(m, lr=0.1)   # the slots exist, but the Saver is not given the optimizer
    s = Saver(m, output_dir=tmp_path)
    s.register_for_checkpointing("meta", {})
    s.register_io_state("reader", IO())
    with pytest.raises(IncompatibleCheckpointError, match="holds a sparse optimizer's own state"):
        s.load()
    assert s.load(load_conf={"exclude": ["sparse_opt"]}).sparse_rows > 0   # what the message offers
    # the reverse: saved without the optimizer, loaded with one
    src, src_opt = trained()
    Saver(src, output_dir=tmp_path / "no_opt", options=OPTS).save("c")
    m2, opt2 = M(seed=98), None
    opt2 = SparseAdam(m2, lr=0.1)
    s2 = Saver(m2, sparse_optim=opt2, output_dir=tmp_path / "no_opt")
    with pytest.raises(IncompatibleCheckpointError, match="sparse optimizer's own state .* is not in the checkpoint"):
        s2.load()
    with pytest.warns(UserWarning, match="sparse optimizer's own state"):
        s2.load(load_conf={"strict": False})


@pytest.mark.parametrize("lr_decay", [0.0, 0.1])
def test_adagrad_needs_its_steps_only_with_a_decaying_rate(tmp_path, lr_decay):
    """A warm start of SparseAdagrad's accumulators from a checkpoint without its step counts (a TorchRec
    table's fused Adagrad state, or a save without the optimizer) is exact unless lr_decay reads the step."""
    from recckpt import SparseAdagrad
    src = M()
    SparseAdagrad(src, lr=0.1)
    src(torch.arange(10), torch.arange(10) % 5)
    Saver(src, output_dir=tmp_path, options=OPTS).save("c")
    m = M(seed=3)
    s = Saver(m, sparse_optim=SparseAdagrad(m, lr=0.1, lr_decay=lr_decay), output_dir=tmp_path)
    if lr_decay:
        with pytest.raises(IncompatibleCheckpointError, match="its step counts"):
            s.load()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert s.load().sparse_rows == len(src.user) + len(src.item)


def test_an_eval_load_of_embeddings_alone_needs_no_sparse_optimizer(tmp_path):
    """A Saver without a sparse optimizer loading only the embeddings (slots ['embedding']) of a checkpoint
    that holds SparseAdam's state: no optimizer slot is written, so the optimizer's step counts are beside
    the point (a review found this refused after the strict check on one-sided optimizer state)."""
    src, _ = saved(tmp_path)
    m = M(seed=5)
    s = Saver(m, output_dir=tmp_path)
    s.register_for_checkpointing("meta", {})
    s.register_io_state("reader", IO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = s.load(load_conf={"slots": ["embedding"]})
    assert res.sparse_rows == len(src.user) + len(src.item)


def test_a_warm_start_of_some_tables_keeps_the_sparse_optimizers_hyper_parameters(tmp_path):
    """Hyper-parameters are one set for all of a sparse optimizer's tables: a load of some tables' optimizer
    state keeps the new run's (with a warning), a load of all of them (a resume) takes the checkpoint's."""
    saved(tmp_path)                                   # SparseAdam(lr=0.1)
    m = M(seed=99)
    opt = SparseAdam(m, lr=0.5, betas=(0.8, 0.9))
    s = Saver(m, sparse_optim=opt, output_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"keeps its own hyper-parameters .*'lr': 0.5.*tables \['item'\] only, not "
                                         r"of \['user'\]"):
        s.load(ckpt_id="c", load_conf={"tables": ["item"], "load": ["sparse", "sparse_opt"], "strict": False})
    assert opt.state_dict()["hyperparams"]["lr"] == 0.5 and list(opt.state_dict()["hyperparams"]["betas"]) == [0.8, 0.9]
    assert opt.state_dict()["tables"]["item"]["step"] == 3 and opt.state_dict()["tables"]["user"]["step"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.load(ckpt_id="c", load_conf={"load": ["sparse", "sparse_opt"]})
    assert opt.state_dict()["hyperparams"]["lr"] == 0.1   # every table's state: a resume takes the saved settings
