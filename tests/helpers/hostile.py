"""Test helper: edit a checkpoint the way an attacker would, re-signing every checksum so that only
structural validation stands between the file and the loader."""
from __future__ import annotations

import os

from recckpt import _C
from recckpt.format import checked_json

CAP = 1 << 30


def read_json(ckpt: str, rel: str) -> dict:
    return checked_json.loads(open(os.path.join(ckpt, rel), "rb").read(), rel, CAP)


def write_json(ckpt: str, rel: str, obj: dict) -> None:
    """Write a checked JSON file (valid self-checksum) and, unless it is the manifest, re-sign it there."""
    open(os.path.join(ckpt, rel), "wb").write(checked_json.dumps(obj))
    if rel != "manifest.json":
        resign(ckpt, rel)


def resign(ckpt: str, rel: str) -> None:
    """Record `rel`'s current size and CRC in the manifest and re-sign the manifest."""
    data = open(os.path.join(ckpt, rel), "rb").read()
    m = read_json(ckpt, "manifest.json")
    m["files"][rel] = {"size": len(data), "crc32c": _C.crc32c(data)}
    write_json(ckpt, "manifest.json", m)
