"""Worker for the TorchRec tests: `python torchrec_child.py SPEC.json`.

SPEC: {"world": W, "port": P, "jobs": [...]}. With W > 1 it spawns W processes on gloo (with a timeout);
W == 1 runs one process with no process group. Every rank runs every job in order (one process pays
TorchRec's import once for several cases), then writes `<out>/done_<rank>.json`. A job:
  {"kind": "ebc"|"ec", "plan": {table: "tw"|"rw"|"cw"|"cw001"|"cw412"|"cw010"|"dp"|"twrw"|"rwdense"} or "unsharded" or
   "default",
   "opt": "adagrad"|"rowwise"|"sgd", "tables": [[name, rows, dim, dtype], ...], "train_steps": k,
   "save": dir or null, "load": dir or null, "load_conf": {...} or null, "dump": dir or null,
   "dtensor": bool, "expect_error": true or null, "dump_before": dir or null,
   "dense_opt": "keyed" (KeyedOptimizer, default) or "torch" (torch.optim), "kind" may also be "mch",
   "opt_kwargs": {...} more arguments of the tables' optimizer (e.g. initial_accumulator_value),
   "dense_kwargs": {...} more arguments of the dense optimizer (e.g. lr_decay),
   "train_after": k steps trained after the load and save (batches drawn from "after_seed", default 7),
   before the dump, "async_save": the save written from a snapshot in host buffers, as an async save's,
   "increments": k steps after the load, each followed by an incremental save into the loaded directory,
   "plan_by_rank": [plan of rank 0, plan of rank 1, ...] in place of "plan"}
Each rank's result also holds "dense": the unwrapped model's dense layer's parameters after the job.
`dump` gets `<dump>/rank<r>.pt`: per table, the live local shards read straight from TorchRec's own
state (state_dict + fused optimizer state, or the in-backward optimizer when unsharded), independent of
recckpt's adapter, so the test compares what TorchRec holds.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import warnings

# The checkout this file belongs to, ahead of any installed recckpt.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _build(job, world, rank):
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.types import DataType

    dtypes = {"fp32": DataType.FP32, "fp16": DataType.FP16}
    sharded = job["plan"] != "unsharded"
    dev = torch.device("meta") if sharded else torch.device("cpu")
    torch.manual_seed(1234)
    if job["kind"] == "mch":
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import (
            LFU_EvictionPolicy,
            LRU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )
        cfgs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                   data_type=dtypes[dt]) for n, r, d, dt in job["tables"]]
        policy = {"lfu": LFU_EvictionPolicy, "lru": LRU_EvictionPolicy}[job.get("policy", "lfu")]
        mcc = ManagedCollisionCollection(
            {n: MCHManagedCollisionModule(zch_size=r, device=dev, eviction_policy=policy(), eviction_interval=1,
                                          input_hash_size=job["mch_input"]) for n, r, *_ in job["tables"]}, cfgs)
        inner = EmbeddingBagCollection(tables=cfgs, device=dev)
        coll = ManagedCollisionEmbeddingBagCollection(inner, mcc, return_remapped_features=False)
    elif job["kind"] == "ebc":
        cfgs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                   data_type=dtypes[dt]) for n, r, d, dt in job["tables"]]
        coll = EmbeddingBagCollection(tables=cfgs, device=dev)
    else:
        cfgs = [EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                data_type=dtypes[dt]) for n, r, d, dt in job["tables"]]
        coll = EmbeddingCollection(tables=cfgs, device=dev)
    opt_cls = {"adagrad": torch.optim.Adagrad, "rowwise": RowWiseAdagrad, "sgd": torch.optim.SGD}[job["opt"]]
    # data-parallel tables and tables on TorchRec's "dense" kernel get no in-backward optimizer: the dense
    # optimizer steps them
    dp_tables = {t for t, p in (job["plan"].items() if isinstance(job["plan"], dict) else []) if p in ("dp",) + DENSE_KERNEL}
    if job.get("unsharded_dense_opt"):   # an unsharded module whose tables the dense optimizer steps
        dp_tables = {t[0] for t in job["tables"]}
    fused = [p for n, p in coll.named_parameters() if n.split(".")[-2] not in dp_tables]
    apply_optimizer_in_backward(opt_cls, fused, {"lr": 0.05, **job.get("opt_kwargs", {})})

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.coll = coll
            self.dense = torch.nn.Linear(4, 1)

        def forward(self, kjt):
            from torchrec.sparse.jagged_tensor import KeyedTensor
            out = self.coll(kjt)
            if isinstance(out, tuple):                # a managed-collision EBC: (pooled, remapped)
                out = out[0]
            if callable(getattr(out, "wait", None)):   # a sharded EC's output is awaitable
                out = out.wait()
            if isinstance(out, KeyedTensor):        # EBC: pooled
                vals = out.values()
            else:                                   # EC: feature -> JaggedTensor
                def flat(x):
                    return (x if isinstance(x, torch.Tensor) else x.values()).reshape(-1)
                vals = torch.cat([flat(out[k]) for k in out.keys()])
            return vals.float().pow(2).sum() + self.dense(torch.ones(1, 4)).sum()

    model = Model()
    if not sharded:
        return model, model, _dense_opt(model, opt_cls, job.get("dense_opt", "keyed"), job.get("dense_kwargs"),
                                 job.get("dense_cls"), job.get("dense_opt_tables_only"))
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    pg = dist.GroupMember.WORLD
    env = ShardingEnv(world, rank, pg, output_dtensor=bool(job.get("dtensor")))
    if job["plan"] == "default":
        plan = None
    else:
        gens = {"tw": lambda i: table_wise(rank=i % world), "rw": lambda i: row_wise(),
                "cw": lambda i: column_wise(ranks=list(range(world))), "dp": lambda i: data_parallel(),
                # two adjacent column shards on rank 0, one on rank 1 (each its own column block)
                "cw001": lambda i: column_wise(ranks=[0, 0, 1]),
                # column shards of uneven width (a 16-wide table on 2 ranks)
                "cw412": lambda i: column_wise(size_per_rank=[4, 12]),
                # rank 0 holds two column shards that are not adjacent (as TorchRec's planner places them)
                "cw010": lambda i: column_wise(ranks=[0, 1, 0]),
                "twrw": lambda i: table_row_wise(host_index=0),
                # row-wise on the "dense" compute kernel: an ordinary parameter the dense optimizer steps
                "rwdense": lambda i: row_wise(compute_kernel="dense"),
                "twdense": lambda i: table_wise(rank=(i + 1) % world, compute_kernel="dense"),
                "cwdense": lambda i: column_wise(ranks=list(range(world)), compute_kernel="dense")}
        per = {n: gens[job["plan"][n]](i) for i, (n, *_rest) in enumerate(job["tables"])}
        plan = ShardingPlan({"coll": construct_module_sharding_plan(coll, per, world_size=world, local_size=world,
                                                                    device_type="cpu")})
    sharders = None
    if job["kind"] == "mch":
        from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
        sharders = [ManagedCollisionEmbeddingBagCollectionSharder()]
        if plan is not None:
            per = {n: row_wise() for n, *_rest in job["tables"]}
            plan = ShardingPlan({"coll": construct_module_sharding_plan(coll, per, world_size=world, local_size=world,
                                                                        device_type="cpu", sharder=sharders[0])})
    dmp = DistributedModelParallel(model, env=env, plan=plan, device=torch.device("cpu"), sharders=sharders)
    return dmp, model, _dense_opt(dmp, opt_cls, job.get("dense_opt", "keyed"), job.get("dense_kwargs"),
                                       job.get("dense_cls"), job.get("dense_opt_tables_only"))


#: plans on TorchRec's "dense" compute kernel: the dense optimizer steps those tables
DENSE_KERNEL = ("rwdense", "twdense", "cwdense")


def _dense_opt(model, opt_cls, kind="keyed", kwargs=None, cls=None, tables_only=False):
    """The user's dense optimizer, a KeyedOptimizer keyed by parameter name over every parameter without
    an in-backward optimizer: the dense arch and data-parallel tables (registered as "dense_opt"); Adagrad
    (SGD in SGD jobs)."""
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    dense_cls = torch.optim.SGD if opt_cls is torch.optim.SGD else torch.optim.Adagrad   # RowWiseAdagrad wants 2-D
    if cls is not None:   # "dense_cls": another dense optimizer (Adam: state recckpt does not map)
        dense_cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[cls]
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    if tables_only:   # "dense_opt_tables_only": an optimizer of the tables alone (the dense arch not stepped)
        params = {n: p for n, p in params.items() if ".embedding_bags." in n}
    kwargs = {"lr": 0.05, **(kwargs or {})}
    if kind == "torch":     # a plain torch.optim optimizer (numbered state)
        return dense_cls(list(params.values()), **kwargs)
    opt = KeyedOptimizerWrapper(params, lambda ps: dense_cls(ps, **kwargs))
    if kind == "keyed_groups":   # a KeyedOptimizer that saves its param groups (names, hyper-parameters)
        opt.save_param_groups(True)
    return opt


def _train(job, model, dense_opt, rank, steps=None, seed=99):
    import torch
    from torchrec import KeyedJaggedTensor
    names = [t[0] for t in job["tables"]]
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(job.get("train_steps", 0) if steps is None else steps):
        vals, lens = [], []
        for n, r, *_ in job["tables"]:
            # "mch_batch": that many ids a step (2 bags), to admit many raw ids in few steps
            b = job.get("mch_batch")
            k = torch.tensor([b // 2, b - b // 2]) if b else torch.randint(1, 4, (2,), generator=g)
            lens.append(k)
            vals.append(torch.randint(0, job.get("mch_input", r), (int(k.sum()),), generator=g))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in names], values=torch.cat(vals),
                                                  lengths=torch.cat(lens))
        model(kjt).backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()


def _dump(model, dense_opt, path, rank):
    """Local shards straight from TorchRec: {table: [(row0, col0, weight, {state: tensor})]}."""
    import torch
    os.makedirs(path, exist_ok=True)
    out = {}
    sd = model.state_dict()
    fused = {}
    fo = getattr(model, "fused_optimizer", None)
    if fo is not None:
        for key, st in fo.state_dict()["state"].items():
            fused[key] = st

    def local(t):
        if hasattr(t, "local_shards") and hasattr(t, "metadata"):
            return [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in t.local_shards()]
        if hasattr(t, "to_local"):
            loc = t.to_local()
            return [(list(o), s.clone()) for o, s in zip(loc.local_offsets(), loc.local_shards())]
        return [([0] * t.dim(), t.detach().clone())]

    params = dict(model.named_parameters())
    for key, w in sd.items():
        if not key.endswith(".weight") or ("embedding_bags." not in key and "embeddings." not in key):
            continue
        table = key[:-len(".weight")]
        if rank != 0 and not hasattr(w, "local_shards") and not hasattr(w, "to_local"):
            continue   # a replicated (data-parallel) table: rank 0's copy stands for all
        states = {}
        for skey, st in fused.get(key, {}).items():
            states[skey.rpartition(".")[2]] = local(st)
        if not hasattr(w, "local_shards") and not hasattr(w, "to_local") and key not in fused:
            # unsharded or data-parallel: the parameter's in-backward optimizer, if any
            param = params.get(key)
            for o in getattr(param, "_in_backward_optimizers", []):
                for k, v in o.state.get(param, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        states[k] = [([0] * v.dim(), v.clone())]
        sharded = hasattr(w, "local_shards") or hasattr(w, "to_local")
        if dense_opt is not None and not sharded:
            by_name = {n: dense_opt.state.get(p, {}) for n, p in model.named_parameters()}
            for k, st in by_name.get(key, {}).items():
                if isinstance(st, torch.Tensor) and st.dim() > 0:
                    states[k] = [([0] * st.dim(), st.clone())]
        elif dense_opt is not None and key in params and params[key].dim() == 2:
            # a table on the "dense" kernel: this rank's parameter is its shards stacked by rows, and the
            # dense optimizer's state is shaped like it; each shard's state is its block of rows
            param = params[key]
            for k, st in dense_opt.state.get(param, {}).items():
                if not isinstance(st, torch.Tensor) or st.numel() < param.shape[0]:
                    continue
                if hasattr(w, "local_shards"):
                    pieces = [(list(s.metadata.shard_offsets), s.tensor) for s in w.local_shards()]
                else:   # DTensor
                    loc = w.to_local()
                    pieces = [(list(o), t) for o, t in zip(loc.local_offsets(), loc.local_shards())]
                for off, t in pieces:
                    r0 = (t.storage_offset() - param.storage_offset()) // param.shape[1]
                    block = st.reshape(param.shape[0], -1)[r0:r0 + t.shape[0]]
                    states.setdefault(k, []).append((off, block.clone()))
        out[table] = {"weight": local(w), "states": states, "shape": list(w.shape)}
    out.update(_dump_mch(model, sd, fused))
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))


def _dump_mch(model, sd, fused):
    """Managed-collision tables, keyed by raw id: {"mch:<table>": {"ids", "weight", "states", "meta"}} with
    this process's admitted raw ids and, for each, its row of the weight, of each optimizer state and its
    eviction metadata, read from TorchRec's own state."""
    import torch
    out = {}
    for mname, mod in model.named_modules():
        if type(mod).__name__ != "MCHManagedCollisionModule":
            continue
        table = mname.rpartition(".")[2]
        wkey = next(k for k in sd if k.endswith(f"_embedding_module.embedding_bags.{table}.weight"))
        prefix = wkey[:-len(f"._embedding_module.embedding_bags.{table}.weight")]
        w = sd[wkey]
        if hasattr(w, "local_shards"):
            shard = w.local_shards()[0]
            row0, wt = shard.metadata.shard_offsets[0], shard.tensor
        else:
            row0, wt = 0, w
        states = {}
        for skey, st in fused.get(wkey, {}).items():
            states[skey.rpartition(".")[2]] = st.local_shards()[0].tensor if hasattr(st, "local_shards") else st
        if not fused:
            for o in getattr(getattr(model, "coll")._embedding_module.embedding_bags[table].weight,
                             "_in_backward_optimizers", []):
                for k, v in o.state.get(getattr(model, "coll")._embedding_module.embedding_bags[table].weight, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        states[k] = v
        raw = mod._mch_sorted_raw_ids
        keep = raw != torch.iinfo(torch.int64).max
        rows = mod._mch_remapped_ids_mapping[keep] - row0
        meta = {n: getattr(mod, "_mch_" + n)[keep].clone() for n in ("counts", "last_access_iter")
                if hasattr(mod, "_mch_" + n)}
        out[f"mch:{prefix}._embedding_module.embedding_bags.{table}"] = {
            "ids": raw[keep].clone(), "weight": wt[rows].clone(),
            "states": {k: v.reshape(v.shape[0], -1)[rows].clone() for k, v in states.items()}, "meta": meta,
            "capacity": int(mod._zch_size) - 1}
    return out


def _share_bytes(model, dense_opt):
    """(bytes of the TorchRec tables' state this process holds: its shards of every weight and of the
    optimizer state kept for it (fused, in-backward or dense), the same with every column of the rows it
    holds), read from TorchRec's own state: what a load bounded by the shard may read, + slack."""
    import torch
    sd = model.state_dict()
    fo = getattr(model, "fused_optimizer", None)
    fused = fo.state_dict()["state"] if fo is not None else {}
    params = dict(model.named_parameters())

    def pieces(t):
        if hasattr(t, "local_shards") and hasattr(t, "metadata"):
            return [s.tensor for s in t.local_shards()], list(t.shape)
        if hasattr(t, "to_local"):
            return list(t.to_local().local_shards()), list(t.shape)
        return [t], list(t.shape)

    share = rows_share = 0
    for key, w in sd.items():
        if not key.endswith(".weight") or ("embedding_bags." not in key and "embeddings." not in key):
            continue
        ws, shape = pieces(w)
        states = [v for v in fused.get(key, {}).values() if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")]
        sts = [p for st in states for p in pieces(st)[0]]
        if not hasattr(w, "local_shards") and not hasattr(w, "to_local"):
            param = params.get(key)
            opts = list(getattr(param, "_in_backward_optimizers", [])) + ([dense_opt] if dense_opt is not None else [])
            for o in opts:
                st = o.state.get(param, {}) if param is not None else {}
                sts += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        elif dense_opt is not None and key in params:   # the "dense" kernel: the state of this rank's shards
            sts += [v for v in dense_opt.state.get(params[key], {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        here = sum(t.numel() * t.element_size() for t in ws + sts)
        share += here
        cols = sum(t.shape[1] for t in ws[:1]) if ws and ws[0].dim() == 2 else shape[1]
        rows_share += here * shape[1] // max(cols, 1) if ws and ws[0].numel() else 0
    return share, rows_share


def _rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_growth(fn):
    """Peak RSS growth (VmHWM over the RSS before) while `fn` runs."""
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset the peak RSS (VmHWM) to the current RSS
    base = _rss("VmRSS")
    fn()
    return _rss("VmHWM") - base


def _rss_job(job, model, rank):
    """Save, then load, the model with small configured buffers; report each one's peak RSS growth and
    the bound (segment + in-flight + staging bytes + read batch bytes), and the bytes of this rank's
    table shards (weights and optimizer state), which a whole copy would add."""
    import recckpt
    from recckpt import SaveOptions
    from recckpt.format.sparse_io import ReadOptions
    o = job["rss"]
    opts = SaveOptions(segment_bytes=o["segment_bytes"], max_inflight_bytes=o["inflight_bytes"],
                       staging_bytes=o["staging_bytes"], fsync=False)
    ro = ReadOptions(batch_bytes=o["batch_bytes"])
    saver = recckpt.Saver(model, output_dir=job["save"], options=opts, read_options=ro)
    local = 0
    for v in model.state_dict().values():
        if hasattr(v, "local_shards"):
            local += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
    local *= 2   # Adagrad keeps one value per weight element
    save = _peak_growth(lambda: saver.save("ckpt_1"))
    load = _peak_growth(lambda: saver.load())
    return {"rss_save": save, "rss_load": load, "shard_bytes": local,
            "bound": o["segment_bytes"] + o["inflight_bytes"] + o["staging_bytes"] + o["batch_bytes"]}


def _run_jobs(rank, world, spec):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    import recckpt
    results = []
    for job in spec["jobs"]:
        if "plan_by_rank" in job:   # a rank built with another plan than the others (a user's mistake)
            job = {**job, "plan": job["plan_by_rank"][rank]}
        model, inner, dense_opt = _build(job, world, rank)
        _train(job, model, dense_opt, rank)
        try:
            res = {"name": job.get("name"), "table_keys": _table_keys(model, dense_opt)}
        except Exception:  # noqa: BLE001 - a job expecting an error may hold a plan find_tables refuses
            if not job.get("expect_error"):
                raise
            res = {"name": job.get("name"), "table_keys": None}
        if job.get("dump_before"):
            _dump(model, dense_opt, job["dump_before"], rank)
        if job.get("rss"):
            res.update(_rss_job(job, model, rank))
            results.append(res)
            if world > 1:
                dist.barrier()
            continue
        try:
            if job.get("load"):
                saver = recckpt.Saver(model, output_dir=job["load"])
                if dense_opt is not None:
                    saver.register_for_checkpointing("dense_opt", dense_opt)
                r = saver.load(load_conf=job.get("load_conf"))
                for i in range(job.get("increments", 0)):   # a step, then an increment on what was loaded
                    _train(job, model, dense_opt, rank, 1, 100 + i)
                    saver.save(f"inc_{i}", incremental=True)
                res["loaded_tables"] = sorted(r.tables)
                res["rows"] = r.sparse_rows
                res["admission"] = r.admission
                res["bytes_read"] = r.bytes_read
                res["share_bytes"], res["row_share_bytes"] = _share_bytes(model, dense_opt)
            if job.get("save"):
                saver = recckpt.Saver(model, output_dir=job["save"])
                if dense_opt is not None:
                    saver.register_for_checkpointing("dense_opt", dense_opt)
                if job.get("async_save"):   # the snapshot an async save writes, copied into host buffers
                    from recckpt.train.snapshot import HostBuffers
                    snap = saver.capture_copy(HostBuffers(), shard_id=rank)
                    saver.write("ckpt_1", snap)
                else:
                    saver.save("ckpt_1")
            if job.get("expect_error"):
                res["error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test, which checks the message
            if not job.get("expect_error"):
                raise
            res["error"] = f"{type(e).__name__}: {e}"
        if job.get("train_after"):
            _train(job, model, dense_opt, rank, job["train_after"], job.get("after_seed", 7))
        if dense_opt is not None:   # 0-dim state (Adagrad's step) is not in the dump
            res["dense_steps"] = {n: float(dense_opt.state[p]["step"]) for n, p in model.named_parameters()
                                  if "step" in dense_opt.state.get(p, {})}
        res["dense"] = {n: p.detach().tolist() for n, p in inner.dense.named_parameters()}
        if job.get("dump"):
            _dump(model, dense_opt, job["dump"], rank)
        results.append(res)
        if world > 1:
            dist.barrier()
    with open(os.path.join(spec["out"], f"done_{rank}.json"), "w") as f:
        json.dump(results, f)
    if world > 1:
        dist.destroy_process_group()


def _table_keys(model, dense_opt):
    """[whether the table keys a load finds from the plan alone (`table_keys`) are those `find_tables`
    returns, how many]: dense_load_dict relies on them being the same."""
    from recckpt.integrations.torchrec import discover
    sd = model.state_dict()
    keys = discover.find_tables(model, sd, [dense_opt] if dense_opt is not None else [])[1]
    return [discover.table_keys(model, sd) == keys, len(keys)]


def _entry(rank, world, spec):
    try:
        _run_jobs(rank, world, spec)
    except BaseException:
        with open(os.path.join(spec["out"], f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def main():
    spec = json.load(open(sys.argv[1]))
    world = spec["world"]
    if world == 1:
        _entry(0, 1, spec)
        return
    # not torch.multiprocessing.spawn: this launcher never imports torch (see rank_procs.py)
    from rank_procs import spawn
    spawn(_entry, (world, spec), world)


if __name__ == "__main__":
    main()
