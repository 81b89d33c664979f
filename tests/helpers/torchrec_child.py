"""Worker for the TorchRec tests: `python torchrec_child.py SPEC.json`.

SPEC: {"world": W, "port": P, "jobs": [...]}. With W > 1 it spawns W processes on gloo (with a timeout);
W == 1 runs one process with no process group. Every rank runs every job in order (one process pays
TorchRec's import once for several cases), then writes `<out>/done_<rank>.json`. A job:
  {"kind": "ebc"|"ec", "plan": {table: "tw"|"rw"|"cw"|"dp"|"twrw"} or "unsharded" or "default",
   "opt": "adagrad"|"rowwise"|"sgd", "tables": [[name, rows, dim, dtype], ...], "train_steps": k,
   "save": dir or null, "load": dir or null, "load_conf": {...} or null, "dump": dir or null,
   "dtensor": bool, "expect_error": true or null, "dump_before": dir or null}
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
    if job["kind"] == "ebc":
        cfgs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                   data_type=dtypes[dt]) for n, r, d, dt in job["tables"]]
        coll = EmbeddingBagCollection(tables=cfgs, device=dev)
    else:
        cfgs = [EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"],
                                data_type=dtypes[dt]) for n, r, d, dt in job["tables"]]
        coll = EmbeddingCollection(tables=cfgs, device=dev)
    opt_cls = {"adagrad": torch.optim.Adagrad, "rowwise": RowWiseAdagrad, "sgd": torch.optim.SGD}[job["opt"]]
    dp_tables = {t for t, p in (job["plan"].items() if isinstance(job["plan"], dict) else []) if p == "dp"}
    fused = [p for n, p in coll.named_parameters() if n.split(".")[-2] not in dp_tables]
    apply_optimizer_in_backward(opt_cls, fused, {"lr": 0.05})

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.coll = coll
            self.dense = torch.nn.Linear(4, 1)

        def forward(self, kjt):
            from torchrec.sparse.jagged_tensor import KeyedTensor
            out = self.coll(kjt)
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
        return model, model, None
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
                "twrw": lambda i: table_row_wise(host_index=0)}
        per = {n: gens[job["plan"][n]](i) for i, (n, *_rest) in enumerate(job["tables"])}
        plan = ShardingPlan({"coll": construct_module_sharding_plan(coll, per, world_size=world, local_size=world,
                                                                    device_type="cpu")})
    dmp = DistributedModelParallel(model, env=env, plan=plan, device=torch.device("cpu"))
    dense_opt = None
    if dp_tables:
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                          lambda params: opt_cls(params, lr=0.05))
    return dmp, model, dense_opt


def _train(job, model, dense_opt, rank):
    import torch
    from torchrec import KeyedJaggedTensor
    names = [t[0] for t in job["tables"]]
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(job.get("train_steps", 0)):
        vals, lens = [], []
        for n, r, *_ in job["tables"]:
            k = torch.randint(1, 4, (2,), generator=g)
            lens.append(k)
            vals.append(torch.randint(0, r, (int(k.sum()),), generator=g))
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

    for key, w in sd.items():
        if not key.endswith(".weight") or ("embedding_bags." not in key and "embeddings." not in key):
            continue
        table = key[:-len(".weight")]
        if rank != 0 and not hasattr(w, "local_shards") and not hasattr(w, "to_local"):
            continue   # a replicated (data-parallel) table: rank 0's copy stands for all
        states = {}
        for skey, st in fused.get(key, {}).items():
            states[skey.rpartition(".")[2]] = local(st)
        if not fused and not hasattr(w, "local_shards"):   # unsharded: the in-backward optimizer
            mod = model
            for part in table.split("."):
                mod = getattr(mod, part) if not part.isdigit() else mod[int(part)]
            for o in getattr(mod.weight, "_in_backward_optimizers", []):
                for k, v in o.state.get(mod.weight, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        states[k] = [([0] * v.dim(), v.clone())]
        if dense_opt is not None and not hasattr(w, "local_shards"):
            for k, st in dense_opt.state_dict()["state"].get(key, {}).items():
                if isinstance(st, torch.Tensor) and st.dim() > 0:
                    states[k] = [([0] * st.dim(), st.clone())]
        out[table] = {"weight": local(w), "states": states, "shape": list(w.shape)}
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))


def _run_jobs(rank, world, spec):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    import recckpt
    results = []
    for job in spec["jobs"]:
        model, inner, dense_opt = _build(job, world, rank)
        _train(job, model, dense_opt, rank)
        res = {"name": job.get("name")}
        if job.get("dump_before"):
            _dump(model, dense_opt, job["dump_before"], rank)
        try:
            if job.get("load"):
                saver = recckpt.Saver(model, output_dir=job["load"])
                if dense_opt is not None:
                    saver.register_for_checkpointing("dense_opt", dense_opt)
                r = saver.load(load_conf=job.get("load_conf"))
                res["loaded_tables"] = sorted(r.tables)
                res["rows"] = r.sparse_rows
            if job.get("save"):
                saver = recckpt.Saver(model, output_dir=job["save"])
                if dense_opt is not None:
                    saver.register_for_checkpointing("dense_opt", dense_opt)
                saver.save("ckpt_1")
            if job.get("expect_error"):
                res["error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test, which checks the message
            if not job.get("expect_error"):
                raise
            res["error"] = f"{type(e).__name__}: {e}"
        if job.get("dump"):
            _dump(model, dense_opt, job["dump"], rank)
        results.append(res)
        if world > 1:
            dist.barrier()
    with open(os.path.join(spec["out"], f"done_{rank}.json"), "w") as f:
        json.dump(results, f)
    if world > 1:
        dist.destroy_process_group()


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
    import torch.multiprocessing as mp
    mp.spawn(_entry, args=(world, spec), nprocs=world)


if __name__ == "__main__":
    main()
