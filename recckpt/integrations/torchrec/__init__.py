"""recckpt's TorchRec integration: DistributedModelParallel models (and plain modules holding
EmbeddingBagCollection / EmbeddingCollection) checkpointed by `recckpt.Saver` with no other call.

Each TorchRec table becomes a sparse table of the checkpoint keyed by global row index, its fused (or
in-backward) optimizer state as slots; see docs/TORCHREC.md. recckpt imports this package only through
`recckpt.state.plugins`, when a model holds TorchRec modules. Importing it checks the installed versions
and names the install script when they are missing or untested.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Sequence

from .versions import check

TORCHREC_VERSION, FBGEMM_VERSION = check()

from . import tracking  # noqa: E402  (after the version check, which must fail first)
from .dense_optim import loaded_state, saved_state  # noqa: E402
from .discover import (  # noqa: E402
    collections,
    find_tables,
    moved_params,
    per_rank_params,
    sharding_plan,
    table_keys,
    table_param_names,
)
from .table import TorchRecTable  # noqa: E402

__all__ = ["TorchRecTable", "dense_load_dict", "find_tables", "loaded_object_state", "manifest_metadata",
           "model_state_dict", "saved_object_state"]


def model_state_dict(model, state_dict: Dict[str, Any], objects: Sequence[Any] = ()) -> Dict[str, Any]:
    """`state_dict` with each TorchRec table's weight entry replaced by its `TorchRecTable` (an `MCHTable`
    for a managed-collision table, whose MCH buffers leave the state_dict too). `objects`: the registered
    objects, where a data-parallel table's optimizer state is found."""
    tables, keys, found = find_tables(model, state_dict, objects)
    tracking.attach(found, tables)    # which rows changed since a mark, for incremental checkpoints
    gone = set(keys)
    out = {k: v for k, v in state_dict.items() if k not in gone}
    for t in tables:
        out[f"{t.name}.weight"] = t
    return out


def manifest_metadata(model) -> Dict[str, str]:
    """Versions and the sharding plan the checkpoint was saved under: per table its sharding type, dims,
    dtype, and every shard's (row offset, column offset, rows, columns, rank)."""
    plan = sharding_plan(list(collections(model)))
    return {"recckpt.torchrec.version": TORCHREC_VERSION, "recckpt.fbgemm.version": FBGEMM_VERSION,
            "recckpt.torchrec.plan": json.dumps(plan, sort_keys=True, separators=(",", ":"))}


def dense_load_dict(model, dense: Dict[str, Any]) -> Dict[str, Any]:
    """`dense` plus the current state_dict entries of the TorchRec tables whose load hooks read them even
    under strict=False (`table_keys(..., hooked_only=True)`). The entries are views of the live tables
    (already loaded through the adapter), so loading them copies each table onto itself."""
    sd = model.state_dict()
    return {**{k: sd[k] for k in table_keys(model, sd, hooked_only=True)}, **dense}


def saved_object_state(model, obj, state):
    """What a save writes for registered object `obj` (its state_dict `state`): a name-keyed dense
    optimizer's state without the data-parallel tables' parameters whose state the tables' slots hold."""
    return saved_state(obj, state, moved_params(model, [obj]), model, per_rank_params(model, [obj]))


def loaded_object_state(model, obj, state, loaded_tables=None, rename=None):
    """What a load gives registered optimizer `obj` from the checkpoint's `state` (keyed by name): no
    entries for TorchRec tables' parameters it does not hold now, and its own live entries for the
    data-parallel tables' parameters (their accumulator comes from the tables' slots), with the saved step
    of the table each loads (`loaded_tables`: checkpoint table -> model table, where the load applies the
    optimizer slots), so it does not refuse a table that changed sides."""
    return loaded_state(obj, state, moved_params(model, [obj]), table_param_names(model), model, loaded_tables,
                        rename)
