"""A TorchRec DLRM trained with recckpt's CheckpointManager under torchrun: the design card's loop on a
DistributedModelParallel model.

    torchrun --nproc_per_node=2 examples/torchrec_dlrm.py --out /tmp/dlrm --steps 30 --plan tw --async
    torchrun --nproc_per_node=3 examples/torchrec_dlrm.py --out /tmp/dlrm --steps 50 --plan rw --async

(scripts/torchrec_example.sh trains on 2 workers, SIGKILLs the job, resumes on 2 with every loss equal
to an uninterrupted run's, then resumes on 3 workers under a row-wise plan and checks the restored
tables.) The embedding tables train with a fused RowWiseAdagrad inside TorchRec's kernels; the dense
part (DLRM's bottom, interaction and top MLPs, replicated by DMP's data-parallel wrapper) with Adam in
TorchRec's KeyedOptimizerWrapper, registered with the manager. recckpt needs no TorchRec-specific call:
`Saver(dmp_model, ...)` finds the tables and their fused optimizer state, and `restore()` loads them
(the dense optimizer too, before its first step) under whatever plan and world size
the job now runs with.
"""
from __future__ import annotations

import argparse
import os
import signal
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from recckpt import CheckpointManager, SaveOptions, Saver

warnings.filterwarnings("ignore", category=DeprecationWarning)

# (name, rows): four tables, dim 8 (DLRM wants every table's dim = the bottom MLP's output)
TABLES = [("user", 2000), ("item", 1500), ("category", 64), ("city", 300)]
DIM = 8
DENSE_IN = 4
GLOBAL_BATCH = 48


def build_model(world: int, rank: int, plan_kind: str):
    """DLRM over an EBC, sharded by DMP under `plan_kind` (tw: table-wise, round robin over ranks;
    rw: row-wise; twrw: table-row-wise), with a fused RowWiseAdagrad on the tables."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)   # the same dense init on every rank (and every run)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, r in TABLES],
        device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[16, DIM],
                 over_arch_layer_sizes=[16, 1])
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
    gens = {"tw": lambda i: table_wise(rank=i % world), "rw": lambda i: row_wise(),
            "twrw": lambda i: table_row_wise(host_index=0)}
    per_table = {n: gens[plan_kind](i) for i, (n, _) in enumerate(TABLES)}
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection, per_table, world_size=world, local_size=world,
        device_type="cpu")})
    torch.manual_seed(1 + rank)   # DMP initializes each rank's shards; the same on every run
    return DistributedModelParallel(model, env=ShardingEnv(world, rank, dist.GroupMember.WORLD), plan=plan,
                                    device=torch.device("cpu"))


def batch(step: int, rank: int, world: int):
    """This rank's share of the global batch of `step` (a function of the step: a restarted run sees the
    same data, and so does a run on another number of workers)."""
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(10_000 + step)
    dense = torch.randn(GLOBAL_BATCH, DENSE_IN, generator=g)
    lengths, values = [], []
    for _, rows in TABLES:
        k = torch.randint(1, 4, (GLOBAL_BATCH,), generator=g)
        v = (torch.randint(0, rows, (int(k.sum()),), generator=g) ** 2) % rows   # a skewed id distribution
        lengths.append(k)
        values.append(v)
    labels = ((dense[:, 0] + 0.1 * values[0][torch.cumsum(lengths[0], 0) - 1].float() / TABLES[0][1]) > 0).float()
    mine = torch.arange(rank, GLOBAL_BATCH, world)
    kl, kv = [], []
    for k, v in zip(lengths, values):
        ends = torch.cumsum(k, 0)
        starts = ends - k
        kl.append(k[mine])
        kv.append(torch.cat([v[int(starts[i]):int(ends[i])] for i in mine.tolist()]))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n, _ in TABLES], values=torch.cat(kv),
                                              lengths=torch.cat(kl))
    return dense[mine], kjt, labels[mine]


def dump_tables(model, path: str, rank: int) -> None:
    """This rank's shards as TorchRec holds them (state_dict + fused optimizer state, read without
    recckpt): {table: {"weight": [(offsets, tensor)], "momentum1": [(offsets, tensor)], "shape": [N, D]}}."""
    os.makedirs(path, exist_ok=True)
    fused = model.fused_optimizer.state_dict()["state"]
    out = {}
    for key, w in model.state_dict().items():
        if ".embedding_bags." not in key or not key.endswith(".weight"):
            continue
        local = lambda t: [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in t.local_shards()]  # noqa: E731
        mom = [st for k, st in fused.get(key, {}).items() if k.endswith("momentum1")]
        out[key[:-len(".weight")]] = {"weight": local(w), "momentum1": local(mom[0]) if mom else [],
                                      "shape": list(w.shape)}
    torch.save(out, os.path.join(path, f"rank{rank}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30, help="train until this global step")
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--plan", default="tw", choices=["tw", "rw", "twrw"])
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL every worker after this step (a crash)")
    ap.add_argument("--dump-restored", default=None, help="write each rank's restored shards here")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.out, exist_ok=True)
    model = build_model(world, rank, a.plan)
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    # TorchRec's dense optimizer, keyed by parameter name; restore() loads it before its first step
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=0.01))
    saver = Saver(model, output_dir=os.path.join(a.out, "ckpt"), max_keep=None,
                  options=SaveOptions(coordination_timeout_s=120))
    manager = CheckpointManager(saver, a.interval, async_save=a.async_save)
    manager.register_for_checkpointing("dense_opt", dense_opt)

    start = manager.restore()
    if start is not None and rank == 0:
        print(f"resumed from {manager.restored_from} (global step {start}) on {world} workers, plan {a.plan}",
              flush=True)
    if a.dump_restored:
        dump_tables(model, a.dump_restored, rank)
        if rank == 0:
            with open(os.path.join(a.dump_restored, "restored_from"), "w") as f:
                f.write(manager.restored_from or "")
    log = open(os.path.join(a.out, f"losses-{world}.txt"), "a") if rank == 0 else None
    with manager:
        while manager.global_step < a.steps:
            dense, kjt, labels = batch(manager.global_step, rank, world)
            logits = model(dense, kjt).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            dense_opt.zero_grad()
            (loss / labels.numel()).backward()     # the tables' fused optimizer steps inside backward
            dense_opt.step()
            total = loss.detach().to(torch.float64).reshape(1)
            dist.all_reduce(total)
            if log:
                log.write(f"{manager.global_step + 1} {float.hex(total.item() / GLOBAL_BATCH)}\n")
                log.flush()
            manager.step()
            if manager.global_step == a.kill_at:
                manager.wait()   # for a deterministic example: the last save is durable, then the crash
                os.kill(os.getpid(), signal.SIGKILL)
    # What each rank finished, in a file: a torchrun rank sometimes aborts at exit after its work is done.
    with open(os.path.join(a.out, f"done-{world}-rank{rank}"), "w") as f:
        f.write(f"{manager.global_step}\n")
    if rank == 0:
        print(f"done at step {manager.global_step} on {world} workers (plan {a.plan})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
