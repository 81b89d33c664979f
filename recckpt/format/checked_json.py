"""JSON metadata files that carry their own checksum.

A checked file is a JSON object with a key "crc32c": the CRC-32C of the canonical serialisation of the
object without that key (keys sorted, no whitespace, ASCII only, integers only — no floats, so every
language serialises it to the same bytes). Any flipped byte either breaks parsing or the checksum.
"""
from __future__ import annotations

import json

from .. import _C
from ..errors import CorruptCheckpointError

CRC_KEY = "crc32c"


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def dumps(obj: dict) -> bytes:
    if CRC_KEY in obj:
        raise ValueError(f"metadata must not contain the key {CRC_KEY!r}")
    body = canonical(obj)
    out = dict(obj)
    out[CRC_KEY] = _C.crc32c(body)
    # Human-readable on disk; the checksum is over the canonical form, not these bytes.
    return json.dumps(out, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode("ascii")


def loads(data: bytes, path: str, max_bytes: int) -> dict:
    """Parse and verify a checked JSON file; CorruptCheckpointError names `path` on any defect."""
    if len(data) > max_bytes:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes exceeds the {max_bytes}-byte cap for "
                                     f"metadata files; the file is corrupt or not a recckpt file", path)
    try:
        obj = json.loads(data.decode("ascii"), parse_float=_no_float, parse_constant=_no_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: not valid checkpoint metadata ({e})", path) from None
    if not isinstance(obj, dict) or not isinstance(obj.get(CRC_KEY), int):
        raise CorruptCheckpointError(f"{path}: metadata has no integer {CRC_KEY!r} field", path)
    crc = obj.pop(CRC_KEY)
    actual = _C.crc32c(canonical(obj))
    if actual != crc:
        raise CorruptCheckpointError(f"{path}: checksum mismatch (recorded {crc:#010x}, computed "
                                     f"{actual:#010x}); the file is corrupt", path)
    return obj


def _no_float(text):
    raise ValueError(f"unexpected non-integer number {text!r}")
