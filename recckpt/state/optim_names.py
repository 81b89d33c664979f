"""Dense optimizer state keyed by parameter name.

A `torch.optim` optimizer numbers its parameters (state_dict "state" and "param_groups[*].params" use
0, 1, 2, ... in group order), so its state applied to a model whose parameters changed goes to
whichever parameter now has that number: one tower's moments become another's, or the optimizer
refuses the whole state. This module names each parameter by its name in the model, and maps state
between two optimizers by those names (with the load's renames), never by position.

The name-keyed form is the one `torch.distributed.checkpoint`'s `get_optimizer_state_dict` and
TorchRec's `KeyedOptimizer.state_dict()` use: `{"state": {name: {...}}, "param_groups": [{..., "params":
[name, ...]}]}`. `named_optimizer_state` gives it for any optimizer, `apply_named_optimizer_state` loads
it into one; both accept a `KeyedOptimizer` (or anything whose state_dict is already keyed by name).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..errors import IncompatibleCheckpointError, InvalidArgumentError
from . import renames

#: Prefix of the key of an optimizer parameter that is not a parameter of the model (no name): such
#: parameters are matched by their order among the unnamed ones only.
UNNAMED = "<unnamed>#"

#: State entries that torch.optim's optimizers keep in their parameter's shape (Adam/AdamW/NAdam/RAdam/
#: SparseAdam's moments, SGD's and RMSprop's momentum, Adagrad's sum, RMSprop/Adadelta's averages,
#: Adamax's exp_inf, ASGD's ax, Rprop's prev and step sizes): a saved one of another shape is state of a
#: parameter that changed, checked even where the checkpoint holds no dense tensor of that parameter (one
#: outside the model). Other entries (scalars, factored statistics, other optimizers' own) are not.
PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                      "grad_avg", "acc_delta", "exp_inf", "ax", "prev", "step_size")

#: Hyper-parameters that tell torch.optim's optimizers apart (Adam's betas, SGD's momentum, Adagrad's
#: lr_decay, RMSprop's alpha, ...). Other names in a param group are options that torch versions add
#: (foreach, fused, decoupled_weight_decay, ...), LR schedulers' (initial_lr, max_lr, ...) or the user's
#: own: a saved group and a live one that differ only in those are the same optimizer.
OPTIMIZER_HYPER_PARAMETERS = frozenset({
    "betas", "amsgrad", "momentum", "dampening", "nesterov", "lr_decay", "initial_accumulator_value", "rho",
    "alpha", "centered", "lambd", "t0", "etas", "step_sizes", "momentum_decay", "max_iter", "history_size",
    "tolerance_grad", "tolerance_change", "line_search_fn", "beta2_decay", "d"})


def is_positional(state_dict) -> bool:
    """Whether an optimizer state_dict numbers its parameters (torch.optim) rather than naming them."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return False
    if not all(isinstance(g.get("params", []), list) for g in groups):
        return False
    params = [p for g in groups for p in (g.get("params") or [])]
    # groups naming no parameter say nothing either way (a KeyedOptimizer's saved groups, every entry of
    # which an integration's tables hold)
    return bool(params) and all(isinstance(p, int) and not isinstance(p, bool) for p in params)


def is_named(state_dict) -> bool:
    """Whether an optimizer state_dict keys its parameters by name (KeyedOptimizer, DCP): "state" keyed
    by strings and, if it has "param_groups" (a KeyedOptimizer saves them only when asked to), groups
    listing names."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        return False
    groups = state_dict.get("param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return False
    if not all(isinstance(g.get("params", []), list) for g in groups):
        return False
    params = [p for g in groups for p in (g.get("params") or [])] + list(state_dict["state"])
    return bool(params) and all(isinstance(p, str) for p in params)


def _names_in(named: Mapping, more=()) -> list[str]:
    """Every parameter name a name-keyed state_dict knows (its groups', then its state's, then `more`)."""
    out = dict.fromkeys(p for g in named.get("param_groups", []) for p in g["params"])
    out.update(dict.fromkeys(named["state"]))
    out.update(dict.fromkeys(more))
    return list(out)


def is_optimizer(obj) -> bool:
    """A torch optimizer-like object: `param_groups` of dicts with "params", and state_dict/load_state_dict."""
    groups = getattr(obj, "param_groups", None)
    return (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            and isinstance(groups, list) and all(isinstance(g, Mapping) and "params" in g for g in groups))


def _names_by_id(model) -> dict[int, str]:
    named = getattr(model, "named_parameters", None)
    out: dict[int, str] = {}
    if callable(named):
        for n, p in named():
            out.setdefault(id(p), n)   # a shared (tied) parameter goes by its first name
    return out


def _aliases(model) -> dict[str, str]:
    """Every other name of a shared (tied) parameter -> the name `param_names` gives it: a checkpoint of a
    model that lists the tied modules in another order names that parameter otherwise."""
    named = getattr(model, "named_parameters", None)
    if not callable(named):
        return {}
    try:
        every = list(named(remove_duplicate=False))
    except TypeError:   # (a model whose named_parameters takes no such argument)
        return {}
    first = _names_by_id(model)
    return {n: first[id(p)] for n, p in every if id(p) in first and first[id(p)] != n}


def param_names(model, optimizer) -> list[str | None]:
    """The model name of each parameter of `optimizer`, in the numbering of its state_dict (None: not a
    parameter of `model`)."""
    by_id = _names_by_id(model)
    return [by_id.get(id(p)) for g in optimizer.param_groups for p in g["params"]]


def saved_param_names(model, obj, state) -> list[str | None] | None:
    """What a save records next to registered object `obj`'s state (`state`, its state_dict): its
    parameters' model names, when it is an optimizer whose state numbers them; else None (nothing to
    record: not an optimizer, or one that names its parameters itself)."""
    if not is_optimizer(obj) or not is_positional(state):
        return None
    try:
        return param_names(model, obj)
    except (TypeError, AttributeError, KeyError):
        return None


def _keys(names: Sequence[str | None]) -> list[str]:
    """Names, with each unnamed parameter keyed by its order among the unnamed ones."""
    out, k = [], 0
    for n in names:
        if n is None:
            out.append(f"{UNNAMED}{k}")
            k += 1
        else:
            out.append(n)
    return out


def to_named(state_dict: Mapping, names: Sequence[str | None], where: str = "optimizer state") -> dict:
    """A positional (torch.optim) state_dict keyed by `names` (index i → names[i]) instead."""
    if not is_positional(state_dict):
        raise InvalidArgumentError(f"{where}: not a torch.optim state_dict (param_groups of numbered params)")
    keys = _keys(names)
    groups = state_dict["param_groups"]
    n = sum(len(g["params"]) for g in groups)
    if len(keys) != n or sorted(p for g in groups for p in g["params"]) != list(range(n)):
        raise IncompatibleCheckpointError(
            f"{where}: {len(keys)} parameter names recorded for an optimizer state of {n} parameters; the "
            f"names do not describe this state")
    state = state_dict.get("state") or {}
    return {"state": {keys[i]: s for i, s in state.items() if isinstance(i, int) and 0 <= i < n},
            "param_groups": [dict(g, params=[keys[i] for i in g["params"]]) for g in groups]}


def _positional(named: Mapping, template: Mapping) -> dict:
    """`named` in the numbering of positional state_dict `template` (same parameters, named by
    `to_named(template, ...)`)."""
    index = {}
    for g_named, g in zip(named["param_groups"], template["param_groups"]):
        index.update(zip(g_named["params"], g["params"]))
    return {"state": {index[k]: v for k, v in named["state"].items()},
            "param_groups": [dict(gn, params=list(g["params"]))
                             for gn, g in zip(named["param_groups"], template["param_groups"])]}


@dataclass(frozen=True)
class OptimizerStateMatch:
    """How saved optimizer state maps onto a live optimizer, by parameter name."""
    state_dict: dict
    """What to pass to the live optimizer's `load_state_dict` (in its own form: numbered or named)."""
    matched: tuple[str, ...]
    """Model parameters that take the saved state of the parameter of the same (renamed) name."""
    new: tuple[str, ...]
    """Model parameters the saved state does not know: they keep the live optimizer's state (none for a
    fresh optimizer: they start fresh)."""
    gone: tuple[str, ...]
    """Saved parameters with no parameter of that (renamed) name in the live optimizer: not applied."""
    conflicts: tuple[str, ...]
    """Why the state cannot be applied at all: a saved parameter whose shape differs from the model's,
    two saved parameters renamed onto one. Empty when it can."""
    group_sources: tuple[int | None, ...] = ()
    """Per live param group, the saved group whose hyper-parameters it takes (None: it keeps its own). An
    LR scheduler of the optimizer keeps per-group lists by position: `scheduler_state` reorders them."""

    def problems(self, what: str) -> tuple[list[str], list[str]]:
        """(missing, unexpected) lines for a load report, naming the parameters."""
        missing = [f"{what}: model parameter {n!r} has no state in the checkpoint (it starts fresh)"
                   for n in self.new]
        unexpected = [f"{what}: checkpoint parameter {n!r} is not a parameter of the model's optimizer "
                      f"(its state is not applied)" for n in self.gone]
        return missing, unexpected


def match_named(saved: Mapping, live: Mapping, shapes: Mapping[str, tuple], *,
                rename: Callable[[str], str] = lambda n: n,
                selected: Callable[[str], bool] = lambda n: True,
                saved_shapes: Mapping[str, tuple] | None = None) -> OptimizerStateMatch:
    """Map name-keyed optimizer state `saved` onto name-keyed `live` (the live optimizer's own state).

    Each saved parameter name goes through `rename` (checkpoint name → model name); saved names that
    `selected` refuses are left out (the live parameter keeps its state). `shapes`: the live
    parameters' shapes by name; `saved_shapes`: the saved parameters' shapes where known (e.g. the
    checkpoint's dense tensors), checked against them. Group hyper-parameters (lr, betas, ...) of a
    live group come from the saved group holding the first of its parameters that is matched."""
    live_names = _names_in(live, shapes)
    live_set = set(live_names)
    saved_group_of: dict[str, int] = {}
    for gi, g in enumerate(saved.get("param_groups", [])):
        for p in g["params"]:
            saved_group_of.setdefault(p, gi)
    saved_names = _names_in(saved)
    target_of: dict[str, str] = {}     # live name → saved name
    gone, conflicts = [], []
    for s in saved_names:
        unnamed = s.startswith(UNNAMED)
        if not unnamed and not selected(s):
            continue
        t = s if unnamed else rename(s)
        if t not in live_set:
            gone.append(s)
            continue
        if t in target_of:
            conflicts.append(f"checkpoint parameters {target_of[t]!r} and {s!r} both map to model parameter "
                             f"{t!r} (check load_conf 'rename')")
            continue
        target_of[t] = s
        want, have = (saved_shapes or {}).get(s), shapes.get(t)
        if want is None:
            want = _state_shape(saved["state"].get(s), have)
        if want is not None and have is not None and tuple(want) != tuple(have):
            conflicts.append(f"parameter {s!r}: checkpoint shape {tuple(want)} vs model shape {tuple(have)}")
    if target_of:   # (nothing of it applied: the saved groups are not taken either)
        conflicts += _other_optimizer(saved, live)
    state = dict(live.get("state") or {})
    for t, s in target_of.items():
        if s in saved["state"]:
            state[t] = saved["state"][s]
        else:
            state.pop(t, None)   # never stepped at save time: no state, as then
    groups, sources = [], []
    saved_groups, live_groups = saved.get("param_groups", []), live.get("param_groups", [])
    for gi, g in enumerate(live_groups):
        src = next((saved_group_of[target_of[p]] for p in g["params"]
                    if p in target_of and target_of[p] in saved_group_of), None)
        if (src is None and not g["params"] and len(saved_groups) == len(live_groups)
                and not saved_groups[gi]["params"]):
            # A group without parameters (a no-decay group left empty) has no name to match by: it is the
            # saved empty group at its place, whose hyper-parameters a scheduler has moved on as the others'.
            src = gi
        sources.append(src)
        base = g if src is None else {k: v for k, v in saved["param_groups"][src].items()
                                      if k not in ("params", "param_names")}
        groups.append(dict(base, params=list(g["params"]),
                           **({"param_names": g["param_names"]} if "param_names" in g else {})))
    # A live parameter whose saved counterpart the load leaves out (`selected`), or renames onto another
    # parameter (a copy of one layer into another), is not a target of the load: it keeps its state, not new.
    named = [s for s in saved_names if not s.startswith(UNNAMED)]
    left_out = {rename(s) for s in named if not selected(s)} | {s for s in named if selected(s) and rename(s) != s}
    new = [n for n in live_names if n not in target_of and n not in left_out]
    out = {"state": state, "param_groups": groups} if "param_groups" in live else {"state": state}
    return OptimizerStateMatch(out, tuple(target_of), tuple(new), tuple(gone), tuple(conflicts), tuple(sources))


def _state_shape(entry, have) -> tuple | None:
    """The parameter shape a saved state entry shows (its first PARAM_SHAPED_STATE tensor of the live
    parameter's rank), or None. Only the rank is compared up front: a saved moment of another rank is an
    optimizer's own layout, not a changed parameter."""
    if not isinstance(entry, Mapping) or have is None:
        return None
    for k in PARAM_SHAPED_STATE:
        shape = getattr(entry.get(k), "shape", None)
        if shape is not None and len(shape) == len(have):
            return tuple(shape)
    return None


def _other_optimizer(saved: Mapping, live: Mapping) -> list[str]:
    """Why the saved state is another optimizer's (Adam's state into an SGD): the hyper-parameters of its
    groups and the live optimizer's each hold names the other lacks (betas vs momentum), among those that
    tell optimizers apart (`OPTIMIZER_HYPER_PARAMETERS`: not a torch version's new options, a scheduler's
    keys or the user's own)."""
    def keys(groups) -> set:
        return {k for g in groups if isinstance(g, Mapping) for k in g if k in OPTIMIZER_HYPER_PARAMETERS}

    saved_keys, live_keys = keys(saved.get("param_groups") or []), keys(live.get("param_groups") or [])
    if not saved_keys or not live_keys or not (saved_keys - live_keys) or not (live_keys - saved_keys):
        return []
    return [f"the checkpoint holds another optimizer's state (its groups set {sorted(saved_keys - live_keys)}, "
            f"this optimizer's {sorted(live_keys - saved_keys)}): loaded, its first step would fail or run on "
            f"wrong hyper-parameters; leave registered objects out with load_conf {{'exclude': ['extra']}} (the "
            f"optimizer then starts fresh)"]


def _torch_optim_class(optimizer):
    """(the class, the constructor's keywords from its `defaults`) of one of torch.optim's own optimizers,
    else None: their behaviour is known, so a throwaway instance tells what a step of them needs."""
    import inspect
    cls = type(optimizer)
    defaults = getattr(optimizer, "defaults", None)
    if not cls.__module__.startswith("torch.optim") or not isinstance(defaults, Mapping):
        return None
    # the defaults its constructor takes (AdamW's hold Adam's decoupled_weight_decay, fixed by the class)
    takes = inspect.signature(cls.__init__).parameters
    return cls, {k: v for k, v in defaults.items() if k in takes}


def _steps_on(cls, kwargs: dict, shape: tuple, entry: Mapping | None, group: Mapping | None) -> str | None:
    """Why an instance of `cls` given one parameter's saved state (`entry`, and its group's hyper-parameters
    `group`; None: none) fails to load it or to take a step on it (None: it does both). The parameter is a
    throwaway of `shape`; nothing else is touched."""
    import torch
    p = torch.nn.Parameter(torch.zeros(shape))
    try:
        probe = cls([p], **kwargs)
        if group is not None:
            # copies: torch keeps a loaded tensor of the right dtype as it is, and the step updates it in place
            own = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in (entry or {}).items()}
            probe.load_state_dict({"state": {0: own} if own else {}, "param_groups": [dict(group, params=[0])]})
        p.grad = torch.zeros(shape)
        probe.step()
    except Exception as e:  # noqa: BLE001 - what the live optimizer would meet, said before anything is loaded
        return f"{type(e).__name__}: {e}"
    return None


def _fails_to_step(optimizer, state_dict: Mapping, shapes: list) -> list[str]:
    """Why the live torch.optim `optimizer` could not take its first step on `state_dict` (its own
    positional form, what the load gives it): another optimizer's state (Adamax's exp_inf where Adam reads
    exp_avg_sq, NAdam's mu_product), which the names of hyper-parameters cannot always tell. Tried on a
    throwaway instance of its class with the smallest parameter that takes saved state; nothing if the
    class cannot step even fresh (LBFGS needs a closure), or is not torch.optim's."""
    known = _torch_optim_class(optimizer)
    if known is None or not state_dict.get("state"):
        return []
    cls, kwargs = known
    if _steps_on(cls, kwargs, (2,), None, None) is not None:
        return []
    held = [i for i in state_dict["state"] if isinstance(i, int) and 0 <= i < len(shapes)]
    if not held:
        return []
    idx = min(held, key=lambda i: math.prod(shapes[i]))
    group = next((g for g in state_dict["param_groups"] if idx in g["params"]), None)
    if group is None:
        return []
    why = _steps_on(cls, kwargs, tuple(shapes[idx]), state_dict["state"][idx],
                    {k: v for k, v in group.items() if k != "params"})
    if why is None:
        return []
    return [f"the checkpoint holds state this {cls.__name__} cannot use (another optimizer's?): loaded, its "
            f"first step would fail ({why}); leave registered objects out with load_conf {{'exclude': ['extra']}} "
            f"(the optimizer then starts fresh)"]


def _live_named(optimizer, model) -> tuple[dict, dict | None, dict[str, tuple]]:
    """(the live optimizer's state keyed by name, its positional state_dict or None when it names its
    parameters itself, the live parameters' shapes by name)."""
    sd = optimizer.state_dict()
    if is_positional(sd):
        names = param_names(model, optimizer)
        keys = _keys(names)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return to_named(sd, names), sd, {k: live_shape(p) for k, p in zip(keys, params)}
    if is_named(sd) or _keyed_and_empty(optimizer, sd):
        shapes = {}
        params = getattr(optimizer, "params", None)   # KeyedOptimizer: {name: parameter}
        if isinstance(params, Mapping):
            shapes = {k: live_shape(p) for k, p in params.items()}
        return sd, None, shapes
    raise InvalidArgumentError(f"{type(optimizer).__name__}.state_dict() is neither a torch.optim state_dict "
                               f"(numbered parameters) nor one keyed by parameter name")


def live_shape(p) -> tuple | None:
    """A live parameter's shape; None for an uninitialized lazy one (LazyLinear before its first forward),
    which takes the saved shape when the model's state loads, and so is not checked against it."""
    import torch
    if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
        return None
    return tuple(getattr(p, "shape", ()))


def _keyed_and_empty(optimizer, sd) -> bool:
    """An optimizer that names its parameters itself (`params`: {name: parameter}, TorchRec's
    KeyedOptimizer) before its first step: no state yet, so its state_dict names nothing."""
    return (isinstance(getattr(optimizer, "params", None), Mapping) and isinstance(sd, Mapping)
            and sd.get("state") == {} and not sd.get("param_groups"))


def init_state_for_load(optimizer, state_dict: Mapping) -> bool:
    """Before `optimizer.load_state_dict(state_dict)`: an optimizer with no state yet (before its first
    step) that refuses to load into empty state and initialises it with `init_state()` (TorchRec's
    KeyedOptimizer: "Different parameter count: 0 vs N") gets its state initialised first, as its
    `init_state` does: one step with zero gradients. Every group's learning rate is 0 for that step, so
    no parameter moves (weight decay included, for torch's optimizers), and the gradients are put back as
    they were; the load then overwrites the state the step created. Returns whether it initialised."""
    init = getattr(optimizer, "init_state", None)
    saved = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not callable(init) or not saved or len(optimizer.state) > 0:
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        init()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr
    return True


def named_optimizer_state(optimizer, model=None) -> dict:
    """`optimizer`'s state keyed by each parameter's name in `model` (`{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}`), as torch.distributed.checkpoint's
    `get_optimizer_state_dict` keys it. An optimizer that names its parameters itself (TorchRec's
    KeyedOptimizer) is returned as it is, and needs no model. Raises InvalidArgumentError when a
    parameter of the optimizer is not a parameter of `model`."""
    sd = optimizer.state_dict()
    if is_named(sd):
        return sd
    if model is None:
        raise InvalidArgumentError("named_optimizer_state: this optimizer numbers its parameters; pass the model "
                                   "whose named_parameters() name them")
    names = param_names(model, optimizer)
    if None in names:
        raise InvalidArgumentError(f"named_optimizer_state: {names.count(None)} parameter(s) of the optimizer "
                                   f"are not parameters of the model given, so they have no name")
    return to_named(sd, names)


def match_optimizer_state(optimizer, model, saved: Mapping, *, rename: Callable[[str], str] = lambda n: n,
                          selected: Callable[[str], bool] = lambda n: True,
                          saved_shapes: Mapping[str, tuple] | None = None) -> OptimizerStateMatch:
    """How name-keyed `saved` state maps onto live `optimizer` (of `model`); its `state_dict` is in the
    optimizer's own form, ready for `optimizer.load_state_dict`. Nothing is changed."""
    if not is_named(saved) and (saved.get("param_groups") or saved.get("state")):
        raise InvalidArgumentError("match_optimizer_state: the saved state is not keyed by parameter name")
    live, positional, shapes = _live_named(optimizer, model)
    if positional is not None:   # named by the model here: a tied parameter answers to each of its names
        # (unless the saved state holds the name it goes by: then the other names are other, untied parameters)
        held = {rename(n) for n in _names_in(saved)}
        aliases = {n: c for n, c in _aliases(model).items() if c not in held}
        if aliases:
            plain_rename = rename

            def rename(n: str) -> str:
                t = plain_rename(n)
                return aliases.get(t, t)
    m = match_named(saved, live, shapes, rename=rename, selected=selected, saved_shapes=saved_shapes)
    if positional is not None:
        sd = _positional(m.state_dict, positional)
        conflicts = m.conflicts
        params = [live_shape(p) for g in optimizer.param_groups for p in g["params"]]
        # (a probe step needs every shape: an uninitialized lazy parameter has none before the load)
        if m.matched and not conflicts and None not in params:
            conflicts = tuple(_fails_to_step(optimizer, sd, params))
        m = OptimizerStateMatch(sd, m.matched, m.new, m.gone, conflicts, m.group_sources)
    return m


#: The per-param-group lists of torch.optim.lr_scheduler's schedulers (CyclicLR's momenta, ReduceLROnPlateau's
#: floors, the lambdas' own state); SequentialLR and ChainedScheduler hold their schedulers' states under "_schedulers".
SCHEDULER_GROUP_LISTS = ("base_lrs", "_last_lr", "max_lrs", "base_momentums", "max_momentums", "min_lrs",
                         "lr_lambdas")   # (LambdaLR's and MultiplicativeLR's callable objects' state, or None)


def scheduler_state(saved: Mapping, live: Mapping, sources: Sequence[int | None]) -> dict:
    """An LR scheduler's saved state with its per-group lists in the live optimizer's group order:
    `sources[i]` is the saved group live group i takes its hyper-parameters from (`group_sources`), None
    for a group the checkpoint lacks, which keeps the live scheduler's entry. Unchanged where the
    groups kept their order or a list is not one entry per saved group."""
    out = dict(saved)
    for key in SCHEDULER_GROUP_LISTS:
        old, mine = saved.get(key), live.get(key)
        if (isinstance(old, list) and isinstance(mine, list) and len(mine) == len(sources)
                and all(s is None or 0 <= s < len(old) for s in sources)):
            out[key] = [mine[i] if s is None else old[s] for i, s in enumerate(sources)]
    inner, mine = saved.get("_schedulers"), live.get("_schedulers")
    if isinstance(inner, list) and isinstance(mine, list) and len(inner) == len(mine):
        out["_schedulers"] = [scheduler_state(a, b, sources) if isinstance(a, Mapping) and isinstance(b, Mapping)
                              else a for a, b in zip(inner, mine)]
    return out


def apply_named_optimizer_state(optimizer, model, saved: Mapping, *, strict: bool = True,
                                rename: Mapping[str, str] | Callable[[str], str] | None = None
                                ) -> OptimizerStateMatch:
    """Load name-keyed optimizer state `saved` (from `named_optimizer_state`, a KeyedOptimizer or DCP)
    into `optimizer`, matching parameters by name in `model` (after `rename`: a dict of checkpoint
    name → model name, where a key ending in '.' renames a prefix as in `LoadConfig.rename`, or a
    function). Parameters present in both get the saved state; parameters the
    saved state does not know keep their own (none for a fresh optimizer); saved parameters that are
    gone are reported. strict=True refuses any difference with IncompatibleCheckpointError naming the
    parameters; a shape conflict is always refused. Nothing changes when it raises."""
    if isinstance(rename, Mapping):
        table = dict(rename)
        rename_fn = lambda n: renames.renamed(table, n)  # noqa: E731
    else:
        rename_fn = rename or (lambda n: n)
    m = match_optimizer_state(optimizer, model, saved, rename=rename_fn)
    missing, unexpected = m.problems("optimizer")
    if m.conflicts or (strict and (missing or unexpected)):
        raise IncompatibleCheckpointError("optimizer state does not match the optimizer: "
                                          + "; ".join(list(m.conflicts) + missing + unexpected)
                                          + ". Nothing was loaded.")
    optimizer.load_state_dict(m.state_dict)
    return m


__all__ = ["OptimizerStateMatch", "named_optimizer_state", "apply_named_optimizer_state", "match_optimizer_state",
           "param_names", "saved_param_names", "is_positional", "is_named", "is_optimizer", "to_named", "UNNAMED",
           "init_state_for_load"]
