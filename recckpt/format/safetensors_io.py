"""Streaming writer and validating reader for safetensors files.

We write the safetensors layout ourselves (8-byte little-endian header length, JSON header, raw bytes)
so a large dense state streams to storage tensor by tensor without a second full copy in memory, and
the CRC-32C of the whole file is computed as it is written. `read` goes through the safetensors
library, which validates every offset, and copies every tensor out of the file's bytes. `read_views`
validates the same rules itself and returns tensors that view a writable buffer: a dense state loads
with one copy (into the parameters) instead of three, holding one file's size of extra memory, not two.
`parse` is those checks alone and `read_arrays` gives numpy arrays: what `recckpt inspect` and `verify`
use, so that they do not import torch (torch is imported only where tensors are made).
"""
from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING

import numpy as np

from .. import _C
from ..errors import CorruptCheckpointError
from . import checked_json, dtypes

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 << 20  # same cap as the safetensors library
_HEADER_LIMITS = checked_json.JsonLimits(MAX_HEADER_BYTES)


def tensor_bytes(t: torch.Tensor):
    """A zero-copy uint8 numpy view of a CPU tensor's bytes (a contiguous copy first if needed)."""
    import torch
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def write(fileobj, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
          each=None) -> tuple[int, int]:
    """Write a safetensors file to `fileobj`; returns (bytes written, CRC-32C of the file). `each`, if
    given, is called as each(name, dtype name, shape, uint8 bytes) for every tensor as it is written."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    # Widest elements first: the data section starts 8-aligned, so every entry then starts aligned for
    # its dtype and read_views can hand out views instead of copies.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
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
    if len(head) > MAX_HEADER_BYTES:   # every reader (this one, the safetensors library) refuses it
        big = max(header.get("__metadata__", {}).items(), key=lambda kv: len(kv[1]), default=None)
        what = (f"its metadata {big[0]!r} (a state tree: registered objects' or IO state's plain values) holds "
                f"{len(big[1])} characters" if big is not None and len(big[1]) > MAX_HEADER_BYTES // 2 else
                f"it lists {len(order)} tensors")
        raise ValueError(f"the safetensors header would be {len(head)} bytes, over the {MAX_HEADER_BYTES}-byte "
                         f"limit readers enforce: {what}. Keep bulk data in tensors or numpy arrays, which "
                         f"are stored as tensor data, not in the header (a list of millions of ints as a numpy "
                         f"int64 array, bytes as a numpy uint8 array)")
    prefix = struct.pack("<Q", len(head)) + head
    fileobj.write(prefix)
    crc = _C.crc32c(prefix)
    for name in order:
        data = tensor_bytes(tensors[name])
        if each is not None:
            each(name, header[name]["dtype"], tuple(header[name]["shape"]), data)
        if data.size:
            fileobj.write(memoryview(data))
            crc = _C.crc32c(data, crc)
    return len(prefix) + offset, crc


def _header_length(buf, path: str) -> int:
    """The header length a safetensors file in `buf` gives, checked against the file and the cap."""
    if len(buf) < 8:
        raise CorruptCheckpointError(f"{path}: {len(buf)} bytes is too short for a safetensors file", path)
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{path}: safetensors header length {n} is over the {MAX_HEADER_BYTES}-byte "
                                     f"limit (the safetensors library's too); recckpt never writes one", path)
    if 8 + n > len(buf):
        raise CorruptCheckpointError(f"{path}: safetensors header length {n} does not fit the "
                                     f"{len(buf)}-byte file", path)
    return n


def _bad(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: invalid safetensors file ({why})", path)


def parse(buf, path: str) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict[str, str]]:
    """Check a whole safetensors file held in `buf` (bytes or a buffer) as the safetensors library does:
    the header length, a JSON object, known dtypes, each entry's byte length equal to its shape's, and
    entries that tile the data section exactly. Returns ({name: (dtype name, shape, start, end)}, metadata),
    start/end being byte positions in `buf`, in header order. Defects raise CorruptCheckpointError."""
    def bad(why: str) -> CorruptCheckpointError:
        return _bad(path, why)

    n = _header_length(buf, path)
    header = checked_json.parse(bytes(buf[8:8 + n]), path, _HEADER_LIMITS)
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not an object of strings")
    start, size = 8 + n, len(buf) - 8 - n
    spans = []
    for name, e in header.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise bad(f"entry {name!r} lacks one of dtype, shape, data_offsets")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in dtypes.names():
            raise bad(f"entry {name!r}: unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape):
            raise bad(f"entry {name!r}: shape {shape!r} is not a list of non-negative 64-bit integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= size):
            raise bad(f"entry {name!r}: data_offsets {offs!r} do not lie in the {size}-byte data section")
        numel = 1
        for d in shape:  # as the library does: an intermediate product past 64 bits is an error
            numel *= d
            if numel >= 1 << 64:
                raise bad(f"entry {name!r}: shape {shape} overflows 64 bits")
        if numel * dtypes.itemsize(dt) != offs[1] - offs[0]:
            raise bad(f"entry {name!r}: {offs[1] - offs[0]} bytes for shape {shape} of {dt}")
        spans.append((offs[0], offs[1], name))
    end = 0
    for s, e, name in sorted(spans):
        if s != end:
            raise bad(f"entry {name!r} starts at {s}, not where the previous one ends ({end})")
        end = e
    if end != size:
        raise bad(f"the entries cover {end} of the {size}-byte data section")
    return {name: (header[name]["dtype"], tuple(header[name]["shape"]), start + s, start + e)
            for s, e, name in spans}, meta


def read_views(buf, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a whole safetensors file held in `buf` (a writable buffer: bytearray, uint8 numpy array):
    (tensors, metadata), the tensors being views of `buf` (copies where an offset is not aligned for
    the dtype). Checks what `parse` checks."""
    import torch
    entries, meta = parse(buf, path)
    tensors = {}
    for name, (dt, shape, s, e) in entries.items():
        dtype = dtypes.torch_dtype(dt)
        if e == s:
            try:  # no bytes, but a shape torch may still refuse (e.g. [2**62, 2**62, 0])
                tensors[name] = torch.empty(shape, dtype=dtype)
            except (RuntimeError, ValueError, OverflowError) as err:
                raise _bad(path, f"entry {name!r}: shape {list(shape)}: {err}") from None
            continue
        view = torch.frombuffer(buf, dtype=torch.uint8, count=e - s, offset=s)
        if view.data_ptr() % dtypes.itemsize(dt):
            view = view.clone()  # e.g. after an odd-sized U8 entry: torch wants aligned elements
        tensors[name] = view.view(dtype).view(shape)
    return tensors, meta


def read_arrays(data, path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a whole safetensors file from memory without torch: (numpy arrays, each its own copy,
    metadata). BF16 entries come as uint16 arrays of their bits. Checks what `parse` checks."""
    entries, meta = parse(data, path)
    arrays = {}
    for name, (dt, shape, s, e) in entries.items():
        raw = np.frombuffer(data, dtype=np.uint8, count=e - s, offset=s)
        try:
            arrays[name] = raw.view(dtypes.numpy_dtype(dt) or "<u2").reshape(shape).copy()
        except (ValueError, OverflowError) as err:  # a zero-size shape numpy refuses (e.g. [2**62, 2**62, 0])
            raise _bad(path, f"entry {name!r}: shape {list(shape)}: {err}") from None
    return arrays, meta


def read(data: bytes, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a whole safetensors file from memory: (tensors, metadata). Defects raise
    CorruptCheckpointError naming `path`."""
    n = _header_length(data, path)
    header = checked_json.parse(data[8:8 + n], path, _HEADER_LIMITS)
    try:
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not an object")
        from safetensors.torch import load as _st_load
        tensors = _st_load(bytes(data)) if not isinstance(data, bytes) else _st_load(data)
    except Exception as e:  # the library raises several types for malformed input
        raise CorruptCheckpointError(f"{path}: invalid safetensors file ({e})", path) from None
    return tensors, meta
