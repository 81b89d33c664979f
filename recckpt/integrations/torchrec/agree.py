"""Agreeing on every table's optimizer slots across ranks, once per model.

A rank that holds no shard of a table (table-wise plans) has no fused optimizer state for it, so it cannot
tell by itself which slots the table has; yet every worker of a save must describe each table with the
same slots. The first save or load of a model (which every rank calls) gathers what each rank knows, on
a recckpt gloo group, and the answer is kept for the model's lifetime (a plan does not change).
"""
from __future__ import annotations

import hashlib
import json
import weakref
from typing import Callable, Dict

import torch
import torch.distributed as dist

from ...coordination import groups
from ...errors import InvalidArgumentError

PURPOSE = "integration"
TIMEOUT_S = 600.0
_agreed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _all_gather_json(obj, group) -> list:
    data = torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = max(int(s) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    buf[:data.numel()] = data
    outs = [torch.zeros(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [json.loads(o[:int(s)].numpy().tobytes().decode()) for o, s in zip(outs, sizes)]


def _refuse_other_plans(plan: Dict[str, dict], plans: list) -> None:
    """Raise naming the first table whose plan on some rank differs from this rank's `plan`."""
    for rank, theirs in enumerate(plans):
        for table in sorted(set(plan) | set(theirs)):
            mine, other = plan.get(table), theirs.get(table)
            if mine != other:
                raise InvalidArgumentError(
                    f"TorchRec table {table!r}: rank {rank}'s sharding plan differs from rank "
                    f"{dist.get_rank()}'s ({other} vs {mine}); build every rank's DistributedModelParallel "
                    f"with the same plan (one planner run, shared or broadcast), then save or load")
    raise InvalidArgumentError("TorchRec: the ranks' sharding plans differ (their digests do), though no table's "
                               "does here; build every rank's DistributedModelParallel with the same plan")


def agreed_slots(model, local: Dict[str, Dict[str, list]], plan_of: Callable[[], Dict[str, dict]]
                 ) -> Dict[str, Dict[str, list]]:
    """table -> {slot: [dtype name, shape]} agreed by every rank (computed once per model). `plan_of()`: this
    rank's sharding plan (discover.sharding_plan), which must be every rank's: ranks built with different
    plans would each save the rows their own plan gives them, and the checkpoint would hold some rows
    twice and others never."""
    have = _agreed.get(model)
    if have is not None:
        return have
    out = {k: dict(v) for k, v in local.items()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = groups.group(PURPOSE, TIMEOUT_S)
        plan = plan_of()   # (worked out only here: every later save of the model returns above)
        # A digest of the plan, not the plan: a thousand row-wise tables' shards on 64 ranks are megabytes
        # a rank. Only where two digests differ (every rank sees that) are the plans gathered, to name a table.
        text = json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()
        gathered = _all_gather_json({"slots": local, "plan": hashlib.sha256(text).hexdigest()}, group)
        if len({g["plan"] for g in gathered}) > 1:
            _refuse_other_plans(plan, _all_gather_json(plan, group))
        for theirs in gathered:
            for table, slots in theirs["slots"].items():
                mine = out.setdefault(table, slots)
                if mine != slots:
                    raise InvalidArgumentError(
                        f"TorchRec table {table!r}: ranks disagree on its optimizer state ({mine} vs {slots}); "
                        f"every shard of a table must use one fused optimizer")
    _agreed[model] = out
    return out
