"""Field-by-field checks of a parsed JSON document (a manifest, an index): each failure raises
CorruptCheckpointError naming the file, the field path and the problem, so a garbled or hostile file is
rejected before any offset in it is used."""
from __future__ import annotations

from ..errors import CorruptCheckpointError
from .names import validate_relpath

U32 = 1 << 32
I63 = 1 << 63


class Fields:
    """Field-by-field checks that report `<file>: field <field path>: <problem>`."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, problem: str):
        raise CorruptCheckpointError(f"{self.path}: field {where}: {problem}", self.path)

    def get(self, obj, key, where):
        if not isinstance(obj, dict) or key not in obj:
            self.fail(f"{where}.{key}" if where else key, "missing")
        return obj[key]

    def int(self, v, where, lo=0, hi=I63):
        if type(v) is not int or not lo <= v < hi:
            self.fail(where, f"expected an integer in [{lo}, {hi}), got {v!r:.80}")
        return v

    def str(self, v, where):
        if not isinstance(v, str) or "\x00" in v:
            self.fail(where, f"expected a string, got {v!r:.80}")
        return v

    def dict(self, v, where):
        if not isinstance(v, dict):
            self.fail(where, f"expected an object, got {type(v).__name__}")
        return v

    def list(self, v, where):
        if not isinstance(v, list):
            self.fail(where, f"expected a list, got {type(v).__name__}")
        return v

    def worker_key(self, w, where) -> int:
        """A worker number used as an object key: ASCII digits only ("²" and "٣" are digits to
        str.isdigit but not to int()), at most 7 of them (shard_num < 2**20), no leading zero."""
        if not (isinstance(w, str) and w.isascii() and w.isdigit() and len(w) <= 7) or w != str(int(w)):
            # (canonical only: "0" and "00" would be two keys of one worker, the last one silently winning)
            self.fail(where, f"worker key {w!r:.20} is not a worker number")
        return int(w)

    def relpath(self, v, where):
        try:
            return validate_relpath(v, where)
        except ValueError as e:
            self.fail(where, str(e))

    def opt_relpath(self, v, where):
        return None if v is None else self.relpath(v, where)
