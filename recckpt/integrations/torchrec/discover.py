"""Finding TorchRec tables in a model, sharded (DistributedModelParallel) or not, with their optimizer state.

Table names are the parameter's name without `.weight`, with wrappers' prefixes left out
(DistributedModelParallel's `_dmp_wrapped_module`, DDP's `module`, torch.compile's `_orig_mod`), so a
table keeps its name whether the model is sharded, wrapped or compiled: `ebc.embedding_bags.t0`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

from ...errors import InvalidArgumentError
from .agree import agreed_slots
from .dense_optim import accumulator_init, dp_slots, holds_accumulator, optimizers, sharded_dense_slots, step_restart
from .mch import MCHTable, persistent_buffers, writes_unsharded
from .table import ADAGRAD, EMBEDDING, ROWWISE_ADAGRAD, Shard, TorchRecTable

#: wrapper class name -> the child attribute that holds the wrapped module (left out of names)
WRAPPERS = {"DistributedModelParallel": "_dmp_wrapped_module", "DistributedDataParallel": "module",
            "DataParallel": "module", "OptimizedModule": "_orig_mod"}
#: TorchRec collection classes and the ModuleDict under which their tables' parameters live
UNSHARDED = {"EmbeddingBagCollection": "embedding_bags", "EmbeddingCollection": "embeddings"}
SHARDED = {"ShardedEmbeddingBagCollection": "embedding_bags", "ShardedEmbeddingCollection": "embeddings"}
#: managed-collision wrappers: their `_embedding_module` is an EBC/EC (sharded or not), their
#: `_managed_collision_collection` holds one MCH module per table
MANAGED = ("ManagedCollisionEmbeddingBagCollection", "ManagedCollisionEmbeddingCollection",
           "ShardedManagedCollisionEmbeddingBagCollection", "ShardedManagedCollisionEmbeddingCollection")
MC_EMBEDDING, MC_COLLECTION = "_embedding_module", "_managed_collision_collection"


@dataclass(frozen=True)
class Found:
    """One TorchRec collection: its normalized name prefix, the raw prefixes under which its state_dict
    keys may appear, the module, and the ModuleDict holding its tables."""
    prefix: str
    raw_prefixes: Tuple[str, ...]
    module: Any
    tables_attr: str
    sharded: bool
    mc: Any = None
    """The managed-collision collection whose MCH modules key this collection's tables by raw id."""
    mc_prefixes: Tuple[str, ...] = ()


def _is_torchrec(m) -> bool:
    return type(m).__module__.startswith("torchrec.")


def collections(model) -> Iterator[Found]:
    """Every TorchRec EBC/EC (sharded or not) in `model`, outermost first, `model` itself included;
    their children are not searched."""
    def walk(m, norm: str, raw: str, wrapper_child: str | None):
        for child_name, child in m.named_children():
            skip = child_name == wrapper_child
            n = norm if skip else f"{norm}{child_name}."
            r = f"{raw}{child_name}."
            found = _collection(child, n, r)
            if found is not None:
                yield found
                continue
            yield from walk(child, n, r, WRAPPERS.get(type(child).__name__))
    root = _collection(model, "", "")
    if root is not None:   # an EBC/EC given as the model: its tables are `embedding_bags.<name>`
        yield root
        return
    yield from walk(model, "", "", WRAPPERS.get(type(model).__name__))


def _collection(m, n: str, r: str) -> Found | None:
    """`m` as a TorchRec collection found under the normalised prefix `n` (raw prefix `r`), or None."""
    cls = type(m).__name__
    if not _is_torchrec(m):
        return None
    if ".quant." in f"{type(m).__module__}." and (cls in UNSHARDED or cls in SHARDED or cls in MANAGED):
        # TorchRec's inference collections hold int8/int4 rows with per-row scale and shift: another layout
        raise InvalidArgumentError(
            f"TorchRec {type(m).__module__}.{cls} at {n!r} is a quantized inference collection; recckpt saves and "
            f"loads the training collections (torchrec.EmbeddingBagCollection / EmbeddingCollection). Load the "
            f"checkpoint into the float model, then quantize it as TorchRec does (or export it: recckpt export)")
    if cls in MANAGED:
        inner = getattr(m, MC_EMBEDDING)
        icls = type(inner).__name__
        sharded = icls in SHARDED
        if not (sharded or icls in UNSHARDED):
            raise InvalidArgumentError(f"TorchRec {cls} at {n!r} wraps a {icls}; recckpt maps "
                                       f"EmbeddingBagCollection / EmbeddingCollection tables")
        return Found(f"{n}{MC_EMBEDDING}.", (f"{r}{MC_EMBEDDING}.", f"{n}{MC_EMBEDDING}."), inner,
                     (SHARDED if sharded else UNSHARDED)[icls], sharded, getattr(m, MC_COLLECTION),
                     (f"{r}{MC_COLLECTION}.", f"{n}{MC_COLLECTION}."))
    if cls in UNSHARDED or cls in SHARDED:
        sharded = cls in SHARDED
        return Found(n, (r, n), m, (SHARDED if sharded else UNSHARDED)[cls], sharded)
    return None


def _local_shards(t) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """(offsets, local tensor) of a ShardedTensor, a DTensor (TorchRec's LocalShardsWrapper) or a plain tensor."""
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):          # ShardedTensor
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    to_local = getattr(t, "to_local", None)
    if callable(to_local):                                              # DTensor
        loc = to_local()
        if hasattr(loc, "local_shards") and hasattr(loc, "local_offsets"):
            return [(tuple(o), s) for o, s in zip(loc.local_offsets(), loc.local_shards())]
        raise InvalidArgumentError(f"a DTensor whose local part is a {type(loc).__name__}: recckpt reads TorchRec's "
                                   f"DTensor state (LocalShardsWrapper) only")
    if isinstance(t, torch.Tensor):
        return [((0,) * t.dim(), t)]
    raise InvalidArgumentError(f"unexpected TorchRec state of type {type(t).__name__}")


def _dtype_of(t, shards) -> torch.dtype:
    if shards:
        return shards[0][1].dtype
    meta = getattr(t, "metadata", None)
    if callable(meta):
        return meta().tensor_properties.dtype
    return t.dtype


def _fused_states(table: str, states: Dict[str, Any], shape: Tuple[int, int]) -> Dict[str, Any]:
    """A fused optimizer's state entries of one table ({'<table>.momentum1': tensor}) -> {slot: state}.
    On CPU, FBGEMM's fused kernels run Adagrad (momentum1 shaped like the weight), RowWiseAdagrad
    (momentum1: one value per row, per column shard) and SGD (no state)."""
    out = {}
    for key, st in states.items():
        leaf = key.rpartition(".")[2]
        gshape = tuple(st.shape)
        if leaf == "momentum1" and gshape == shape:
            out[ADAGRAD] = st
        elif leaf == "momentum1" and len(gshape) == 1 and gshape[0] % shape[0] == 0:
            out[ROWWISE_ADAGRAD] = st
        else:
            raise InvalidArgumentError(
                f"TorchRec table {table!r}: fused optimizer state {key!r} of shape {gshape} is not one recckpt "
                f"maps (Adagrad's or RowWiseAdagrad's momentum1, of a table of shape {shape}); see docs/TORCHREC.md")
    return out


def _on_dense_kernel(ps) -> bool:
    """Whether a table's plan shards it on TorchRec's "dense" kernel: an ordinary parameter an ordinary
    optimizer steps whole. (Fused, key-value and SSD kernels update the rows they look up, with their own
    optimizer state; a data-parallel table is replicated, whatever its kernel.)"""
    return ps.sharding_type != "data_parallel" and str(getattr(ps, "compute_kernel", "fused")) == "dense"


def sharding_plan(found: List[Found]) -> Dict[str, Dict[str, Any]]:
    """Per table of the collections `found`: its sharding type, kernel, ranks and every shard's (row
    offset, column offset, rows, columns, rank), as this rank's plan says."""
    plan = {}
    for f in found:
        if f.sharded:
            for tname, ps in f.module.module_sharding_plan.items():
                shards = []
                for s in getattr(getattr(ps, "sharding_spec", None), "shards", None) or []:
                    rank = getattr(s.placement, "rank", lambda: None)()
                    shards.append([*map(int, s.shard_offsets), *map(int, s.shard_sizes), rank])
                plan[f"{f.prefix}{f.tables_attr}.{tname}"] = {
                    "sharding": ps.sharding_type, "kernel": str(getattr(ps.compute_kernel, "value", ps.compute_kernel)),
                    "ranks": list(ps.ranks or []),
                    "shards": shards}
        else:
            for tname in getattr(f.module, f.tables_attr):
                plan[f"{f.prefix}{f.tables_attr}.{tname}"] = {"sharding": "unsharded"}
    return plan


def _sharded_tables(f: Found, sd: Dict[str, Any], params: Dict[str, Any], opts: List[Any]
                    ) -> Tuple[List[TorchRecTable], List[str]]:
    plan = f.module.module_sharding_plan
    fused = f.module.fused_optimizer.state_dict().get("state", {})
    tables, keys = [], []
    for tname, ps in plan.items():
        full_name, key = _weight_key(f, tname, sd)
        rel = f"{f.tables_attr}.{tname}.weight"
        w = sd[key]
        n, d = (int(x) for x in w.shape)
        shards = _local_shards(w)
        replicated = ps.sharding_type == "data_parallel"
        fused_kernel = not _on_dense_kernel(ps)
        opt = _fused_states(full_name, fused.get(rel, {}), (n, d))
        # On the dense kernel, the registered dense optimizer keeps each rank's shard of the table's state
        dense_kernel = sharded_dense_slots(full_name, params[key], shards, d, opts) \
            if not fused_kernel and key in params else None
        opt_local = {slot: _local_shards(st) for slot, st in opt.items()}
        local = []
        for i, (off, t) in enumerate(shards):
            states = {}
            for slot, pieces in opt_local.items():
                if len(pieces) != len(shards):
                    raise InvalidArgumentError(
                        f"TorchRec table {full_name!r}: {len(shards)} local weight shards but "
                        f"{len(pieces)} local shards of its optimizer state {slot!r}")
                st = pieces[i][1]
                states[slot] = st.reshape(t.shape[0]) if slot == ROWWISE_ADAGRAD else st
            local.append(Shard(int(off[0]), int(t.shape[0]), int(off[1]), int(t.shape[1]), t, states))
        opt_slots = {slot: (_dtype_of(st, opt_local[slot]), (d,) if slot == ADAGRAD else ())
                     for slot, st in opt.items()}
        if dense_kernel is not None:
            refs_per_shard, opt_slots = dense_kernel
            for sh, refs in zip(local, refs_per_shard):
                sh.states.update(refs)
            init = accumulator_init(params[key], opts)
            opt_init = {slot: init for slot in opt_slots}
            restart = step_restart(params[key], opts)
        elif replicated and not opt and key in params:
            # A data-parallel table has no fused optimizer: its state is in its in-backward optimizer
            # (apply_optimizer_in_backward, e.g. on a table the default planner made data-parallel), or in
            # the user's dense optimizer.
            in_bw = _in_backward_states(full_name, params[key])
            if in_bw:
                refs = dict(in_bw)
                opt_slots = {slot: (st.dtype, (d,) if slot == ADAGRAD else ()) for slot, st in in_bw.items()}
                owners = _in_backward_optimizers(params[key])
            else:
                refs, opt_slots = dp_slots(params[key], (n, d), opts)
                owners = opts
            init = accumulator_init(params[key], owners)
            opt_init = {slot: init for slot in opt_slots}
            restart = step_restart(params[key], owners) if opt_slots else None
            for sh in local:
                sh.states.update(refs)
        else:
            opt_init, restart = {}, None   # FBGEMM's fused optimizer state starts at 0
        tables.append(dict(name=full_name, num_rows=n, dim=d, dtype=_dtype_of(w, shards), shards=local,
                           opt_slots=opt_slots, opt_init=opt_init, opt_restart=restart,
                           replicated=replicated, sharding=ps.sharding_type, trackable=fused_kernel,
                           column_blocks=None if replicated else _column_blocks(full_name, ps, d)))
        keys.append(key)
    return tables, keys


def _column_blocks(table: str, ps, dim: int):
    """The column ranges of a column-split plan's shards (one column block each, docs/FORMAT.md), from the
    plan every rank knows, so that every rank names the same blocks; None when every shard holds whole
    rows. A rank holding several column shards, adjacent or not (TorchRec's planner places them
    independently), saves and loads each as its own block, with its own per-row optimizer state."""
    shards = getattr(getattr(ps, "sharding_spec", None), "shards", None) or []
    ranges = sorted({(int(sm.shard_offsets[1]), int(sm.shard_offsets[1]) + int(sm.shard_sizes[1])) for sm in shards})
    if not ranges or ranges == [(0, dim)]:
        return None
    end = 0
    for c0, c1 in ranges:
        if c0 != end or c1 <= c0:
            raise InvalidArgumentError(
                f"TorchRec table {table!r}: its shards hold the column ranges {ranges}, which do not partition its "
                f"{dim} columns; recckpt saves column-wise plans whose column shards, each on one rank, tile the "
                f"columns with no overlap")
        end = c1
    if end != dim:
        raise InvalidArgumentError(
            f"TorchRec table {table!r}: its shards hold the column ranges {ranges}, which do not cover its {dim} "
            f"columns")
    return tuple(ranges)


def _in_backward_optimizers(param: torch.Tensor) -> List[Any]:
    return list(getattr(param, "_in_backward_optimizers", None) or [])


def _in_backward_states(table: str, param: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The state of an unsharded table's in-backward optimizer (`apply_optimizer_in_backward`), as slots.
    torch's Adagrad and TorchRec's RowWiseAdagrad call it 'sum' ([N, D] and [N, 1]); SGD keeps none."""
    opts = _in_backward_optimizers(param)
    out = {}
    for opt in opts:
        kind = type(opt).__name__
        st = opt.state.get(param, {})
        if kind == "SGD" and not any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in st.values()):
            continue
        if kind == "Adagrad" and "sum" in st:
            out[ADAGRAD] = st["sum"]
        elif kind == "RowWiseAdagrad" and "sum" in st:
            out[ROWWISE_ADAGRAD] = st["sum"].view(param.shape[0])
        else:
            raise InvalidArgumentError(
                f"TorchRec table {table!r}: its in-backward optimizer {kind} (state {sorted(st)}) is not one recckpt "
                f"maps to slots (Adagrad, RowWiseAdagrad, SGD); see docs/TORCHREC.md")
    return out


def _unsharded_tables(f: Found, sd: Dict[str, Any], params: Dict[str, Any], opts: List[Any]
                      ) -> Tuple[List[TorchRecTable], List[str]]:
    tables, keys = [], []
    for tname, sub in getattr(f.module, f.tables_attr).items():
        full_name, key = _weight_key(f, tname, sd)
        param = sub.weight
        if param.is_meta:
            raise InvalidArgumentError(f"TorchRec table {full_name!r} is on the meta device: shard it "
                                       f"with DistributedModelParallel (or materialize it) before saving or loading")
        n, d = (int(x) for x in param.shape)
        states = _in_backward_states(full_name, param)
        shard = Shard(0, n, 0, d, param.data, dict(states))
        opt_slots = {slot: (st.dtype, (d,) if slot == ADAGRAD else ()) for slot, st in states.items()}
        init = accumulator_init(param, _in_backward_optimizers(param))
        restart = step_restart(param, _in_backward_optimizers(param)) if opt_slots else None
        # An unsharded module holds every row in every process that has it: written once, loaded by all.
        tables.append(dict(name=full_name, num_rows=n, dim=d, dtype=param.dtype, shards=[shard],
                           opt_slots=opt_slots, opt_init={slot: init for slot in opt_slots}, opt_restart=restart,
                           replicated=True,
                           sharding="unsharded"))
        keys.append(key)
    return tables, keys


def _weight_key(f: Found, tname: str, sd: Dict[str, Any]) -> Tuple[str, str]:
    """(the table's name in the checkpoint, its weight's key in `sd`) of table `tname` of collection `f`."""
    rel = f"{f.tables_attr}.{tname}.weight"
    name = f.prefix + rel[:-len(".weight")]
    key = next((p + rel for p in f.raw_prefixes if p + rel in sd), None)
    if key is None:
        raise InvalidArgumentError(f"TorchRec table {name!r}: no state_dict entry {f.prefix + rel!r}")
    return name, key


def _table_names(f: Found) -> List[str]:
    """The names of collection `f`'s tables, in the order `find_tables` takes them."""
    return list(f.module.module_sharding_plan if f.sharded else getattr(f.module, f.tables_attr))


def table_keys(model, sd: Dict[str, Any], hooked_only: bool = False) -> List[str]:
    """The state_dict keys `find_tables` returns (each table's weight and MCH buffers), from the collections
    and `sd`'s keys alone: no table is built, no optimizer state read and no other rank asked.

    With `hooked_only`, only those TorchRec's load hooks read even under strict=False: a sharded
    EmbeddingCollection's weights (its pre-load hook indexes every table) and the managed-collision
    buffers. A sharded EmbeddingBagCollection's hook skips an absent weight and an unsharded collection
    is a plain module, so their weights are left out; TorchRec 1.8 cannot load a sharded EBC's own
    weight entry back when its column shards differ in width."""
    keys = []
    for f in collections(model):
        names = [_weight_key(f, tname, sd) for tname in _table_names(f)]
        if not hooked_only or (f.sharded and f.tables_attr == "embeddings"):
            keys += [key for _, key in names]
        if f.mc is not None:
            keys += _mch_keys(f, sd, [name for name, _ in names])
    return keys


def find_tables(model, sd: Dict[str, Any], objects: Sequence[Any] = ()) -> Tuple[List[Any], List[str], List[Found]]:
    """(tables, their state_dict keys, the collections found) of `model`, whose state_dict is `sd`. A
    table is a `TorchRecTable`, or an `MCHTable` (keyed by raw id) around one when a managed-collision
    module keys it; the keys include that module's buffers which the table stands for. `objects` (the
    registered objects) are searched for data-parallel tables' optimizer state (`dense_optim`)."""
    parts, keys, found = [], [], list(collections(model))
    opts = optimizers(objects)
    params = dict(model.named_parameters()) if any(f.sharded for f in found) else {}
    for f in found:
        t, k = (_sharded_tables if f.sharded else _unsharded_tables)(f, sd, params, opts)
        parts += t
        keys += k
        if f.mc is not None:
            keys += _mch_keys(f, sd, [p["name"] for p in t])
    # Ranks holding no shard of a table learn its optimizer slots from those that do (once per model).
    # The weight's dtype too: a DTensor state dict reports fp32 for an fp16 table on ranks without a shard.
    def schema(p):
        return {s: [str(dt).replace("torch.", ""), list(sh)]
                for s, (dt, sh) in {EMBEDDING: (p["dtype"], (p["dim"],)), **p["opt_slots"]}.items()}
    local = {p["name"]: schema(p) for p in parts if p["shards"]}
    agreed = agreed_slots(model, local, lambda: sharding_plan(found)) if found and any(f.sharded for f in found) \
        else local
    tables = []
    for p in parts:
        if not p["shards"] and p["name"] in agreed:
            got = {s: (getattr(torch, dt), tuple(sh)) for s, (dt, sh) in agreed[p["name"]].items()}
            p["dtype"] = got.pop(EMBEDDING)[0]
            p["opt_slots"] = got
        tables.append(TorchRecTable(**p))
    by_found = {id(f): f for f in found}
    owner = {}
    for f in found:
        for tname in _table_names(f):
            owner[f"{f.prefix}{f.tables_attr}.{tname}"] = (id(f), tname)
    out = []
    for t in tables:
        fid, tname = owner[t.name]
        f = by_found[fid]
        if f.mc is None:
            out.append(t)
            continue
        mod = _mch_module(f, tname)
        out.append(MCHTable(t, mod, writes=True if f.sharded else writes_unsharded()))
    return out, keys, found


def _mch_module(f: Found, tname: str):
    mods = getattr(f.mc, "_managed_collision_modules", None)
    if mods is None or tname not in mods:
        raise InvalidArgumentError(f"TorchRec table {f.prefix}{f.tables_attr}.{tname}: its managed-collision "
                                   f"collection has no module for it")
    mod = mods[tname]
    if type(mod).__name__ != "MCHManagedCollisionModule":
        raise InvalidArgumentError(
            f"TorchRec table {f.prefix}{f.tables_attr}.{tname}: its managed-collision module is a "
            f"{type(mod).__name__}; recckpt maps MCHManagedCollisionModule (MPZCH's HashZchManagedCollisionModule "
            f"does not train on CPU in torchrec 1.8); see docs/TORCHREC.md")
    return mod


def _mch_keys(f: Found, sd: Dict[str, Any], names: List[str]) -> List[str]:
    """The state_dict keys of the MCH buffers that the tables' raw ids and slots stand for (and the
    plan-derived output segments, never loaded from a checkpoint of another plan)."""
    out = []
    for name in names:
        tname = name.rpartition(".")[2]
        for buf in persistent_buffers(_mch_module(f, tname)):
            rel = f"_managed_collision_modules.{tname}.{buf}"
            out += [p + rel for p in f.mc_prefixes if p + rel in sd][:1]
    return out


def moved_params(model, objects: Sequence[Any]) -> Dict[int, str]:
    """{id of a data-parallel table's parameter, or of a sharded table's on the "dense" kernel, whose state,
    kept by one of `objects`, is saved as the table's slots (`dense_optim`): the table's name}."""
    return {k: table for k, (table, _) in _moved(model, objects).items()}


def per_rank_params(model, objects: Sequence[Any]) -> set:
    """The ids among `moved_params` of parameters each rank holds its own shard of (the "dense" kernel):
    their state in an optimizer's own saved state would be rank 0's shard alone."""
    return {k for k, (_, per_rank) in _moved(model, objects).items() if per_rank}


def _moved(model, objects: Sequence[Any]) -> Dict[int, Tuple[str, bool]]:
    opts = optimizers(objects)
    if not opts:
        return {}
    params = dict(model.named_parameters())
    out = {}
    for f in collections(model):
        if not f.sharded:
            continue
        for tname, ps in f.module.module_sharding_plan.items():
            per_rank = _on_dense_kernel(ps)
            if ps.sharding_type != "data_parallel" and not per_rank:
                continue
            rel = f"{f.tables_attr}.{tname}.weight"
            key = next((p + rel for p in f.raw_prefixes if p + rel in params), None)
            if key is not None and holds_accumulator(params[key], opts):
                out[id(params[key])] = (f.prefix + rel[:-len(".weight")], per_rank)
    return out


def table_param_names(model) -> set:
    """Every name under which a TorchRec table's weight may appear as a parameter of `model` (raw and
    normalized), sharded or not: what a dense optimizer may have saved state under."""
    out = set()
    for f in collections(model):
        tables = f.module.module_sharding_plan if f.sharded else getattr(f.module, f.tables_attr)
        for tname in tables:
            out |= {f"{p}{f.tables_attr}.{tname}.weight" for p in f.raw_prefixes}
    return out
