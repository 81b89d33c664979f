"""Element types a checkpoint can hold, by their format names (the strings written to disk).

The format names match safetensors' where they exist, so a dense file and a sparse index agree.
"""
from __future__ import annotations

import numpy as np
import torch

# format name -> (torch dtype, numpy dtype used to hold the raw bytes, itemsize)
_TABLE: dict[str, tuple[torch.dtype, np.dtype, int]] = {
    "F64": (torch.float64, np.dtype("<f8"), 8),
    "F32": (torch.float32, np.dtype("<f4"), 4),
    "F16": (torch.float16, np.dtype("<f2"), 2),
    "BF16": (torch.bfloat16, np.dtype("<u2"), 2),  # numpy has no bfloat16: raw 16-bit words
    "I64": (torch.int64, np.dtype("<i8"), 8),
    "I32": (torch.int32, np.dtype("<i4"), 4),
    "I16": (torch.int16, np.dtype("<i2"), 2),
    "I8": (torch.int8, np.dtype("i1"), 1),
    "U8": (torch.uint8, np.dtype("u1"), 1),
    "U16": (torch.uint16, np.dtype("<u2"), 2),
    "U32": (torch.uint32, np.dtype("<u4"), 4),
    "U64": (torch.uint64, np.dtype("<u8"), 8),
    "BOOL": (torch.bool, np.dtype("?"), 1),
}
_BY_TORCH = {v[0]: k for k, v in _TABLE.items()}

FLOAT_NAMES = frozenset({"F64", "F32", "F16", "BF16"})


def names() -> list[str]:
    return list(_TABLE)


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint; supported: "
                        f"{', '.join(str(v[0]) for v in _TABLE.values())}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _entry(name)[0]


def numpy_dtype(name: str) -> np.dtype:
    return _entry(name)[1]


def itemsize(name: str) -> int:
    return _entry(name)[2]


def is_float(name: str) -> bool:
    return name in FLOAT_NAMES


def _entry(name: str):
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(_TABLE)}") from None
