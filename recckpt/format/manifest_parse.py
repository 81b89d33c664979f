"""A manifest read back: validated field by field (docs/FORMAT.md), tables in the common form at once.
Raises CorruptCheckpointError naming the file and the field."""
from __future__ import annotations

import re

import numpy as np

from ..errors import IncompatibleCheckpointError
from . import dtypes
from .digest import KNOWN_DIGESTS, DenseDigest, Digest, Digests, ParsedTableDigests, TableDigest
from .field_checks import I63, U32, Fields
from .hashing import HASH_NAME, NUM_BUCKETS_LIMIT
from .names import (
    COLUMN_GROUPS_SINCE,
    FORMAT_NAME,
    INCREMENTAL_SINCE,
    READABLE_FORMAT_VERSIONS,
    SEGMENT_DIR_SINCE,
    validate_ckpt_id,
)
from .schema import (
    BUCKET_FNS,
    CATEGORIES,
    MAX_ROW_RANGE_ROWS,
    ColumnBlocks,
    ColumnGroups,
    FileInfo,
    Manifest,
    ParentRef,
    SlotInfo,
    TableInfo,
)


def manifest_from_json(obj: dict, path: str) -> Manifest:
    """A manifest, validated (tables in the common form through `_table_info_fast`: the same rules, checked
    once per distinct slot layout)."""
    v = Fields(path)
    if v.get(obj, "format", "") != FORMAT_NAME:
        v.fail("format", f"expected {FORMAT_NAME!r}; this is not a recckpt checkpoint")
    ver = v.int(v.get(obj, "format_version", ""), "format_version")
    if ver not in READABLE_FORMAT_VERSIONS:
        raise IncompatibleCheckpointError(
            f"{path}: format version {ver} is not supported by this recckpt (reads versions "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}); upgrade recckpt to load it")
    for key, want in (("hash", HASH_NAME), ("checksum", "crc32c")):
        if v.get(obj, key, "") != want:
            v.fail(key, f"expected {want!r}")
    tables, layouts = {}, _SlotLayouts()
    for name, t in v.dict(v.get(obj, "tables", ""), "tables").items():
        info = _table_info_fast(name, t, ver, layouts)   # the common form, or None: the rules
        tables[name] = info if info is not None else _table_from_json(v, name, t, ver)
    files = {}
    for rel, f in v.dict(v.get(obj, "files", ""), "files").items():
        v.relpath(rel, "files")
        files[rel] = FileInfo(v.int(v.get(f, "size", f"files[{rel!r}]"), f"files[{rel!r}].size"),
                              v.int(v.get(f, "crc32c", f"files[{rel!r}]"), f"files[{rel!r}].crc32c", 0, U32))
    io_state = {}
    for w, rel in v.dict(v.get(obj, "io_state", ""), "io_state").items():
        io_state[v.worker_key(w, "io_state")] = v.relpath(rel, f"io_state[{w}]")
    meta = v.dict(obj.get("metadata", {}), "metadata")
    worker_steps = {}
    for w, st in v.dict(obj.get("worker_steps", {}), "worker_steps").items():
        worker_steps[v.worker_key(w, "worker_steps")] = v.int(st, f"worker_steps[{w}]", -I63, I63)
    parent = None
    if obj.get("parent") is not None:
        p = v.dict(obj["parent"], "parent")
        pid = v.str(v.get(p, "ckpt_id", "parent"), "parent.ckpt_id")
        try:
            validate_ckpt_id(pid)
        except ValueError as e:
            v.fail("parent.ckpt_id", str(e))
        digest = v.str(v.get(p, "manifest_sha256", "parent"), "parent.manifest_sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            v.fail("parent.manifest_sha256", "expected 64 lower-case hex digits")
        if ver < INCREMENTAL_SINCE:
            v.fail("parent", f"format version {ver} has no incremental checkpoints")
        parent = ParentRef(pid, digest)
    elif any(t.changes for t in tables.values()):
        v.fail("tables", "a table holds only changes but the checkpoint names no parent")
    m = Manifest(
        ckpt_id=v.str(v.get(obj, "ckpt_id", ""), "ckpt_id"),
        created_ns=v.int(v.get(obj, "created_ns", ""), "created_ns"),
        writer=v.str(v.get(obj, "writer", ""), "writer"),
        num_buckets=v.int(v.get(obj, "num_buckets", ""), "num_buckets", 1, NUM_BUCKETS_LIMIT),
        chunk_bytes=v.int(v.get(obj, "chunk_bytes", ""), "chunk_bytes", 1, 1 << 31),
        shard_num=v.int(v.get(obj, "shard_num", ""), "shard_num", 1, 1 << 20),
        tables=tables, files=files,
        index=v.opt_relpath(v.get(obj, "index", ""), "index"),
        dense=v.opt_relpath(v.get(obj, "dense", ""), "dense"),
        extras=v.opt_relpath(v.get(obj, "extras", ""), "extras"),
        io_state=io_state,
        metadata={v.str(k, "metadata"): v.str(x, f"metadata[{k!r}]") for k, x in meta.items()},
        worker_steps=worker_steps,
        format_version=ver,
        parent=parent,
    )
    for where, workers in (("io_state", m.io_state), ("worker_steps", m.worker_steps)):
        beyond = [w for w in workers if w >= m.shard_num]
        if beyond:
            v.fail(where, f"worker {beyond[0]} of a checkpoint of shard_num {m.shard_num} (workers 0..{m.shard_num - 1})")
    try:
        validate_ckpt_id(m.ckpt_id)
    except ValueError as e:
        v.fail("ckpt_id", str(e))
    for rel in [m.index, m.dense, m.extras, *m.io_state.values()]:
        if rel is not None and rel not in m.files:
            v.fail("files", f"{rel!r} is referenced but has no size/checksum entry")
    if tables and m.index is None:
        v.fail("index", "the checkpoint has sparse tables but no index")
    if obj.get("digests") is not None:
        m.digests = _digests_from_json(v, v.dict(obj["digests"], "digests"), tables)
    if obj.get("shard_bytes") is not None:
        m.shard_bytes = v.int(obj["shard_bytes"], "shard_bytes")
    return m


def _table_from_json(v: Fields, name, t, ver: int) -> TableInfo:
    """One table of a manifest, field by field."""
    where = f"tables[{name!r}]"
    slots = {}
    for i, pair in enumerate(v.list(v.get(t, "slots", where), f"{where}.slots")):
        if not (isinstance(pair, list) and len(pair) == 2):
            v.fail(f"{where}.slots[{i}]", "expected [name, spec]")
        sname, spec = v.str(pair[0], f"{where}.slots[{i}]"), v.dict(pair[1], f"{where}.slots[{i}]")
        dt = v.get(spec, "dtype", f"{where}.{sname}")
        if dt not in dtypes.names():
            v.fail(f"{where}.{sname}.dtype", f"unknown dtype {dt!r:.40}")
        shape = tuple(v.int(d, f"{where}.{sname}.shape", 0, 1 << 31)
                      for d in v.list(v.get(spec, "shape", f"{where}.{sname}"), f"{where}.{sname}.shape"))
        if len(shape) > 8:
            v.fail(f"{where}.{sname}.shape", "more than 8 dimensions")
        cat = v.get(spec, "category", f"{where}.{sname}")
        if cat not in CATEGORIES:
            v.fail(f"{where}.{sname}.category", f"expected one of {CATEGORIES}")
        if sname in slots:
            v.fail(f"{where}.slots", f"slot {sname!r} listed twice")
        slots[sname] = SlotInfo(dt, shape, cat)
    changes = t.get("changes", False)
    if changes is not False and changes is not True:
        v.fail(f"{where}.changes", "expected true or false")
    removed = v.int(t.get("removed", 0), f"{where}.removed")
    if removed and not changes:
        v.fail(f"{where}.removed", "removed ids in a table that is not saved as changes")
    bucket_fn, num_rows, blocks, input_size = _table_v4_fields(v, t, where, ver, slots)
    groups = _column_groups(v, t, where, ver, slots, bucket_fn, blocks)
    info = TableInfo(slots, v.int(v.get(t, "rows", where), f"{where}.rows"), changes, removed, bucket_fn,
                     num_rows, blocks, input_size, groups)
    v.str(name, "tables")
    return info


def _digests_from_json(v: Fields, d: dict, tables: dict[str, TableInfo]) -> Digests | None:
    """The manifest's `digests`; None when they use an algorithm this recckpt does not know (a newer
    writer's: the checkpoint stays readable, its contents are just not comparable by digest)."""
    name = v.str(v.get(d, "hash", "digests"), "digests.hash")
    if name not in KNOWN_DIGESTS:
        return None

    def hex_(x, where):
        try:
            return Digest.from_hex(x)
        except ValueError as e:
            v.fail(where, str(e))

    out = Digests(hash=name)
    raw = v.dict(v.get(d, "tables", "digests"), "digests.tables")
    fast = _table_digests_fast(raw, tables)   # the common form, or None: the rules below
    for name, t in raw.items() if fast is None else ():
        where = f"digests.tables[{name!r}]"
        info = tables.get(name)
        if info is None:
            v.fail(where, "no such table in the manifest")
        rows = v.int(v.get(t, "rows", where), f"{where}.rows")
        if not info.changes and rows != info.rows:
            v.fail(f"{where}.rows", f"{rows}, but the table holds {info.rows} rows")
        slots = v.dict(v.get(t, "slots", where), f"{where}.slots")
        if set(slots) != set(info.slots):   # an object: its keys are stored sorted, not in column order
            v.fail(f"{where}.slots", f"{sorted(slots)} differ from the table's slots {sorted(info.slots)}")
        out.tables[name] = TableDigest(list(info.slots), rows, hex_(v.get(t, "ids", where), f"{where}.ids"),
                                       {s: hex_(slots[s], f"{where}.slots[{s!r}]") for s in info.slots})
    if fast is not None:
        out.tables = fast
    if "dense" in d:
        out.dense = {}
        for key, e in v.dict(d["dense"], "digests.dense").items():
            where = f"digests.dense[{key!r}]"
            dt = v.get(e, "dtype", where)
            if dt not in dtypes.names():
                v.fail(f"{where}.dtype", f"unknown dtype {dt!r:.40}")
            shape = tuple(v.int(x, f"{where}.shape", 0, I63) for x in v.list(v.get(e, "shape", where), f"{where}.shape"))
            out.dense[v.str(key, "digests.dense")] = DenseDigest(dt, shape, hex_(v.get(e, "digest", where),
                                                                                f"{where}.digest"))
    return out


def _table_v4_fields(v: Fields, t: dict, where: str, ver: int, slots: dict[str, SlotInfo]):
    """A manifest table's version 4 fields: (bucket_fn, num_rows, column_blocks, input_size)."""
    if ver < SEGMENT_DIR_SINCE:
        for key in ("bucket_fn", "num_rows", "column_blocks", "input_size"):
            if key in t:
                v.fail(f"{where}.{key}", f"not a field of format version {ver}")
        return "hash", 0, None, 0
    fn = v.get(t, "bucket_fn", where)
    if fn not in BUCKET_FNS:
        v.fail(f"{where}.bucket_fn", f"expected one of {BUCKET_FNS}, got {fn!r:.40}")
    num_rows = 0
    if fn == "row_range":
        num_rows = v.int(v.get(t, "num_rows", where), f"{where}.num_rows", 1, MAX_ROW_RANGE_ROWS)
    elif "num_rows" in t:
        v.fail(f"{where}.num_rows", "only a row_range table has num_rows")
    input_size = 0
    if fn == "id_range":
        input_size = v.int(v.get(t, "input_size", where), f"{where}.input_size", 1, I63)
    elif "input_size" in t:
        v.fail(f"{where}.input_size", "only an id_range table has input_size")
    if fn == "id_range" and "column_blocks" in t:
        v.fail(f"{where}.column_blocks", "an id_range table is not saved column-split")
    blocks = None
    if "column_blocks" in t:
        cw = f"{where}.column_blocks"
        cb = v.dict(t["column_blocks"], cw)
        names = [v.str(x, f"{cw}.slots") for x in v.list(v.get(cb, "slots", cw), f"{cw}.slots")]
        if not names or len(set(names)) != len(names) or any(n not in slots for n in names):
            v.fail(f"{cw}.slots", "expected distinct slots of the table, at least one")
        dims = {slots[n].shape[-1] if slots[n].shape else None for n in names}
        if len(dims) != 1 or None in dims:
            v.fail(f"{cw}.slots", "split slots need a shape of at least one dim and the same last dim")
        d = dims.pop()
        out, pos = [], 0
        for i, b in enumerate(v.list(v.get(cb, "blocks", cw), f"{cw}.blocks")):
            if not (isinstance(b, list) and len(b) == 2):
                v.fail(f"{cw}.blocks[{i}]", "expected [c0, c1]")
            c0, c1 = v.int(b[0], f"{cw}.blocks[{i}]"), v.int(b[1], f"{cw}.blocks[{i}]")
            if c0 != pos or c1 <= c0:
                v.fail(f"{cw}.blocks[{i}]", f"[{c0}, {c1}): blocks must be sorted, non-empty and contiguous from 0")
            out.append((c0, c1))
            pos = c1
        if pos != d or not out:
            v.fail(f"{cw}.blocks", f"blocks must partition [0, {d}) of the split slots' last dim")
        blocks = ColumnBlocks(tuple(names), tuple(out))
    return fn, num_rows, blocks, input_size


def _column_groups(v: Fields, t: dict, where: str, ver: int, slots: dict[str, SlotInfo], bucket_fn: str,
                   blocks: ColumnBlocks | None) -> ColumnGroups | None:
    """A manifest table's version 5 `column_groups`, validated (docs/FORMAT.md, Column groups)."""
    if "column_groups" not in t:
        return None
    cw = f"{where}.column_groups"
    if ver < COLUMN_GROUPS_SINCE:
        v.fail(cw, f"not a field of format version {ver}")
    if bucket_fn != "row_range":
        v.fail(cw, "only a row_range table stores column groups")
    cg = v.dict(t["column_groups"], cw)
    extra = set(cg) - {"slots", "width"}
    if extra:
        v.fail(cw, f"unknown fields {sorted(extra)!r:.80}")
    names = [v.str(x, f"{cw}.slots") for x in v.list(v.get(cg, "slots", cw), f"{cw}.slots")]
    if not names or len(set(names)) != len(names) or any(n not in slots for n in names):
        v.fail(f"{cw}.slots", "expected distinct slots of the table, at least one")
    dims = {slots[n].shape for n in names}
    if len(dims) != 1 or len(next(iter(dims))) != 1 or next(iter(dims))[0] < 1:
        v.fail(f"{cw}.slots", "grouped slots need the same shape (D,) with D >= 1")
    d = next(iter(dims))[0]
    width = v.int(v.get(cg, "width", cw), f"{cw}.width", 1, d + 1)
    if blocks is not None and tuple(blocks.slots) != tuple(names):
        v.fail(cw, f"slots {names} differ from column_blocks' {list(blocks.slots)}: a table splits one set of slots")
    return ColumnGroups(tuple(names), width)


# ------------------------------------------------------------ manifest tables in the common form, at once
# A manifest's tables and digests read with the rules checked once per distinct slot layout.
#
# A model of a thousand tables repeats a handful of slot layouts (dim and optimizer) a thousand times; the
# field-by-field rules of `_table_from_json` cost a few dozen calls per table. Here a table in
# the common form (known keys only, `hash` buckets) is read in a few dict lookups, its slots checked once
# per distinct layout, and anything else is answered None, so that the caller applies the rules to that
# table (they find and word any problem, in the same order as before: every table accepted here, those
# rules accept too).
#: The keys of a table read here: any other (a newer format's, or column blocks, row or id
#: ranges) goes through the full rules.
_PLAIN = frozenset({"slots", "rows", "bucket_fn"})
_CHANGES = _PLAIN | {"changes", "removed"}
_DTYPES = frozenset(dtypes.names())
_HEX_LOWER = re.compile(r"[0-9a-f]*")   # (digest.Digest.from_hex's rule, for many digests at once)


class _SlotLayouts:
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


def _table_info_fast(name, t, version: int, layouts: _SlotLayouts) -> TableInfo | None:
    """A version 4 manifest table in the common form, or None (the full rules then read it)."""
    if type(t) is not dict or type(name) is not str or "\x00" in name or version < SEGMENT_DIR_SINCE:
        return None
    keys = t.keys()
    if not (keys == _PLAIN or keys <= _CHANGES and _PLAIN <= keys) or t["bucket_fn"] != "hash":
        return None
    rows, changes, removed = t["rows"], t.get("changes", False), t.get("removed", 0)
    if type(rows) is not int or not 0 <= rows < I63 or (changes is not True and changes is not False) \
            or type(removed) is not int or not 0 <= removed < I63 or (removed and not changes):
        return None
    slots = layouts.slots(t["slots"])
    return None if slots is None else TableInfo(slots, rows, changes, removed)


def _table_digests_fast(raw: dict, tables: dict[str, TableInfo]) -> ParsedTableDigests | None:
    """Every table's entry of the manifest's `digests.tables` (`raw`, a dict) in the common form, their
    hex digits checked and decoded at once; None where any entry needs the full rules."""
    names, rows, texts = [], [], []
    for name, t in raw.items():
        info = tables.get(name)
        if info is None or type(t) is not dict or t.keys() != {"rows", "ids", "slots"}:
            return None
        n, slots = t["rows"], t["slots"]
        if type(n) is not int or not 0 <= n < I63 or (not info.changes and n != info.rows) \
                or type(slots) is not dict or slots.keys() != info.slots.keys():
            return None
        names.append(name)
        rows.append(n)
        texts.append(t["ids"])
        texts += [slots[s] for s in info.slots]
    if not texts:
        return ParsedTableDigests({})
    if set(map(type, texts)) != {str} or set(map(len, texts)) != {32}:
        return None
    joined = "".join(texts)
    if not _HEX_LOWER.fullmatch(joined):
        return None
    lanes = np.frombuffer(bytes.fromhex(joined), dtype=">u8").tolist()
    parts, k = {}, 0
    for name, n in zip(names, rows):
        slots = list(tables[name].slots)
        parts[name] = (slots, n, lanes[2 * k:2 * (k + 1 + len(slots))])
        k += 1 + len(slots)
    return ParsedTableDigests(parts)
