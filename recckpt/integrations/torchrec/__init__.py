"""recckpt's TorchRec integration: DistributedModelParallel models (and plain modules holding
EmbeddingBagCollection / EmbeddingCollection) checkpointed by `recckpt.Saver` with no other call.

Each TorchRec table becomes a sparse table of the checkpoint keyed by global row index, its fused (or
in-backward) optimizer state as slots; see docs/TORCHREC.md. recckpt imports this package only through
`recckpt.state.plugins`, when a model holds TorchRec modules. Importing it checks the installed versions
and names the install script when they are missing or untested.
"""
from __future__ import annotations

import json
from typing import Any, Dict

from .versions import check

TORCHREC_VERSION, FBGEMM_VERSION = check()

from .discover import collections, find_tables  # noqa: E402  (after the version check, which must fail first)
from .table import TorchRecTable  # noqa: E402

__all__ = ["TorchRecTable", "dense_load_dict", "find_tables", "manifest_metadata", "model_state_dict"]


def model_state_dict(model, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """`state_dict` with each TorchRec table's weight entry replaced by its `TorchRecTable`."""
    tables, keys, _ = find_tables(model, state_dict)
    gone = set(keys)
    out = {k: v for k, v in state_dict.items() if k not in gone}
    for t in tables:
        out[f"{t.name}.weight"] = t
    return out


def manifest_metadata(model) -> Dict[str, str]:
    """Versions and the sharding plan the checkpoint was saved under: per table its sharding type, dims,
    dtype, and every shard's (row offset, column offset, rows, columns, rank)."""
    found = list(collections(model))
    plan = {}
    for f in found:
        if f.sharded:
            for tname, ps in f.module.module_sharding_plan.items():
                shards = []
                spec = getattr(ps, "sharding_spec", None)
                for s in getattr(spec, "shards", None) or []:
                    rank = getattr(s.placement, "rank", lambda: None)()
                    shards.append([*map(int, s.shard_offsets), *map(int, s.shard_sizes), rank])
                plan[f"{f.prefix}{f.tables_attr}.{tname}"] = {"sharding": ps.sharding_type, "kernel": ps.compute_kernel,
                                          "ranks": list(ps.ranks or []), "shards": shards}
        else:
            for tname in getattr(f.module, f.tables_attr):
                plan[f"{f.prefix}{f.tables_attr}.{tname}"] = {"sharding": "unsharded"}
    return {"recckpt.torchrec.version": TORCHREC_VERSION, "recckpt.fbgemm.version": FBGEMM_VERSION,
            "recckpt.torchrec.plan": json.dumps(plan, sort_keys=True, separators=(",", ":"))}


def dense_load_dict(model, dense: Dict[str, Any]) -> Dict[str, Any]:
    """`dense` plus every TorchRec table's current state_dict entry: a sharded EmbeddingCollection's load
    hook reads its tables' entries even under strict=False. The entries are views of the live tables
    (already loaded through the adapter), so loading them copies each table onto itself."""
    sd = model.state_dict()
    _, keys, _ = find_tables(model, sd)
    return {**{k: sd[k] for k in keys}, **dense}
