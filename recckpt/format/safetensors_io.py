"""Streaming writer and validating reader for safetensors files.

We write the safetensors layout ourselves (8-byte little-endian header length, JSON header, raw bytes)
so a large dense state streams to storage tensor by tensor without a second full copy in memory, and
the CRC-32C of the whole file is computed as it is written. Reading goes through the safetensors
library, which validates every offset; our header parse only extracts `__metadata__`.
"""
from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load as _st_load

from .. import _C
from . import dtypes
from ..errors import CorruptCheckpointError

MAX_HEADER_BYTES = 100 << 20  # same cap as the safetensors library


def tensor_bytes(t: torch.Tensor):
    """A zero-copy uint8 numpy view of a CPU tensor's bytes (a contiguous copy first if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def write(fileobj, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write a safetensors file to `fileobj`; returns (bytes written, CRC-32C of the file)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    order = sorted(tensors)
    for name in order:
        if name == "__metadata__":
            raise ValueError("a tensor named '__metadata__' cannot be stored: safetensors reserves that "
                             "key for the header's metadata; rename the buffer or parameter")
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtypes.name_of(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    prefix = struct.pack("<Q", len(head)) + head
    fileobj.write(prefix)
    crc = _C.crc32c(prefix)
    for name in order:
        data = tensor_bytes(tensors[name])
        if data.size:
            fileobj.write(memoryview(data))
            crc = _C.crc32c(data, crc)
    return len(prefix) + offset, crc


def read(data: bytes, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a whole safetensors file from memory: (tensors, metadata). Defects raise
    CorruptCheckpointError naming `path`."""
    if len(data) < 8:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes is too short for a safetensors file", path)
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise CorruptCheckpointError(f"{path}: safetensors header length {n} does not fit the "
                                     f"{len(data)}-byte file", path)
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not an object")
        tensors = _st_load(bytes(data)) if not isinstance(data, bytes) else _st_load(data)
    except Exception as e:  # the library raises several types for malformed input
        raise CorruptCheckpointError(f"{path}: invalid safetensors file ({e})", path) from None
    return tensors, meta
