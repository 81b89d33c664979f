"""Element types a checkpoint can hold, by their format names (the strings written to disk).

The format names match safetensors' where they exist, so a dense file and a sparse index agree.
"""
from __future__ import annotations

import torch

# format name -> torch dtype (the element size follows from it)
_TABLE: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in _TABLE.items()}
_BY_TORCH = {v: k for k, v in _TABLE.items()}

FLOAT_NAMES = frozenset({"F64", "F32", "F16", "BF16"})


def names() -> list[str]:
    return list(_TABLE)


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint; supported: "
                        f"{', '.join(str(v) for v in _TABLE.values())}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _TABLE[_known(name)]


def itemsize(name: str) -> int:
    return _ITEMSIZE[_known(name)]


def is_float(name: str) -> bool:
    return name in FLOAT_NAMES


def _known(name: str) -> str:
    if name not in _TABLE:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(_TABLE)}")
    return name
