"""Turning API results into JSON-able data and into readable text; no checkpoint access here."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import sys
from typing import Any

import numpy as np


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def summary(obj: Any, depth: int = 0) -> Any:
    """A JSON-able summary of a state tree: tensors and arrays as 'tensor(F32, [3, 4])', bytes by size,
    long lists cut short. Never calls into the objects beyond reading their type, dtype and shape."""
    if depth > 8:
        return "..."
    torch = sys.modules.get("torch")  # no tensor exists unless torch is loaded: `--help` stays fast
    if torch is not None and isinstance(obj, torch.Tensor):
        return f"tensor({str(obj.dtype).replace('torch.', '')}, {list(obj.shape)})"
    if isinstance(obj, np.ndarray):
        return f"ndarray({obj.dtype}, {list(obj.shape)})"
    if isinstance(obj, (bytes, bytearray)):
        return f"bytes({len(obj)})"
    if isinstance(obj, dict):
        return {str(k): summary(v, depth + 1) for k, v in list(obj.items())[:50]}
    if isinstance(obj, (list, tuple)):
        items = [summary(v, depth + 1) for v in obj[:20]]
        return items + [f"... {len(obj) - 20} more"] if len(obj) > 20 else items
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return f"<{type(obj).__name__}>"


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, _dt.datetime):
        return obj.isoformat()
    if isinstance(obj, float) and not np.isfinite(obj):
        return str(obj)
    return summary(obj)


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=1, sort_keys=False)


def table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def compact(obj: Any, limit: int = 160) -> str:
    text = json.dumps(summary(obj), separators=(", ", ": "))
    return text if len(text) <= limit else text[:limit - 3] + "..."
