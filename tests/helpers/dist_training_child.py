"""A data-parallel CTR job around CheckpointManager, launched by torchrun in the multi-process tests:

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/helpers/dist_training_child.py \
        --out DIR --steps S [--interval K] [--async] [--preemption] [--sleep T] [--fail-rank R --fail-save I [--stall T] [--fail-in W]]
        [--timeout T]

The manager gets no shard_id/shard_num: it must take them from the process group. The user table is
sharded by `recckpt.partition` (each rank trains on the examples of the ids it owns), the MLP is
replicated (gradients all-reduced on the default group, as training does). Every collective recckpt
issues must run on its own groups: the default group is guarded, and a recckpt frame calling a
collective on it fails the run. Per rank, the child writes under DIR/report/:
  losses-<world>-<rank>.txt   "<step> <float.hex(loss)>" per step, flushed;
  pid-<world>-<rank>          its pid (a test signals one rank);
  end-<world>-<rank>.npz      at the end: the table's ids and slots, the dense state, the global step;
  errors-<world>-<rank>.txt   save errors caught by the loop (the failure-injection runs).
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch.distributed as dist

import recckpt


class DefaultGroupUsed(RuntimeError):
    pass


def guard_default_group() -> None:
    """Make recckpt's use of the default process group an error (an NCCL default group would refuse
    recckpt's CPU tensors; recckpt must use its own gloo groups)."""
    for name in ("all_reduce", "broadcast", "all_gather", "gather", "barrier", "all_gather_object",
                 "broadcast_object_list", "scatter", "reduce"):
        real = getattr(dist, name)

        def guarded(*a, _real=real, _name=name, **kw):
            caller = inspect.currentframe().f_back
            module = caller.f_globals.get("__name__", "") if caller is not None else ""
            group = kw.get("group")
            if module.startswith("recckpt") and (group is None or group is dist.group.WORLD):
                raise DefaultGroupUsed(f"{module} called torch.distributed.{_name} on the default group")
            return _real(*a, **kw)
        setattr(dist, name, guarded)


def load_example():
    """examples/distributed_train.py: the model, reader, step and manager set-up users start from."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "distributed_train.py")
    spec = importlib.util.spec_from_file_location("distributed_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--preemption", action="store_true")
    ap.add_argument("--seconds", type=float, default=None, help="also EveryNSeconds(seconds)")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-save", type=int, default=-1, help="the fail-rank raises inside this save (0-based)")
    ap.add_argument("--stall", type=float, default=0.0, help="the fail-rank stalls this long instead of raising")
    ap.add_argument("--fail-in", choices=("write", "capture"), default="write",
                    help="where: writing its part (background) or its reader's dump_io_state (training thread)")
    ap.add_argument("--timeout", type=float, default=60.0, help="SaveOptions.coordination_timeout_s")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    guard_default_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    report = os.path.join(a.out, "report")
    os.makedirs(report, exist_ok=True)
    tag = f"{world}-{rank}"
    with open(os.path.join(report, f"pid-{tag}"), "w") as f:
        f.write(str(os.getpid()))

    ex = load_example()
    policies = [recckpt.EveryNSeconds(a.seconds)] if a.seconds else []
    model, sopt, dopt, reader, mgr = ex.build(os.path.join(a.out, "ckpt"), interval=a.interval,
                                              async_save=a.async_save, policies=policies,
                                              preemption=a.preemption, coordination_timeout_s=a.timeout)
    assert (mgr.shard_id, mgr.shard_num) == (rank, world), "the manager must take its world from the group"

    if a.fail_rank == rank and a.fail_in == "capture":
        real_dump, dumps = reader.dump_io_state, []

        def failing_dump():
            dumps.append(1)
            if len(dumps) - 1 == a.fail_save:
                raise RuntimeError(f"injected failure on rank {rank} in dump_io_state of save #{a.fail_save}")
            return real_dump()
        reader.dump_io_state = failing_dump
    elif a.fail_rank == rank:
        from recckpt.train import saver as saver_mod
        real, calls = saver_mod.write_worker_part, []

        def failing(*args, **kw):
            calls.append(1)
            if len(calls) - 1 == a.fail_save:
                if a.stall:
                    time.sleep(a.stall)   # a rank that stops responding inside the save
                else:
                    raise OSError(5, f"injected failure on rank {rank} inside save #{a.fail_save}")
            return real(*args, **kw)
        saver_mod.write_worker_part = failing

    mgr.restore()
    losses = open(os.path.join(report, f"losses-{tag}.txt"), "a")
    errors = []
    with mgr:
        while mgr.global_step < a.steps:
            step = mgr.global_step
            loss = ex.train_step(model, sopt, dopt, reader, step)
            losses.write(f"{step + 1} {float.hex(loss)}\n")
            losses.flush()
            try:
                mgr.step()
            except recckpt.errors.CheckpointSaveError as e:
                errors.append(f"{mgr.global_step} {type(e).__name__}: {e}")
            if a.sleep:
                time.sleep(a.sleep)
        try:
            mgr.wait()
        except recckpt.errors.CheckpointSaveError as e:
            errors.append(f"{mgr.global_step} {type(e).__name__}: {e}")
    losses.close()
    with open(os.path.join(report, f"errors-{tag}.txt"), "w") as f:
        f.write("\n".join(errors))
    ids = model.user.ids()
    np.savez(os.path.join(report, f"end-{tag}.npz"), ids=ids.numpy(),
             embedding=model.user.slot("embedding").numpy(), acc=model.user.slot("adagrad.acc").numpy(),
             step=np.array(mgr.global_step), batches=np.array(reader.batches),
             restored_from=np.array(mgr.restored_from or ""),
             **{f"dense.{k}": v.numpy() for k, v in model.mlp.state_dict().items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
