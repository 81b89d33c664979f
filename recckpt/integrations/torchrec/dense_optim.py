"""A data-parallel table's optimizer state, which lives in the user's dense optimizer.

DMP gives a data-parallel table no fused optimizer: its weight is an ordinary parameter, stepped by the
dense optimizer the user registers with `register_for_checkpointing` (a TorchRec `KeyedOptimizer`, keyed
by parameter name, or a `torch.optim` optimizer). Its state is saved as the table's slots, like a sharded
table's fused state, so a table that changes sides (data-parallel <-> sharded) keeps it:

- `dp_slots` finds the state of each data-parallel table's parameter in the registered optimizers
  (Adagrad's and RowWiseAdagrad's `sum`, as the fused kernels' `momentum1`);
- a save leaves those parameters out of a name-keyed optimizer's own saved state (`saved_state`): the
  table's slots hold their accumulator, and the rest of each entry (the `step` count, which Adagrad's
  `lr_decay` reads) is kept beside the state by table name (`TABLE_STATE`), so it follows its table
  through a rename;
- a load gives a name-keyed optimizer its live entries for the data-parallel parameters it holds
  (`loaded_state`), with the saved step of the table loaded into each, so `KeyedOptimizer.load_state_dict`,
  which wants exactly its own parameters and keys, does not refuse a table that changed sides; the table's
  rows then write the accumulator in place.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Tuple

import torch

from ...errors import InvalidArgumentError
from ...state.optim_names import named_optimizer_state, param_names
from .table import ADAGRAD, ROWWISE_ADAGRAD

#: The key of the Adagrad-like accumulator in an optimizer's per-parameter state (torch's Adagrad,
#: TorchRec's RowWiseAdagrad): the state a data-parallel table's slots hold.
ACC = "sum"
#: Where a name-keyed optimizer's saved state keeps the rest of a data-parallel table's parameter entry
#: (all but `ACC`, which the table's slots hold), keyed by the table's name: an optimizer's
#: `load_state_dict` reads only "state" and "param_groups", so it never sees this key.
TABLE_STATE = "recckpt.table_state"


def optimizers(objects: Iterable[Any]) -> List[Any]:
    """The registered objects that keep per-parameter state like a torch optimizer (`state[param]`)."""
    return [o for o in objects if isinstance(getattr(o, "state", None), Mapping)
            and isinstance(getattr(o, "param_groups", None), list)]


def _acc_slot(acc_shape: Tuple[int, ...], rows: int, cols: int) -> str | None:
    """The slot an Adagrad-like `sum` of shape `acc_shape` for a [rows, cols] parameter is: ADAGRAD when it
    has the parameter's shape, ROWWISE_ADAGRAD with one value per row ([rows] or [rows, 1]), else None."""
    if tuple(acc_shape) == (rows, cols):
        return ADAGRAD
    if len(acc_shape) in (1, 2) and math.prod(acc_shape) == rows and acc_shape[0] == rows:
        return ROWWISE_ADAGRAD
    return None


def dp_slots(param: torch.Tensor, shape: Tuple[int, int], opts: List[Any]
             ) -> Tuple[Dict[str, Callable[[], torch.Tensor]], Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]]:
    """({slot: function giving the live state tensor}, {slot: (dtype, row shape)}) of a data-parallel
    table's parameter `param` of `shape` [N, D], from the first optimizer in `opts` holding state for
    it. Only Adagrad-like `sum` state maps ([N, D] -> adagrad.acc, [N] or [N, 1] -> rowwise_adagrad.acc);
    other optimizers' state stays in their own saved state (the table then has no optimizer slots)."""
    n, d = shape
    opt, st = _holder(param, opts)
    acc = st.get(ACC) if st is not None else None
    slot = _acc_slot(tuple(acc.shape), n, d) if isinstance(acc, torch.Tensor) else None
    if slot == ADAGRAD:
        return {ADAGRAD: lambda o=opt: o.state[param][ACC]}, {ADAGRAD: (acc.dtype, (d,))}
    if slot == ROWWISE_ADAGRAD:
        return {ROWWISE_ADAGRAD: lambda o=opt: o.state[param][ACC].view(n)}, {ROWWISE_ADAGRAD: (acc.dtype, ())}
    return {}, {}


def _holder(param: torch.Tensor, opts: List[Any]) -> Tuple[Any, Mapping] | Tuple[None, None]:
    """(the first of `opts` holding state for `param`, that state), or (None, None)."""
    for opt in opts:
        st = opt.state.get(param)
        if isinstance(st, Mapping) and len(st):
            return opt, st
    return None, None


def holds_accumulator(param: torch.Tensor, opts: List[Any]) -> bool:
    """Whether a registered optimizer keeps an Adagrad-like `sum` for `param` of its own shape, or one value
    per row of it: state that a sharded table on TorchRec's "dense" kernel saves as its slots. A rank
    holding no shard of such a table has an empty parameter, with an empty `sum`."""
    _, st = _holder(param, opts)
    acc = st.get(ACC) if st is not None else None
    if not isinstance(acc, torch.Tensor):
        return False
    if param.numel() == 0:
        return acc.numel() == 0
    return param.dim() == 2 and _acc_slot(tuple(acc.shape), *param.shape) is not None


def sharded_dense_slots(table: str, param: torch.Tensor, shards: List[Tuple[Tuple[int, ...], torch.Tensor]],
                        dim: int, opts: List[Any]) -> Tuple[List[Dict[str, Callable[[], torch.Tensor]]],
                                                            Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]] | None:
    """The slots of a table sharded on TorchRec's "dense" kernel, kept by a registered dense optimizer:
    ([per local shard {slot: function giving its live state}], {slot: (dtype, row shape)}); None when no
    registered optimizer holds state for the table's parameter `param` (SGD), or this rank holds no shard
    of it (the ranks that do say which slots it has).

    On that kernel each rank's parameter is its local shards stacked by rows (a rank holding two column
    shards of a table has a [2 N, D / k] parameter), a view of the same storage as the shards of the
    table's state_dict entry, and the optimizer's `sum` has the parameter's shape (Adagrad) or one value per
    row of it (RowWiseAdagrad). Each shard's state is the block of rows of `sum` where its weight lies in
    the parameter. Raises when the optimizer keeps other state (Adam's moments): each rank holds its own
    shard of it, and the optimizer's own saved state is rank 0's alone, so a load would give every rank
    rank 0's shard."""
    opt, st = _holder(param, opts)
    if opt is None:
        return None
    if not holds_accumulator(param, opts):
        raise InvalidArgumentError(
            f"TorchRec table {table!r} is sharded on the 'dense' compute kernel, and the registered optimizer "
            f"{type(opt).__name__} holds per-rank state for it ({sorted(st)}) that recckpt cannot save or load "
            f"correctly (each rank holds its own shard of it; recckpt maps an Adagrad-like 'sum' into the table's "
            f"slots). Shard it on a fused kernel (apply_optimizer_in_backward on its parameters, or "
            f"compute_kernel='fused' in the plan) or data_parallel, or use Adagrad/RowWiseAdagrad for it; see "
            f"docs/TORCHREC.md")
    if not shards:
        return None
    p_rows, p_cols = (int(x) for x in param.shape)
    elementwise = _acc_slot(tuple(st[ACC].shape), p_rows, p_cols) == ADAGRAD
    refs = []
    for off, t in shards:
        rows = int(t.shape[0])
        at = t.storage_offset() - param.storage_offset()
        if (t.untyped_storage().data_ptr() != param.untyped_storage().data_ptr() or t.dim() != 2
                or int(t.shape[1]) != p_cols or at % max(p_cols, 1) or not t.is_contiguous()
                or not 0 <= at // max(p_cols, 1) <= p_rows - rows):
            raise InvalidArgumentError(
                f"TorchRec table {table!r}: its local shard at {tuple(off)} is not a block of rows of the "
                f"'dense' kernel's parameter {tuple(param.shape)}, so recckpt cannot find its optimizer state; "
                f"shard it on a fused kernel or data_parallel (docs/TORCHREC.md)")
        r0 = at // max(p_cols, 1)
        if elementwise:
            refs.append({ADAGRAD: lambda o=opt, a=r0, b=r0 + rows: o.state[param][ACC][a:b]})
        else:
            refs.append({ROWWISE_ADAGRAD: lambda o=opt, a=r0, b=r0 + rows: o.state[param][ACC].view(p_rows)[a:b]})
    acc = st[ACC]
    slots = {ADAGRAD: (acc.dtype, (dim,))} if elementwise else {ROWWISE_ADAGRAD: (acc.dtype, ())}
    return refs, slots


def step_restart(param: torch.Tensor, opts: List[Any]) -> Callable[[], None] | None:
    """A function setting the `step` of `param`'s entry, in the first of `opts` holding state for it, back
    to 0 (a fresh torch Adagrad's); None when that entry has no step. Called when a load restarts every
    optimizer slot of the table `param` is (docs/LOADING.md: excluding sparse_opt starts it over), so the
    restarted accumulator is not paired with the live step (Adagrad's lr_decay reads it)."""
    opt, st = _holder(param, opts)
    if opt is None or "step" not in st:
        return None

    def restart(o=opt) -> None:
        entry = o.state[param]   # looked up when called: a load may have installed new tensors
        step = entry.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            entry["step"] = 0
    return restart


def accumulator_init(param: torch.Tensor, opts: List[Any]) -> float:
    """The value the Adagrad-like `sum` state of `param` starts at: the `initial_accumulator_value` of the
    param group holding it in the first of `opts` that has one (torch's Adagrad, TorchRec's RowWiseAdagrad);
    0 where none says."""
    for opt in opts:
        for group in getattr(opt, "param_groups", None) or []:
            if any(p is param for p in group.get("params", ())):
                return float(group.get("initial_accumulator_value", 0.0))
    return 0.0


def _named(state: Any) -> bool:
    return isinstance(state, Mapping) and isinstance(state.get("state"), Mapping) and all(
        isinstance(k, str) for k in state["state"])


def _param_items(obj: Any, model) -> List[Tuple[str, Any]]:
    """(name, parameter) of every parameter of optimizer `obj`: a KeyedOptimizer names them (`params`),
    a torch.optim optimizer's get their names in `model`."""
    params = getattr(obj, "params", None)
    if isinstance(params, Mapping):
        return list(params.items())
    names = param_names(model, obj)
    return [(n, p) for n, p in zip(names, (p for g in obj.param_groups for p in g["params"])) if n is not None]


def saved_state(obj: Any, state: Any, moved: Mapping[int, str], model=None, per_rank: set = frozenset()) -> Any:
    """`state` (obj's state_dict) without the entries of parameters whose state the tables' slots hold
    (`moved`: parameter id -> table name), for a name-keyed state (a KeyedOptimizer's; for a torch.optim
    optimizer's numbered state see below, and `loaded_state` replaces what a load applies). The rest of
    each such entry (its `step`, which Adagrad's `lr_decay` reads) is kept under `TABLE_STATE`, by table
    name, so that it follows its table through a rename or a change of sides. A numbered state keeps its
    entries, less the `sum` of the parameters in `per_rank` (`_positional_without_accumulators`)."""
    if not _named(state):
        return _positional_without_accumulators(obj, state, per_rank)
    tables = {n: moved[id(p)] for n, p in _param_items(obj, model) if id(p) in moved}
    if not tables:
        return state
    out = dict(state, state={k: v for k, v in state["state"].items() if k not in tables})
    if isinstance(state.get("param_groups"), list):
        out["param_groups"] = [dict(g, params=[p for p in g.get("params", []) if p not in tables])
                               for g in state["param_groups"]]
    rest = {t: {k: v for k, v in state["state"][n].items() if k != ACC} for n, t in tables.items()
            if isinstance(state["state"].get(n), Mapping)}
    if any(rest.values()):
        out[TABLE_STATE] = {t: e for t, e in rest.items() if e}
    return out


def _positional_without_accumulators(obj: Any, state: Any, per_rank: set) -> Any:
    """A torch.optim optimizer's numbered `state` without the `sum` of the parameters in `per_rank` (tables
    on the "dense" kernel, whose slots hold it): each rank's is its own shard, and this state is saved from
    rank 0. The rest of each entry (the `step`) stays, keyed by number. A data-parallel table's `sum` stays:
    rank 0's is every rank's, and a load into an unsharded model reads it there."""
    entries = state.get("state") if isinstance(state, Mapping) else None
    groups = getattr(obj, "param_groups", None)
    if not per_rank or not isinstance(entries, Mapping) or not isinstance(groups, list):
        return state
    numbers = {i for i, p in enumerate(p for g in groups for p in g["params"]) if id(p) in per_rank}
    if not any(isinstance(entries.get(i), Mapping) and ACC in entries[i] for i in numbers):
        return state
    return dict(state, state={k: ({a: b for a, b in v.items() if a != ACC} if k in numbers and isinstance(v, Mapping)
                                  else v) for k, v in entries.items()})


def loaded_state(obj: Any, state: Any, moved: Mapping[int, str], table_params: set, model,
                 loaded_tables: Mapping[str, str] | None = None, rename: Callable[[str], str] | None = None) -> Any:
    """The checkpoint's name-keyed `state` for optimizer `obj`, as the tables leave it: entries of TorchRec
    tables' parameters that `obj` does not hold now (a table saved data-parallel, sharded now) are left
    out, and `obj`'s own live entries are added for its moved parameters (`moved`: parameter id -> table
    name) the checkpoint lacks (the slots hold their accumulator): loading them copies each onto itself,
    and the table's rows are written afterwards. `loaded_tables`: checkpoint table -> model table, for the
    tables whose optimizer slots this load applies; their `TABLE_STATE` (the step) goes into their
    parameter's entry, and every other held table's parameter keeps its live entry. `rename`: a saved
    parameter name -> the model's (a renamed table's parameter); the state stays keyed by saved names,
    which the match renames after."""
    if not _named(state):
        return state
    rename = rename or (lambda n: n)
    key_of = {}   # model name -> the saved name that becomes it
    for k in state["state"]:
        key_of.setdefault(rename(k), k)
    held = _param_items(obj, model)
    held_names = {n for n, _ in held}
    loaded_tables = loaded_tables or {}
    kept = {loaded_tables[t]: e for t, e in (state.get(TABLE_STATE) or {}).items() if t in loaded_tables}
    from_table = {n: kept[moved[id(p)]] for n, p in held if id(p) in moved and moved[id(p)] in kept}
    drop = {k for k in state["state"] if rename(k) in table_params and rename(k) not in held_names}
    groups = state.get("param_groups")
    if isinstance(groups, list):
        drop |= {p for g in groups for p in g.get("params", [])
                 if rename(p) in table_params and rename(p) not in held_names}
    missing = [n for n, p in held if id(p) in moved and n not in key_of]
    # A torch.optim optimizer's state is saved whole, the tables' entries too: a held table that this load
    # leaves alone (not selected, or its optimizer slots not loaded) keeps its live entry, as its rows do.
    applied = set(loaded_tables.values())
    stay = {n for n, p in held if id(p) in moved and moved[id(p)] not in applied and n in key_of}
    # A saved entry of a table the load applies gets the live accumulator, which the table's rows then
    # overwrite: a saved one is rank 0's (a data-parallel table's copy of the slots; a dense-kernel table's
    # shard has been left out of numbered state since it is saved as slots).
    refill = {n for n, p in held if id(p) in moved and moved[id(p)] in applied and n in key_of}
    # A saved entry without its accumulator (a dense-kernel table's, in numbered state: its slots hold it)
    # for a table parameter no table slot fills here (an unsharded module this optimizer steps): it keeps
    # the live accumulator, as an entry without one cannot be stepped; the slots the model lacks are what
    # the load reports.
    refill |= {n for n, p in held if id(p) not in moved and n in table_params and n in key_of
               and isinstance(state["state"][key_of[n]], Mapping) and ACC not in state["state"][key_of[n]]}
    if not drop and not missing and not stay and not refill and TABLE_STATE not in state:
        return state
    live = named_optimizer_state(obj, model)["state"] if missing or stay or refill else {}
    out = {k: v for k, v in state.items() if k != TABLE_STATE}
    stay_keys = {key_of[n] for n in stay}
    out["state"] = {**{k: v for k, v in state["state"].items() if k not in drop and k not in stay_keys},
                    **{key_of[n]: live[n] for n in stay if n in live},
                    **{key_of[n]: {**state["state"][key_of[n]], ACC: live[n][ACC]} for n in refill
                       if isinstance(state["state"][key_of[n]], Mapping) and ACC in live.get(n, {})},
                    **{n: {**live[n], **from_table.get(n, {})} for n in missing if n in live}}
    if isinstance(groups, list):
        new_groups = [dict(g, params=[p for p in g.get("params", []) if p not in drop]) for g in groups]
        have = {p for g in new_groups for p in g["params"]}
        for n in missing:
            if n not in have and new_groups:
                new_groups[0]["params"].append(n)
        out["param_groups"] = new_groups
    return out
