"""The one rule for renaming what a checkpoint names (tables, dense keys, parameters) to the model's names:
`LoadConfig.rename` and `apply_named_optimizer_state(rename=...)` both follow it."""
from __future__ import annotations

from typing import Mapping


def renamed(rename: Mapping[str, str], name: str) -> str:
    """`name` under `rename` (checkpoint name -> model name): an exact key first; else the longest key
    ending in '.' that `name` starts with renames that prefix ('tower_a.' -> 'tower_b.', 'module.' -> '');
    else `name` itself."""
    if name in rename:
        return rename[name]
    best = max((k for k in rename if k.endswith(".") and name.startswith(k)), key=len, default=None)
    return name if best is None else rename[best] + name[len(best):]
