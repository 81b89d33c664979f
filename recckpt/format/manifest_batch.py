"""A manifest's tables and digests read with the rules checked once per distinct slot layout.

A model of a thousand tables repeats a handful of slot layouts (dim and optimizer) a thousand times; the
field-by-field rules of `schema.manifest_from_json` cost a few dozen calls per table. Here a table in
the common form (known keys only, `hash` buckets) is read in a few dict lookups, its slots checked once
per distinct layout, and anything else is answered None, so that the caller applies the rules to that
table (they find and word any problem, in the same order as before: every table this module accepts,
those rules accept too).
"""
from __future__ import annotations

import re

import numpy as np

from . import dtypes
from .digest import Digest, TableDigest
from .names import SEGMENT_DIR_SINCE
from .schema import CATEGORIES, SlotInfo, TableInfo

_I63 = 1 << 63
#: The keys of a table this module reads: any other (a newer format's, or column blocks, row or id
#: ranges) goes through the full rules.
_PLAIN = frozenset({"slots", "rows", "bucket_fn"})
_CHANGES = _PLAIN | {"changes", "removed"}
_DTYPES = frozenset(dtypes.names())
_HEX_DIGITS = re.compile(r"[0-9a-f]*")   # (digest.Digest.from_hex's rule, for many digests at once)


class SlotLayouts:
    """Slot layouts (a table's `slots` as parsed JSON) checked so far, by their contents."""

    def __init__(self):
        self._seen: dict[tuple, dict[str, SlotInfo]] = {}

    def slots(self, raw) -> dict[str, SlotInfo] | None:
        """The table's slots (name -> SlotInfo, column order), or None where a rule may fail."""
        if type(raw) is not list:
            return None
        try:
            key = tuple((p[0], p[1]["dtype"], tuple(p[1]["shape"]), p[1]["category"]) if type(p) is list
                        and len(p) == 2 and type(p[1]) is dict and type(p[1].get("shape")) is list else None
                        for p in raw)
            have = self._seen.get(key)
        except (KeyError, TypeError):   # a missing field, an unhashable shape entry
            return None
        if have is None:
            have = _check_layout(key)
            if have is None:
                return None
            self._seen[key] = have
        return dict(have)


def _check_layout(key: tuple) -> dict[str, SlotInfo] | None:
    out = {}
    for item in key:
        if item is None:
            return None
        name, dt, shape, cat = item
        if type(name) is not str or "\x00" in name or name in out or dt not in _DTYPES or cat not in CATEGORIES \
                or len(shape) > 8 or not all(type(d) is int and 0 <= d < (1 << 31) for d in shape):
            return None
        out[name] = SlotInfo(dt, shape, cat)
    return out


def table_info(name, t, version: int, layouts: SlotLayouts) -> TableInfo | None:
    """A version 4 manifest table in the common form, or None (the full rules then read it)."""
    if type(t) is not dict or type(name) is not str or "\x00" in name or version < SEGMENT_DIR_SINCE:
        return None
    keys = t.keys()
    if not (keys == _PLAIN or keys <= _CHANGES and _PLAIN <= keys) or t["bucket_fn"] != "hash":
        return None
    rows, changes, removed = t["rows"], t.get("changes", False), t.get("removed", 0)
    if type(rows) is not int or not 0 <= rows < _I63 or (changes is not True and changes is not False) \
            or type(removed) is not int or not 0 <= removed < _I63 or (removed and not changes):
        return None
    slots = layouts.slots(t["slots"])
    return None if slots is None else TableInfo(slots, rows, changes, removed)


def table_digests(raw: dict, tables: dict[str, TableInfo]) -> dict[str, TableDigest] | None:
    """Every table's entry of the manifest's `digests.tables` (`raw`, a dict) in the common form, their
    hex digits checked and decoded at once; None where any entry needs the full rules."""
    names, rows, texts = [], [], []
    for name, t in raw.items():
        info = tables.get(name)
        if info is None or type(t) is not dict or t.keys() != {"rows", "ids", "slots"}:
            return None
        n, slots = t["rows"], t["slots"]
        if type(n) is not int or not 0 <= n < _I63 or (not info.changes and n != info.rows) \
                or type(slots) is not dict or slots.keys() != info.slots.keys():
            return None
        names.append(name)
        rows.append(n)
        texts.append(t["ids"])
        texts += [slots[s] for s in info.slots]
    if not texts:
        return {}
    if set(map(type, texts)) != {str} or set(map(len, texts)) != {32}:
        return None
    joined = "".join(texts)
    if not _HEX_DIGITS.fullmatch(joined):
        return None
    lanes = np.frombuffer(bytes.fromhex(joined), dtype=">u8").tolist()
    out, k = {}, 0
    for name, n in zip(names, rows):
        slots = list(tables[name].slots)
        d = [Digest(lanes[2 * j], lanes[2 * j + 1]) for j in range(k, k + 1 + len(slots))]
        out[name] = TableDigest(slots, n, d[0], dict(zip(slots, d[1:])))
        k += 1 + len(slots)
    return out


__all__ = ["SlotLayouts", "table_info", "table_digests"]
