"""Distributed training with recckpt: sparse tables sharded by `recckpt.partition`, dense layers
replicated (gradients all-reduced), checkpoints saved by every rank together, and a resume on a
different number of workers.

    torchrun --nproc_per_node=2 examples/distributed_train.py --out /tmp/run --steps 30
    torchrun --nproc_per_node=3 examples/distributed_train.py --out /tmp/run --steps 20 --resume

(scripts/distributed_example.sh runs both.) Each rank owns the user ids that
`recckpt.partition(ids, world) == rank`, and trains on the examples of the users it owns (the data
is sharded the same way as the table), so no embedding ever lives on two ranks. After a restart on
another world size, `Saver.load()` gives each rank exactly the rows it owns under the new size.
"""
from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from recckpt import HashTable, SaveOptions, Saver, SparseAdagrad, partition


class CTR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)     # identical dense init on every rank
        self.user = HashTable("user", dim=8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, u):
        return self.mlp(self.user(u)).squeeze(1)


class Reader:
    """This worker's data position: IO state, per worker."""
    def __init__(self):
        self.batches_read = 0

    def dump_io_state(self):
        return {"batches_read": self.batches_read}

    def load_io_state(self, state):
        self.batches_read = state["batches_read"]


def global_batch(step: int):
    g = torch.Generator().manual_seed(step)
    u = torch.randint(0, 5000, (512,), generator=g) * 7919 - 10**9
    y = (u % 3 == 0).float()
    return u, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = CTR()
    sparse_opt = SparseAdagrad(model, lr=0.05)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    progress = {"step": 0}
    reader = Reader()
    saver = Saver(model, sparse_optim=sparse_opt, output_dir=a.out, max_keep=2,
                  options=SaveOptions(coordination_timeout_s=120))
    saver.register_for_checkpointing("dense_opt", dense_opt)
    saver.register_for_checkpointing("progress", progress)
    saver.register_io_state("reader", reader)
    if a.resume:
        # shard_id/shard_num come from the process group; reader positions are per worker and cannot
        # follow a resize, so they are dropped (the global step in `progress` says where to continue).
        res = saver.load(load_conf={"io_state_on_resize": "drop"})
        owned = bool((partition(model.user.ids(), world) == rank).all())
        print(f"[rank {rank}/{world}] resumed {res.ckpt_id}: {len(model.user)} user rows, all owned: {owned}, "
              f"{res.bytes_read} bytes read, IO state dropped: {res.io_state_dropped}", flush=True)
        assert owned
    start = progress["step"]
    for step in range(start, start + a.steps):
        u, y = global_batch(step)
        mine = partition(u, world) == rank          # this rank's share of the batch
        u, y = u[mine], y[mine]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u), y, reduction="sum") / 512
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        for p in model.mlp.parameters():             # data-parallel dense layers
            dist.all_reduce(p.grad)
        sparse_opt.step()
        dense_opt.step()
        reader.batches_read += 1
        progress["step"] = step + 1
        total = torch.tensor([loss.item()])
        dist.all_reduce(total)
        if (step + 1) % a.ckpt_every == 0:
            path = saver.save(f"step_{step + 1}", step=step + 1)
            if rank == 0:
                print(f"step {step + 1}: loss {total.item():.4f}, saved {path}", flush=True)
    rows = torch.tensor([len(model.user)])
    dist.all_reduce(rows)
    if rank == 0:
        print(f"done at step {progress['step']} on {world} workers: {int(rows)} user rows in total", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
