"""Worker for the TorchRec incremental-chain tests: `python torchrec_loop_child.py SPEC.json`.

SPEC: {"world": W, "port": P, "out": dir, "phase": "train" | "load", "jobs": [...]}; spawns W gloo ranks
(W == 1: one process, no group). A job: {"name", "plan": {table: tw|rw|cw|twrw|dp|rwdense}, "opt": adagrad|rowwise,
"tables": [[name, rows, dim]], "dir": checkpoint output dir, "dump": dir}.
- train: build, train 3 steps, full save c0; 2 steps, incremental c1 (sync); 2 steps, incremental c2
  through an async-style snapshot (capture_copy into host buffers, then write); dump the live state (the
  model trained without interruption); rank 0 compacts c2 into c2_full. Every rank can recompute every
  rank's batches, so `done_<rank>.json` records, per increment, the distinct rows each table was fed.
- load: for each job and each of c2 (the chain) and c2_full (compacted) build a fresh model under the
  job's plan, load, dump to `<dump>_<ckpt>`.
Dumps hold TorchRec's own state (state_dict and fused optimizer state), read without recckpt.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BATCH = 4


def _build(job, world, rank):
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
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
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(5)
    coll = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r,
                                                             feature_names=[f"f_{n}"]) for n, r, d in job["tables"]],
                                  device=torch.device("meta"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.coll = coll

        def forward(self, kjt):
            return self.coll(kjt).values().pow(2).sum()

    model = Model()
    opt = {"adagrad": torch.optim.Adagrad, "rowwise": RowWiseAdagrad}[job["opt"]]
    # a data-parallel table has no fused optimizer (and is not trained here: it only has to round-trip)
    dp = {t for t, p in job["plan"].items() if p in ("dp", "rwdense")}   # (rwdense: the "dense" kernel)
    apply_optimizer_in_backward(opt, [p for n, p in coll.named_parameters() if n.split(".")[-2] not in dp],
                                {"lr": 0.05})
    gens = {"tw": lambda i: table_wise(rank=i % world), "rw": lambda i: row_wise(), "dp": lambda i: data_parallel(),
            "cw": lambda i: column_wise(ranks=list(range(world))), "twrw": lambda i: table_row_wise(host_index=0),
            "rwdense": lambda i: row_wise(compute_kernel="dense")}
    per = {n: gens[job["plan"][n]](i) for i, (n, *_r) in enumerate(job["tables"])}
    plan = ShardingPlan({"coll": construct_module_sharding_plan(coll, per, world_size=world, local_size=world,
                                                                device_type="cpu")})
    torch.manual_seed(100 + rank)
    return DistributedModelParallel(model, env=ShardingEnv(world, rank, dist.GroupMember.WORLD), plan=plan,
                                    device=torch.device("cpu"))


def _batch(job, step, rank):
    """Rank `rank`'s batch of `step`: ids of a narrow window of each table (few rows change per step)."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    lens, vals = [], []
    for n, r, _ in job["tables"]:
        k = torch.randint(1, 3, (BATCH,), generator=g)
        lens.append(k)
        lo = int(torch.randint(0, r - 4, (1,), generator=g))
        vals.append(torch.randint(lo, lo + 4, (int(k.sum()),), generator=g))
    return lens, vals


def _train(job, model, steps, world, rank, fed):
    import torch
    from torchrec import KeyedJaggedTensor
    for step in steps:
        lens, vals = _batch(job, step, rank)
        for r in range(world):   # every rank's ids, to know which rows the increment must hold
            _, v = _batch(job, step, r)
            for (n, *_x), ids in zip(job["tables"], v):
                fed.setdefault(n, set()).update(int(i) for i in ids)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n, *_ in job["tables"]],
                                                  values=torch.cat(vals), lengths=torch.cat(lens))
        model(kjt).backward()


def _dump(model, path, rank):
    import torch
    os.makedirs(path, exist_ok=True)
    fused = model.fused_optimizer.state_dict()["state"]
    out = {}
    for key, w in model.state_dict().items():
        if ".embedding_bags." not in key or not key.endswith(".weight"):
            continue
        if not hasattr(w, "local_shards"):    # a data-parallel table: every rank holds it; rank 0 stands for all
            if rank == 0:
                out[key[:-len(".weight")]] = {"weight": [([0, 0], w.detach().clone())], "states": {},
                                              "shape": list(w.shape)}
            continue
        local = lambda t: [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in t.local_shards()]  # noqa: E731
        states = {k.rpartition(".")[2]: local(st) for k, st in fused.get(key, {}).items()}
        out[key[:-len(".weight")]] = {"weight": local(w), "states": states, "shape": list(w.shape)}
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))


def _stats(saver) -> dict:
    """What the last save wrote (rank 0 commits, and only it knows)."""
    st = saver.last_save
    return {"rows": st.sparse_rows, "parent": st.parent, "full_reason": st.full_reason} if st else {}


def _run(rank, world, spec):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    import recckpt
    from recckpt.train.snapshot import HostBuffers
    results = {}
    for job in spec["jobs"]:
        res = results[job["name"]] = {}
        if spec["phase"] == "train":
            model = _build(job, world, rank)
            saver = recckpt.Saver(model, output_dir=job["dir"], max_keep=None)
            fed: dict = {}
            _train(job, model, range(0, 3), world, rank, fed)
            saver.save("c0")
            fed.clear()
            _train(job, model, range(3, 5), world, rank, fed)
            saver.save("c1", incremental=True)
            res["c1"] = {"fed": {n: len(s) for n, s in fed.items()}, **_stats(saver)}
            fed.clear()
            _train(job, model, range(5, 7), world, rank, fed)
            snap = saver.capture_copy(HostBuffers(), rank, incremental=True)
            _dump(model, f"{job['dump']}_trained", rank)         # the model trained without interruption
            _train(job, model, range(7, 8), world, rank, {})   # training goes on while the snapshot is written
            saver.write("c2", snap, incremental=True)
            res["c2"] = {"fed": {n: len(s) for n, s in fed.items()}, **_stats(saver)}
            dist.barrier()
            if rank == 0:
                recckpt.compact(os.path.join(job["dir"], "c2"), os.path.join(job["dir"], "c2_full"))
            dist.barrier()
        else:
            for ck in ("c2", "c2_full"):
                model = _build(job, world, rank)
                saver = recckpt.Saver(model, output_dir=job["dir"], max_keep=None)
                r = saver.load(ckpt_id=ck)
                res[ck] = {"rows": r.sparse_rows}
                _dump(model, f"{job['dump']}_{ck}", rank)
        dist.barrier()
    with open(os.path.join(spec["out"], f"done_{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _entry(rank, world, spec):
    try:
        _run(rank, world, spec)
    except BaseException:
        with open(os.path.join(spec["out"], f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def main():
    spec = json.load(open(sys.argv[1]))
    # not torch.multiprocessing.spawn: this launcher never imports torch (see rank_procs.py)
    from rank_procs import spawn
    spawn(_entry, (spec["world"], spec), spec["world"])


if __name__ == "__main__":
    main()
