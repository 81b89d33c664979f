"""Dense optimizer state travels by parameter name (issue 29 item 2): a warm start into a model that
gained, lost, swapped or renamed a tower gives every shared parameter its own moments, new parameters
none, and never one parameter's state to another. Older checkpoints (no names) apply positionally only
where the dense keys and shapes match exactly."""
from __future__ import annotations

import warnings

import pytest
import torch

from recckpt import CheckpointManager, Saver
from recckpt.errors import IncompatibleCheckpointError, InvalidArgumentError
from recckpt.state import optim_names
from recckpt.state.optim_names import apply_named_optimizer_state, named_optimizer_state

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}
MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",)}


class Towers(torch.nn.Module):
    """One Linear(4, 4) tower per name, plus an embedding bag shared by every tower (`trunk`)."""

    def __init__(self, towers, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Linear(3, 4)
        for t in towers:
            setattr(self, t, torch.nn.Linear(4, 4))
        self.towers = list(towers)

    def forward(self, x):
        h = self.trunk(x)
        return sum(getattr(self, t)(h).sum() for t in self.towers)


def trained(kind, towers, steps=3, seed=0):
    m = Towers(towers, seed)
    opt = (OPTIMIZERS.get(kind) or OTHERS[kind])(m.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(5, 3, generator=g)).backward()
        opt.step()
    return m, opt


def state_of(model, opt, name):
    """The optimizer state of model parameter `name` ({} when it has none)."""
    p = dict(model.named_parameters())[name]
    return opt.state.get(p, {})


def save_a(tmp_path, kind, towers=("a", "b")):
    m, opt = trained(kind, towers)
    s = Saver(m, output_dir=tmp_path / "a")
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    return m, opt


def load_b(tmp_path, kind, towers, **conf):
    m = Towers(towers, seed=7)
    opt = OPTIMIZERS[kind](m.parameters())
    s = Saver(m, output_dir=tmp_path / "b")
    s.register_for_checkpointing("opt", opt)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c",
                     load_conf={"load": ["sparse", "dense", "extra"], **conf})
    return m, opt, res, [str(x.message) for x in w]


def fresh(model, opt, name):
    """No state, or the one a fresh optimizer starts with (Adagrad fills its state at construction)."""
    st = state_of(model, opt, name)
    return not st or (float(st["step"]) == 0.0 and all(not bool(v.any()) for k, v in st.items() if k != "step"))


def assert_same_state(kind, src_m, src_opt, src_name, dst_m, dst_opt, dst_name, values=True):
    a, b = state_of(src_m, src_opt, src_name), state_of(dst_m, dst_opt, dst_name)
    assert b, f"{dst_name} got no state"
    for k in MOMENTS[kind]:
        assert torch.equal(a[k], b[k]), f"{dst_name}.{k} differs from the source's {src_name}.{k}"
    assert float(a["step"]) == float(b["step"])
    if values:   # the dense load gave the parameter its value too
        assert torch.equal(dict(src_m.named_parameters())[src_name], dict(dst_m.named_parameters())[dst_name])


SHARED = ("trunk.weight", "trunk.bias", "a.weight", "a.bias")


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_model_gaining_a_tower(tmp_path, kind):
    am, aopt = save_a(tmp_path, kind)
    m, opt, res, warned = load_b(tmp_path, kind, ("a", "b", "c"), strict=False)
    for n in SHARED + ("b.weight", "b.bias"):
        assert_same_state(kind, am, aopt, n, m, opt, n)
    assert fresh(m, opt, "c.weight") and fresh(m, opt, "c.bias")
    assert any("'c.weight'" in x and "starts fresh" in x for x in res.missing), res.missing
    assert any("c.weight" in x for x in warned)
    # the new tower trains from there with a fresh state, the others continue
    opt.zero_grad()
    m(torch.randn(2, 3)).backward()
    opt.step()
    assert float(state_of(m, opt, "c.weight")["step"]) == 1.0
    assert float(state_of(m, opt, "a.weight")["step"]) == 4.0


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_model_losing_a_tower(tmp_path, kind):
    am, aopt = save_a(tmp_path, kind)
    m, opt, res, warned = load_b(tmp_path, kind, ("a",), strict=False)
    for n in SHARED:
        assert_same_state(kind, am, aopt, n, m, opt, n)
    assert any("'b.weight'" in x and "not a parameter" in x for x in res.unexpected), res.unexpected
    assert any("b.weight" in x for x in warned)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_swapped_same_shaped_tower_gets_no_other_towers_state(tmp_path, kind):
    """Issue 29 item 2: by position, tower c would get tower b's moments (same shapes, same index)."""
    am, aopt = save_a(tmp_path, kind)
    m, opt, res, _ = load_b(tmp_path, kind, ("a", "c"), strict=False)
    for n in SHARED:
        assert_same_state(kind, am, aopt, n, m, opt, n)
    assert fresh(m, opt, "c.weight") and fresh(m, opt, "c.bias")
    assert any("'c.bias'" in x for x in res.missing) and any("'b.bias'" in x for x in res.unexpected)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_renamed_tower_takes_its_state(tmp_path, kind):
    am, aopt = save_a(tmp_path, kind)
    m, opt, res, warned = load_b(tmp_path, kind, ("a", "c"), rename={"b.": "c."})   # strict
    for n in SHARED:
        assert_same_state(kind, am, aopt, n, m, opt, n)
    assert_same_state(kind, am, aopt, "b.weight", m, opt, "c.weight")
    assert_same_state(kind, am, aopt, "b.bias", m, opt, "c.bias")
    assert not res.missing and not res.unexpected and not warned


@pytest.mark.parametrize("towers", [("a", "b", "c"), ("a",), ("a", "c")])
def test_strict_refuses_naming_the_parameters_and_changes_nothing(tmp_path, towers):
    save_a(tmp_path, "adamw")
    m = Towers(towers, seed=7)
    opt = OPTIMIZERS["adamw"](m.parameters())
    before = {k: v.clone() for k, v in m.state_dict().items()}
    s = Saver(m, output_dir=tmp_path / "b")
    s.register_for_checkpointing("opt", opt)
    with pytest.raises(IncompatibleCheckpointError) as e:
        s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c", load_conf={"load": ["dense", "extra"],
                                                                      "exclude": []})
    text = str(e.value)
    if "c" in towers:
        assert "'c.weight'" in text
    if "b" not in towers:
        assert "'b.weight'" in text
    assert "Nothing was loaded" in text
    assert all(fresh(m, opt, n) for n, _ in m.named_parameters())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_group_hyper_parameters_come_from_the_saved_groups(tmp_path):
    am, aopt = trained("adamw", ("a", "b"))
    aopt.param_groups[0]["lr"] = 0.123
    s = Saver(am, output_dir=tmp_path / "a")
    s.register_for_checkpointing("opt", aopt)
    s.save("c")
    m, opt, _, _ = load_b(tmp_path, "adamw", ("a", "c"), strict=False)
    assert opt.param_groups[0]["lr"] == 0.123


def test_a_shape_change_is_refused_even_when_not_strict(tmp_path):
    save_a(tmp_path, "adam")
    m = Towers(("a",), seed=7)
    m.a = torch.nn.Linear(4, 2)      # same name, another shape
    opt = OPTIMIZERS["adam"](m.parameters())
    s = Saver(m, output_dir=tmp_path / "b")
    s.register_for_checkpointing("opt", opt)
    with pytest.raises(IncompatibleCheckpointError, match=r"a\.weight.*\(4, 4\).*\(2, 4\)"):
        s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c",
               load_conf={"load": ["extra"], "strict": False})
    assert not opt.state


def test_a_changed_parameter_outside_the_model_is_refused_by_its_moments_shape(tmp_path):
    """A parameter the optimizer steps but the model does not hold (a free temperature) has no dense key
    to show its saved shape; its moments show it. Before, Adam's (3,) moments loaded onto a (5,)
    parameter, and the first step() raised a bare torch size error."""
    src = torch.nn.Linear(3, 3)
    temp = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([*src.parameters(), temp], lr=0.01)
    (src(torch.ones(1, 3)).sum() + temp.sum()).backward()
    opt.step()
    s = Saver(src, output_dir=tmp_path / "a")
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    dst, temp2 = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.ones(5))
    opt2 = torch.optim.Adam([*dst.parameters(), temp2], lr=0.01)
    s2 = Saver(dst, output_dir=tmp_path / "b")
    s2.register_for_checkpointing("opt", opt2)
    with pytest.raises(IncompatibleCheckpointError, match=r"'<unnamed>#0': checkpoint shape \(3,\) vs model shape \(5,\)"):
        s2.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c", load_conf={"strict": False})
    assert not opt2.state
    # the same parameter unchanged still loads, its moments included
    dst3, temp3 = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.ones(3))
    opt3 = torch.optim.Adam([*dst3.parameters(), temp3], lr=0.01)
    s3 = Saver(dst3, output_dir=tmp_path / "c")
    s3.register_for_checkpointing("opt", opt3)
    s3.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c")
    assert torch.equal(opt3.state[temp3]["exp_avg"], opt.state[temp]["exp_avg"])


OTHERS = {"adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01), "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
          "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01)}


@pytest.mark.parametrize("saved_kind,live", [("adam", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                                             ("adagrad", lambda ps: torch.optim.RMSprop(ps, lr=0.01)),
                                             ("adam", OTHERS["adamax"]), ("adamax", OPTIMIZERS["adam"]),
                                             ("radam", OTHERS["nadam"])],
                         ids=["adam-into-sgd", "adagrad-into-rmsprop", "adam-into-adamax", "adamax-into-adam",
                              "radam-into-nadam"])
def test_another_optimizers_state_is_refused_before_anything_is_loaded(tmp_path, saved_kind, live):
    """A warm start whose new run uses another optimizer: Adam's groups and moments given to an SGD made
    its first step() raise KeyError('momentum'), with SGD's hyper-parameters replaced by Adam's."""
    save_a(tmp_path, saved_kind)
    m = Towers(("a", "b"), seed=7)
    opt = live(m.parameters())
    before = {k: v.clone() for k, v in m.state_dict().items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    s = Saver(m, output_dir=tmp_path / "b")
    s.register_for_checkpointing("opt", opt)
    with pytest.raises(IncompatibleCheckpointError, match=r"another optimizer's.*'exclude': \['extra'\]"):
        s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c", load_conf={"strict": False})
    assert not opt.state and all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    # leaving registered objects out loads the model, and the optimizer steps from fresh state
    s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c", load_conf={"exclude": ["extra"]})
    m(torch.ones(2, 3)).backward()
    opt.step()


def test_the_same_optimizer_with_a_schedulers_keys_or_newer_options_is_not_another(tmp_path):
    """A review found the first rule (hyper-parameter names missing on each side) refusing Adam into Adam:
    OneCycleLR adds max_lr, initial_lr, ... to the saved groups, and a newer torch adds options
    (decoupled_weight_decay) to the live ones. Only the names that tell optimizers apart count."""
    m, opt = trained("adam", ("a", "b"))
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for g in opt.param_groups:
        g.pop("decoupled_weight_decay", None)   # as an older torch saved it
        g["tower"] = "shared"                    # a user's own key
    s = Saver(m, output_dir=tmp_path / "a")
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    m2, opt2, _, _ = load_b(tmp_path, "adam", ("a", "b"))
    assert_same_state("adam", m, opt, "a.weight", m2, opt2, "a.weight")
    m2(torch.ones(2, 3)).backward()
    opt2.step()


def test_a_layer_copied_under_another_name_keeps_its_own_optimizer_state(tmp_path):
    """rename {'a.': 'c.'} into a model holding both a and c copies a's saved state to c; model parameter
    a is not a target (docs/LOADING.md): it keeps its live state and is not reported. Before, a strict
    load refused it as "starts fresh", which was not even what a lenient one did."""
    am, aopt = save_a(tmp_path, "adam")
    m, opt = trained("adam", ("a", "b", "c"), seed=5)
    live_a = {k: v.clone() for k, v in state_of(m, opt, "a.weight").items()}
    s = Saver(m, output_dir=tmp_path / "b")
    s.register_for_checkpointing("opt", opt)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = s.load(ckpt_path=str(tmp_path / "a"), ckpt_id="c",
                     load_conf={"load": ["dense", "extra"], "rename": {"a.": "c."}, "strict": True})
    assert not [x for x in w if "a.weight" in str(x.message)], [str(x.message) for x in w]
    assert not [x for x in res.missing if "a.weight" in x], res.missing
    assert_same_state("adam", am, aopt, "a.weight", m, opt, "c.weight")
    got = state_of(m, opt, "a.weight")
    assert all(torch.equal(got[k], v) for k, v in live_a.items())


def test_model_bank_source_maps_by_name(tmp_path):
    am, aopt = save_a(tmp_path, "adamw")
    m = Towers(("a", "c"), seed=7)
    opt = OPTIMIZERS["adamw"](m.parameters())
    s = Saver(m, output_dir=tmp_path / "b")
    mgr = CheckpointManager(s, save_rng=False)
    mgr.register_for_checkpointing("opt", opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.load_model_bank([{"path": str(tmp_path / "a"), "load": ["dense", "extra"], "strict": False}])
    for n in SHARED:
        assert_same_state("adamw", am, aopt, n, m, opt, n)
    assert fresh(m, opt, "c.weight")


def test_restore_of_the_same_model_gives_everything_back(tmp_path):
    am, aopt = trained("adam", ("a", "b"))
    s = Saver(am, output_dir=tmp_path / "a")
    s.register_for_checkpointing("opt", aopt)
    s.save("c")
    m = Towers(("a", "b"), seed=7)
    opt = OPTIMIZERS["adam"](m.parameters())
    s2 = Saver(m, output_dir=tmp_path / "a")
    s2.register_for_checkpointing("opt", opt)
    res = s2.load()
    assert not res.missing and not res.unexpected and res.extras == ["opt"]
    for n, _ in am.named_parameters():
        assert_same_state("adam", am, aopt, n, m, opt, n)


# ------------------------------------------------------------------------- older checkpoints (no names)
@pytest.fixture
def without_names(monkeypatch):
    """Saves as a writer from before parameter names were recorded."""
    import recckpt.train.saver as saver_mod
    monkeypatch.setattr(saver_mod, "saved_param_names", lambda *a: None)


def test_old_checkpoint_applies_positionally_when_the_model_is_the_same(tmp_path, without_names):
    am, aopt = save_a(tmp_path, "adam")
    m, opt, res, warned = load_b(tmp_path, "adam", ("a", "b"))
    assert res.extras == ["opt"] and not warned
    for n, _ in am.named_parameters():
        assert_same_state("adam", am, aopt, n, m, opt, n)


def test_old_checkpoint_into_a_changed_model_is_refused_or_skipped(tmp_path, without_names):
    save_a(tmp_path, "adamw")
    with pytest.raises(IncompatibleCheckpointError, match="registered optimizer 'opt'.*no parameter names"):
        load_b(tmp_path, "adamw", ("a", "c"))
    m, opt, res, warned = load_b(tmp_path, "adamw", ("a", "c"), strict=False)
    assert all(fresh(m, opt, n) for n, _ in m.named_parameters()), "a positional state must not be applied"
    assert "opt" not in res.extras
    assert any("registered optimizer 'opt'" in x and "not applied" in x for x in warned)


# ------------------------------------------------------------------------- the public helpers
def test_named_state_round_trip_and_keyed_optimizer(tmp_path):
    am, aopt = trained("adagrad", ("a", "b"))
    named = named_optimizer_state(aopt, am)
    assert set(named["state"]) == {n for n, _ in am.named_parameters()}
    assert [p for g in named["param_groups"] for p in g["params"]] == [n for n, _ in am.named_parameters()]
    m = Towers(("c", "a"), seed=3)          # another order, another tower
    opt = OPTIMIZERS["adagrad"](m.parameters())
    with pytest.raises(IncompatibleCheckpointError, match="'c.weight'"):
        apply_named_optimizer_state(opt, m, named)
    match = apply_named_optimizer_state(opt, m, named, strict=False)
    assert set(match.gone) == {"b.weight", "b.bias"} and set(match.new) == {"c.weight", "c.bias"}
    for n in SHARED:
        assert_same_state("adagrad", am, aopt, n, m, opt, n, values=False)
    match = apply_named_optimizer_state(opt, m, named, rename={"b.weight": "c.weight", "b.bias": "c.bias"})
    assert_same_state("adagrad", am, aopt, "b.weight", m, opt, "c.weight", values=False)
    # a prefix, as LoadConfig.rename takes it (it matched nothing, and strict=False loaded nothing, silently)
    m2 = Towers(("c", "a"), seed=4)
    opt2 = OPTIMIZERS["adagrad"](m2.parameters())
    match = apply_named_optimizer_state(opt2, m2, named, rename={"b.": "c."})
    assert set(match.matched) == {n for n, _ in m2.named_parameters()} and not match.gone and not match.new
    assert_same_state("adagrad", am, aopt, "b.bias", m2, opt2, "c.bias", values=False)
    with pytest.raises(InvalidArgumentError, match="not parameters of the model"):
        named_optimizer_state(aopt, Towers(("a",)))


KEYED_SCRIPT = """
import sys, warnings
import torch
from torchrec.optim.keyed import KeyedOptimizerWrapper
from test_optim_by_name import SHARED, Towers, trained
from recckpt import Saver
out = sys.argv[1]
am, _ = trained("adam", ("a", "b"))
src = KeyedOptimizerWrapper(dict(am.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01))
src.init_state()
g = torch.Generator().manual_seed(5)
for _ in range(2):
    src.zero_grad()
    am(torch.randn(4, 3, generator=g)).backward()
    src.step()
s = Saver(am, output_dir=out + "/a")
s.register_for_checkpointing("opt", src)
s.save("c")
m = Towers(("a", "c"), seed=9)
dst = KeyedOptimizerWrapper(dict(m.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01))
dst.init_state()
fresh = {k: v["exp_avg"].clone() for k, v in dst.state_dict()["state"].items()}
s2 = Saver(m, output_dir=out + "/b")
s2.register_for_checkpointing("opt", dst)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    s2.load(ckpt_path=out + "/a", ckpt_id="c", load_conf={"load": ["extra"], "strict": False})
got, want = dst.state_dict()["state"], src.state_dict()["state"]
for n in SHARED:
    assert torch.equal(got[n]["exp_avg"], want[n]["exp_avg"]), n
assert torch.equal(got["c.weight"]["exp_avg"], fresh["c.weight"])   # fresh, not b's
assert not torch.equal(got["c.weight"]["exp_avg"], want["b.weight"]["exp_avg"])
print("ok")
"""


def test_torchrec_keyed_optimizer_state_maps_by_name(tmp_path):
    """A registered KeyedOptimizer (state keyed by parameter name already) maps by name the same way.
    In a worker process: the test process never imports TorchRec (tests/conftest.py)."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("torchrec") is None:
        pytest.skip("TorchRec is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.join(root, "tests"), root])}
    p = subprocess.run([sys.executable, "-c", KEYED_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_saved_names_are_a_plain_list_in_the_extras_tree(tmp_path):
    """docs/FORMAT.md: 'param_names' next to the numbered state, one entry per parameter index."""
    import recckpt
    am, aopt = save_a(tmp_path, "adam")
    view = recckpt.open(str(tmp_path / "a" / "c"))
    entry = view.objects()["objects"]["opt"]
    assert entry["param_names"] == [n for n, _ in am.named_parameters()]
    assert optim_names.is_positional(entry["state"])


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_a_wrapper_prefix_is_left_out_by_renaming_it_to_nothing(tmp_path, prefix):
    """A checkpoint of a DDP-wrapped (`module.`) or torch.compile'd (`_orig_mod.`) model into the bare model:
    `rename {prefix: ""}` was refused ("must map non-empty names to names"), so every layer had to be renamed
    on its own. Now the prefix is left out, the optimizer's state follows its parameters, and the other way
    round a prefix is added; a whole name still may not map to nothing."""
    import recckpt
    from recckpt.errors import LoadConfigError

    def bare():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    wrapper = torch.nn.Module()
    setattr(wrapper, prefix[:-1], bare())
    opt = torch.optim.Adam(wrapper.parameters(), lr=0.01)
    getattr(wrapper, prefix[:-1])(torch.ones(5, 3)).sum().backward()
    opt.step()
    s = Saver(wrapper, output_dir=str(tmp_path))
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    model = bare()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt2 = torch.optim.Adam(model.parameters(), lr=0.5)
    s2 = Saver(model, output_dir=str(tmp_path))
    s2.register_for_checkpointing("opt", opt2)
    s2.load(load_conf={"rename": {prefix: ""}})
    want = getattr(wrapper, prefix[:-1])
    for (name, a), b in zip(want.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"]), name
    assert opt2.param_groups[0]["lr"] == 0.01
    # the other way: a bare model's checkpoint into a wrapped one
    s2.save("bare")
    back = torch.nn.Module()
    setattr(back, prefix[:-1], bare())
    Saver(back, output_dir=str(tmp_path)).load(ckpt_id="bare", load_conf={
        "rename": {"0.": f"{prefix}0.", "2.": f"{prefix}2."}, "exclude": ["extra"]})
    assert torch.equal(getattr(back, prefix[:-1])[0].weight, model[0].weight)
    with pytest.raises(LoadConfigError, match="or a prefix"):
        recckpt.LoadConfig(rename={"0.weight": ""})


def test_a_tied_parameter_takes_its_state_under_any_of_its_names(tmp_path):
    """An embedding tied to an output layer is one parameter with two names; a save names its optimizer
    state by the first (`named_parameters()` order). A model that lists the tied modules the other way
    round refused a strict load ("'head.weight' has no state") and a lenient one lost the state and the
    saved learning rate (a helper's attack with PyTorch idioms). Now any of its names matches."""
    class Tied(torch.nn.Module):
        def __init__(self, head_first):
            super().__init__()
            torch.manual_seed(0)
            if head_first:
                self.head = torch.nn.Linear(4, 10, bias=False)
                self.emb = torch.nn.Embedding(10, 4)
            else:
                self.emb = torch.nn.Embedding(10, 4)
                self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    m = Tied(head_first=False)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m.head(m.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    s = Saver(m, output_dir=str(tmp_path))
    s.register_for_checkpointing("opt", opt)
    s.save("c")
    m2 = Tied(head_first=True)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.5)
    s2 = Saver(m2, output_dir=str(tmp_path))
    s2.register_for_checkpointing("opt", opt2)
    s2.load()   # strict
    assert m2.head.weight is m2.emb.weight and torch.equal(m2.emb.weight, m.emb.weight)
    assert torch.equal(opt2.state[m2.emb.weight]["exp_avg"], opt.state[m.emb.weight]["exp_avg"])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_an_untied_checkpoint_loads_leniently_into_a_tied_model(tmp_path):
    """The other way round from a tied checkpoint: a checkpoint of two untied layers into a model that ties
    them. Both saved names map to the one live parameter, which today's alias rule (a tied parameter
    answers to each of its names) must not turn into a conflict ("both map to model parameter"): the name
    the live parameter goes by takes the state, the other is reported unexpected (a review of the change)."""
    from recckpt import LoadConfig

    class M(torch.nn.Module):
        def __init__(self, tie):
            super().__init__()
            torch.manual_seed(0)
            self.enc = torch.nn.Linear(4, 4, bias=False)
            self.dec = torch.nn.Linear(4, 4, bias=False)
            if tie:
                self.dec.weight = self.enc.weight

    m = M(False)
    opt = torch.optim.Adam(m.parameters())
    m.dec(m.enc(torch.randn(2, 4))).sum().backward()
    opt.step()
    s = Saver(m, output_dir=str(tmp_path))
    s.register_for_checkpointing("opt", opt)
    s.save("c1")
    t = M(True)
    o = torch.optim.Adam(t.parameters())
    s2 = Saver(t, output_dir=str(tmp_path))
    s2.register_for_checkpointing("opt", o)
    with pytest.raises(IncompatibleCheckpointError, match="'dec.weight' is not a parameter of the model's optimizer"):
        s2.load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s2.load(load_conf=LoadConfig(strict=False))
    assert torch.equal(o.state[t.enc.weight]["exp_avg"], opt.state[m.enc.weight]["exp_avg"])


def test_a_pickled_optimizer_state_loads_and_verifies(tmp_path):
    """An optimizer registered with allow_pickle=True, whose state needs pickle: its entry records parameter
    names beside a pickled byte tensor, which the optimizer-state check read as a corrupt state_dict
    (load and verify refused it; a review of the change). The check now runs on the unpickled state."""
    import datetime

    import recckpt

    class HistSGD(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for g in self.param_groups:
                for p in g["params"]:
                    self.state[p]["last"] = datetime.datetime(2024, 1, 1)

    torch.serialization.add_safe_globals([datetime.datetime])
    m = torch.nn.Linear(3, 2)
    opt = HistSGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    s = Saver(m, output_dir=str(tmp_path))
    s.register_for_checkpointing("opt", opt, allow_pickle=True)
    s.save("c1")
    assert recckpt.verify(str(tmp_path / "c1")).ok
    m2 = torch.nn.Linear(3, 2)
    opt2 = HistSGD(m2.parameters(), lr=0.1, momentum=0.9)
    s2 = Saver(m2, output_dir=str(tmp_path))
    s2.register_for_checkpointing("opt", opt2, allow_pickle=True)
    s2.load()
    assert [sorted(v) for v in opt2.state.values()] == [["last", "momentum_buffer"]] * 2


def test_an_empty_param_group_takes_the_saved_empty_groups_hyper_parameters(tmp_path):
    """A group without parameters has no name to match by: it kept its live lr while the scheduler's saved
    lr was restored in the others, and nothing said so (a helper's attack with PyTorch idioms). It now takes
    the saved empty group at its position, as torch's own load_state_dict does."""
    def job():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.AdamW([{"params": list(model.parameters())},
                                 {"params": [], "weight_decay": 0.0}], lr=0.01)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    model, opt, sched = job()
    for _ in range(3):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        sched.step()
    saver = Saver(model, output_dir=str(tmp_path))
    saver.register_for_checkpointing("opt", opt)
    saver.save("c")
    model2, opt2, _ = job()
    back = Saver(model2, output_dir=str(tmp_path))
    back.register_for_checkpointing("opt", opt2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back.load()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups] == [0.00125, 0.00125]
    assert opt2.param_groups[1]["weight_decay"] == 0.0
