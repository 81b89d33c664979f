"""Content digests: what a checkpoint holds, per table, per slot and per dense tensor, in 128 bits that do
not depend on how it was written (world size, bucket count, segments, chunks, row order).

The engine (csrc/digest.h) sums one hash per (id, element position, element value) in two 64-bit
lanes; a sum is the same in any order and over any split of the rows, so each worker digests what it
writes and worker 0 adds the parts up. docs/FORMAT.md ("Content digests") specifies the arithmetic, and
tests/spec/independent_reader.py recomputes it in numpy. A digest is a fingerprint against accidental
differences (a single changed element always changes both lanes; two changes cancel in a lane with a
chance of about 2^-31, so 2^-62 in both), not a cryptographic one: anyone can craft rows with a given digest.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import _C
from . import dtypes

DIGEST_NAME = "mulsum128"    # the manifest's `digests.hash` this recckpt writes: the engine's function
#: Every `digests.hash` this recckpt reads. Digests of two functions are not comparable: `diff` then
#: reads rows (rowsum128, written before 2026-11-30, hashed every element with two 64-bit finalizers).
KNOWN_DIGESTS = ("rowsum128", DIGEST_NAME)
_MASK = (1 << 64) - 1
_HEX32 = re.compile(r"[0-9a-f]{32}")   # a manifest has one per table and slot: a regex, not a loop per digit


@dataclass(frozen=True)
class Digest:
    """Two 64-bit lane sums."""
    a: int = 0
    b: int = 0

    def __add__(self, other: "Digest") -> "Digest":
        return self.plus(other.a, other.b)

    def plus(self, a: int, b: int) -> "Digest":
        """This digest with lane sums `a`, `b` added (mod 2^64), as the engine returns them."""
        return Digest((self.a + a) & _MASK, (self.b + b) & _MASK)

    def hex(self) -> str:
        """32 lower-case hex digits: lane a then lane b, each most significant digit first."""
        return f"{self.a:016x}{self.b:016x}"

    @staticmethod
    def from_hex(text: str) -> "Digest":
        if not isinstance(text, str) or _HEX32.fullmatch(text) is None:
            raise ValueError(f"expected 32 lower-case hex digits, got {text!r:.40}")
        return Digest(int(text[:16], 16), int(text[16:], 16))


def _of(row: np.ndarray) -> Digest:
    return Digest(int(row[0]), int(row[1]))


@dataclass(frozen=True)
class SlotGeometry:
    """How to hash one slot's rows: element size, and which columns of the logical row's last dimension
    the rows hold (`first`, `width` of `full`; whole rows when `width == full`)."""
    row_bytes: int
    itemsize: int
    width: int
    full: int
    first: int = 0

    @staticmethod
    def whole(dtype: str, shape: tuple[int, ...]) -> "SlotGeometry":
        """Whole rows of a slot of `dtype` and row `shape`: the row is one run of its elements."""
        return _whole(dtype, tuple(shape))

    @staticmethod
    def columns(dtype: str, shape: tuple[int, ...], first: int, end: int) -> "SlotGeometry":
        """Columns [first, end) of the last dimension of rows of logical `shape` (a column-split slot:
        docs/FORMAT.md; the logical row's element e = block * shape[-1] + column)."""
        if not shape or not 0 <= first <= end <= shape[-1]:
            raise ValueError(f"columns [{first}, {end}) outside a row of shape {tuple(shape)}")
        size = dtypes.itemsize(dtype)
        blocks = int(np.prod(shape[:-1], dtype=np.int64))
        return SlotGeometry(size * blocks * (end - first), size, end - first, shape[-1], first)

    def spec(self) -> tuple[int, int, int, int, int]:
        return (self.row_bytes, self.itemsize, self.width, self.full, self.first)


@functools.lru_cache(maxsize=256)
def _whole(dtype: str, shape: tuple[int, ...]) -> SlotGeometry:
    """`SlotGeometry.whole`, once per slot layout (a thousand tables share a few)."""
    size = dtypes.itemsize(dtype)
    elems = math.prod(shape)
    return SlotGeometry(size * elems, size, elems, elems)


@dataclass
class TableDigest:
    """Accumulates a table's digests over the rows of any number of chunks (a worker's share, or a sum
    of workers' shares)."""
    slots: list[str]
    rows: int = 0
    ids: Digest = Digest()
    slot_digests: dict[str, Digest] = field(default_factory=dict)
    geometry: list[SlotGeometry] | None = None   # how `update` reads each slot's rows
    count_ids: bool = True        # False: `update` adds only the slots in `counted` (another block's rows)
    counted: frozenset[str] | None = None   # the slots `update` adds (None: all)
    _plan_cache: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for s in self.slots:
            self.slot_digests.setdefault(s, Digest())

    @staticmethod
    def for_slots(slots: dict, windows: dict[str, tuple[int, int]] | None = None) -> "TableDigest":
        """An empty digest of a table whose slots are `slots` (name -> SlotInfo, column order); `windows`
        names the column-split slots whose rows hold only columns [first, end) of the last dimension."""
        windows = windows or {}
        geo = [SlotGeometry.columns(i.dtype, i.shape, *windows[s]) if s in windows
               else SlotGeometry.whole(i.dtype, i.shape) for s, i in slots.items()]
        return TableDigest(list(slots), geometry=geo)

    @staticmethod
    def for_block(slots: dict, split: tuple[str, ...], blocks: tuple[tuple[int, int], ...], block: int
                  ) -> "TableDigest":
        """An empty digest of the chunks of column block `block` of a table saved column-split
        (docs/FORMAT.md "Column blocks"): the split slots' columns [c0, c1) of their last dimension D;
        block 0 also counts the ids and the unsplit slots, which every block repeats."""
        d_full = blocks[-1][1]
        c0, c1 = blocks[block]
        geo = []
        for s, i in slots.items():
            if s in split:
                geo.append(SlotGeometry.columns(i.dtype, (*tuple(i.shape)[:-1], d_full), c0, c1))
            else:
                geo.append(SlotGeometry.whole(i.dtype, i.shape))
        return TableDigest(list(slots), geometry=geo, count_ids=block == 0,
                           counted=None if block == 0 else frozenset(split))

    def update(self, ids: np.ndarray, cols: list[np.ndarray], threads: int = 1) -> None:
        """Add rows: `ids` int64[n] and per slot (in `slots` order) its n rows as bytes."""
        if len(ids):
            TableDigest.update_many([(self, ids, cols)], threads)

    @staticmethod
    def update_many(items: list[tuple["TableDigest", np.ndarray, list[np.ndarray]]], threads: int = 1) -> None:
        """`update` of each (digest, ids, cols) of `items`, in one engine call (a chunk of each of many
        small tables: one call, not one per table)."""
        jobs, todo = [], []
        for d, ids, cols in items:
            use, specs = d._plan()
            if not len(ids):
                continue
            jobs.append((np.ascontiguousarray(ids, dtype=np.int64), [np.ascontiguousarray(cols[k]) for k in use],
                         specs))
            todo.append((d, len(ids), use))
        if not jobs:
            return
        out = _C.row_digests_many(jobs, threads).tolist()
        at = 0
        for d, n, use in todo:
            if d.count_ids:
                d.rows += n
                d.ids = d.ids.plus(*out[at])
            sums = d.slot_digests
            for j, k in enumerate(use, 1):
                s = d.slots[k]
                sums[s] = sums[s].plus(*out[at + j])
            at += 1 + len(use)

    def _plan(self) -> tuple[list[int], list[tuple]]:
        """The slots (positions) `update` adds and the engine's spec of each: worked out once, as a save
        digests each of a thousand tables' chunks."""
        if self._plan_cache is None:
            if self.geometry is None or len(self.geometry) != len(self.slots):
                raise ValueError("TableDigest.update needs one SlotGeometry per slot (TableDigest.for_slots)")
            use = [k for k, s in enumerate(self.slots) if self.counted is None or s in self.counted]
            self._plan_cache = (use, [self.geometry[k].spec() for k in use])
        return self._plan_cache

    def __add__(self, other: "TableDigest") -> "TableDigest":
        if self.slots != other.slots:
            raise ValueError(f"digests of different slots {self.slots} vs {other.slots}")
        return TableDigest(list(self.slots), self.rows + other.rows, self.ids + other.ids,
                           {s: self.slot_digests[s] + other.slot_digests[s] for s in self.slots})

    @staticmethod
    def total(slots: list[str], parts: list["TableDigest"]) -> "TableDigest":
        """A plain digest (no reading plan) of the sum of `parts`, each of `slots`: a table's over the
        workers that wrote it. One part is taken as it is: adding it to zero would build every digest
        again (a thousand tables of one worker)."""
        if len(parts) == 1:
            d = parts[0]
            if d.slots != list(slots):
                raise ValueError(f"digests of different slots {list(slots)} vs {d.slots}")
            return TableDigest(list(slots), d.rows, d.ids, dict(d.slot_digests))
        out = TableDigest(list(slots))
        for d in parts:
            out = out + d
        return out

    def to_json(self) -> dict:
        return {"rows": self.rows, "ids": self.ids.hex(),
                "slots": {s: self.slot_digests[s].hex() for s in self.slots}}

    @staticmethod
    def from_json(obj: dict, slots: list[str]) -> "TableDigest":
        """Parse (no validation beyond the hex digits and slot names: manifest_parse validates manifests)."""
        got = obj["slots"]
        if set(got) != set(slots):
            raise ValueError(f"digest slots {sorted(got)} differ from the table's {sorted(slots)}")
        return TableDigest(list(slots), int(obj["rows"]), Digest.from_hex(obj["ids"]),
                           {s: Digest.from_hex(got[s]) for s in slots})


class ParsedTableDigests(Mapping):
    """A manifest's table digests, checked already (manifest_parse), each built as a TableDigest when first
    asked for: opening a checkpoint of a thousand tables to load it builds none (only `diff`, `verify`'s
    digest check and re-serialisation use them). `parts`: name -> (slots in column order, rows, the flat
    lane values of the ids then each slot: 2 ints a digest)."""

    def __init__(self, parts: dict[str, tuple[list[str], int, list[int]]]):
        self._parts, self._made = parts, {}

    def __getitem__(self, name: str) -> TableDigest:
        d = self._made.get(name)
        if d is None:
            slots, rows, lanes = self._parts[name]
            ds = [Digest(lanes[2 * j], lanes[2 * j + 1]) for j in range(1 + len(slots))]
            d = self._made[name] = TableDigest(list(slots), rows, ds[0], dict(zip(slots, ds[1:])))
        return d

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, name) -> bool:
        return name in self._parts


@dataclass(frozen=True)
class DenseDigest:
    """One dense tensor: its dtype, shape and the digest of its bytes (docs/FORMAT.md)."""
    dtype: str
    shape: tuple[int, ...]
    digest: Digest

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "digest": self.digest.hex()}


def dense_digest(dtype: str, shape: tuple[int, ...], data, threads: int = 1) -> DenseDigest:
    """The digest of a tensor whose little-endian bytes are `data`: its elements as one row of id 0."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    g = SlotGeometry.whole(dtype, tuple(shape))
    if raw.size != g.row_bytes:
        raise ValueError(f"{raw.size} bytes for a {dtype} tensor of shape {tuple(shape)}")
    out = _C.row_digests(np.zeros(1, dtype=np.int64), [raw], [g.spec()], threads)
    return DenseDigest(dtype, tuple(shape), _of(out[1]))


@dataclass
class Digests:
    """The manifest's `digests`: tables whose whole content this checkpoint records (an incremental
    checkpoint has none for tables saved as changes), and dense tensors."""
    tables: Mapping[str, TableDigest] = field(default_factory=dict)   # (ParsedTableDigests when read)
    dense: dict[str, DenseDigest] | None = None   # None: not recorded (only sparse digests known)
    hash: str = DIGEST_NAME   # the function (KNOWN_DIGESTS); only digests of one function compare

    def to_json(self) -> dict:
        out = {"hash": self.hash, "tables": {k: v.to_json() for k, v in self.tables.items()}}
        if self.dense is not None:
            out["dense"] = {k: v.to_json() for k, v in self.dense.items()}
        return out


__all__ = ["DIGEST_NAME", "KNOWN_DIGESTS", "Digest", "DenseDigest", "Digests", "ParsedTableDigests", "SlotGeometry", "TableDigest",
           "dense_digest"]
