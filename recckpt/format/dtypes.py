"""Element types a checkpoint can hold, by their format names (the strings written to disk).

The format names match safetensors' where they exist, so a dense file and a sparse index agree. Names
and sizes are plain data here, so that reading manifests and indexes (`recckpt ls`, `inspect`,
`verify`) does not import torch; the torch dtypes are looked up, and torch imported, only when a
caller asks for one.
"""
from __future__ import annotations

# format name -> bytes per element
_ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1,
}
# format name -> name of the torch dtype (torch.<name>)
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool",
}
# format name -> numpy element type (little-endian); numpy has no bfloat16
_NUMPY: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
_by_torch: dict | None = None

FLOAT_NAMES = frozenset({"F64", "F32", "F16", "BF16"})


def names() -> list[str]:
    return list(_ITEMSIZE)


def _torch_table() -> dict:
    global _by_torch
    if _by_torch is None:
        import torch
        _by_torch = {getattr(torch, t): k for k, t in _TORCH_NAMES.items()}
    return _by_torch


def name_of(dtype) -> str:
    """The format name of a torch.dtype."""
    try:
        return _torch_table()[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint; supported: "
                        f"{', '.join('torch.' + t for t in _TORCH_NAMES.values())}") from None


def torch_dtype(name: str):
    """The torch.dtype of a format name (imports torch)."""
    import torch
    return getattr(torch, _TORCH_NAMES[_known(name)])


def numpy_dtype(name: str) -> str | None:
    """The numpy element type of a format name, None for BF16 (numpy has none)."""
    return _NUMPY.get(_known(name))


def itemsize(name: str) -> int:
    return _ITEMSIZE[_known(name)]


def is_float(name: str) -> bool:
    return name in FLOAT_NAMES


def _known(name: str) -> str:
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(_ITEMSIZE)}")
    return name
