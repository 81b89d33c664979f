"""An independent reader of the recckpt on-disk format, written only from docs/FORMAT.md.

It uses nothing but the standard library and numpy: no torch, no recckpt, no safetensors package
(the safetensors container is parsed by hand).  Its purpose is to prove that docs/FORMAT.md is a
complete contract: if this module can read and fully verify a checkpoint written by the library,
the specification says enough.  Places where the specification left a choice open are marked
``SPEC-GUESS`` below.

Value conventions
-----------------
* Sparse rows and dense tensors are returned as numpy arrays of the on-disk dtype, except BF16,
  which numpy lacks: a BF16 array is returned as float32 whose upper 16 bits are the stored
  bfloat16 bits and whose lower 16 bits are zero (an exact widening).  ``bf16_bits(a)`` turns it
  back into the raw uint16 bit patterns; pass ``bf16="bits"`` to the readers to get those directly.
* In state trees, ``{"__tensor__": k}`` decodes to a :class:`TensorValue` (an ndarray subclass, so
  it can be told apart from ``{"__ndarray__": k}``, which decodes to a plain ndarray), and
  ``{"__dtype__": name}`` to a :class:`DTypeName`.

Every violation raises :class:`FormatError` (subclasses mirror the spec's error table).
"""
from __future__ import annotations

import base64
import collections
import hashlib
import json
import math
import os
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = [
    "FormatError", "CorruptError", "IncompatibleError", "NotFoundError",
    "crc32c", "crc32c_chunks", "mix64", "bucket_of", "owner_range", "bf16_bits",
    "read_checked_json", "canonical_json", "list_committed", "read_manifest", "read_checkpoint",
    "read_bucket_range", "read_safetensors", "decode_tree", "TensorValue", "DTypeName", "read_index",
    "segment_offsets", "table_bucket_of",
]


# ----------------------------------------------------------------------------------------- errors

class FormatError(Exception):
    """Any violation of docs/FORMAT.md."""


class CorruptError(FormatError):
    """Checksum/size mismatch, truncated or missing file, bad field, bad offsets (CorruptCheckpointError)."""


class IncompatibleError(FormatError):
    """Unknown format_version (IncompatibleCheckpointError)."""


class NotFoundError(FormatError):
    """No committed checkpoint / unknown id / no manifest (CheckpointNotFoundError)."""


def _fail(where: str, msg: str, cls=CorruptError):
    raise cls(f"{where}: {msg}")


# ------------------------------------------------------------------------------------------- CRC

_POLY = 0x82F63B78


def _make_table() -> List[int]:
    t = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t.append(c)
    return t


_TABLE = _make_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)


def _as_u8(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(bytes(data), dtype=np.uint8)


def _crc_scalar(buf: np.ndarray, crc: int = 0) -> int:
    """Plain table-driven CRC-32C (the reference implementation)."""
    c = crc ^ 0xFFFFFFFF
    t = _TABLE
    for b in buf.tobytes():
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _crc_lanes(mat: np.ndarray) -> np.ndarray:
    """CRC-32C of every row of a 2-D uint8 array, all rows in parallel (one numpy step per column)."""
    reg = np.full(mat.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    cols = np.ascontiguousarray(mat.T)
    for k in range(cols.shape[0]):
        reg = _TABLE_NP[(reg ^ cols[k]) & 0xFF] ^ (reg >> np.uint32(8))
    return reg ^ np.uint32(0xFFFFFFFF)


# GF(2) helpers to combine CRCs (zlib's crc32_combine, with the Castagnoli polynomial):
#   crc(A || B) = shift(crc(A), len(B)) ^ crc(B)
def _gf2_times(mat: List[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: List[int]) -> List[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zeros_operator(nbytes: int) -> List[int]:
    """Matrix that advances a CRC register over `nbytes` zero bytes."""
    op = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    op = _gf2_square(op)  # 2 bits
    op = _gf2_square(op)  # 4 bits
    op = _gf2_square(op)  # 8 bits = 1 byte
    n = nbytes
    while n:
        if n & 1:
            result = [_gf2_times(op, result[k]) for k in range(32)]
        n >>= 1
        if n:
            op = _gf2_square(op)
    return result


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    if len2 == 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def crc32c(data, value: int = 0) -> int:
    """CRC-32C of `data` (bytes-like or ndarray, read as raw bytes), continuing from `value`.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``.  Large inputs are split into lanes whose CRCs are
    computed in parallel with numpy and then combined.
    """
    buf = _as_u8(data)
    n = buf.size
    if n < 4096:
        return _crc_scalar(buf, value)
    m = max(256, int(math.isqrt(n)) * 2)  # lane length
    lanes = n // m
    body = buf[: lanes * m].reshape(lanes, m)
    lane_crcs = _crc_lanes(body)
    op = _zeros_operator(m)
    crc = value
    for lc in lane_crcs.tolist():
        crc = _gf2_times(op, crc) ^ lc
    tail = buf[lanes * m:]
    return _crc_scalar(tail, crc) if tail.size else crc


def crc32c_chunks(data, chunk: int) -> List[int]:
    """[crc32c(data[j*chunk:(j+1)*chunk]) for j in range(ceil(len/chunk))]."""
    buf = _as_u8(data)
    n = buf.size
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    nfull = n // chunk
    out: List[int] = []
    if nfull >= 32 and chunk <= 1 << 16:
        out.extend(_crc_lanes(buf[: nfull * chunk].reshape(nfull, chunk)).tolist())
    else:
        out.extend(crc32c(buf[j * chunk:(j + 1) * chunk]) for j in range(nfull))
    if n > nfull * chunk:
        out.append(crc32c(buf[nfull * chunk:]))
    return out


# --------------------------------------------------------------------------------------- hashing

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def mix64(ids) -> np.ndarray:
    """splitmix64 finaliser of the ids' bits as uint64 (wrapping arithmetic)."""
    x = np.asarray(ids)
    if x.dtype != np.uint64:
        x = x.astype(np.int64, copy=False).view(np.uint64) if x.dtype.kind in "iu" else None
        if x is None:
            raise TypeError("ids must be integers")
    with np.errstate(over="ignore"):
        z = x + _M1
        z = (z ^ (z >> np.uint64(30))) * _M2
        z = (z ^ (z >> np.uint64(27))) * _M3
        z = z ^ (z >> np.uint64(31))
    return z


def bucket_of(ids, num_buckets: int) -> np.ndarray:
    return (mix64(ids) % np.uint64(num_buckets)).astype(np.int64)


def owner_range(rank: int, world: int, num_buckets: int) -> Tuple[int, int]:
    """Buckets [lo, hi) owned by rank r of W."""
    return (rank * num_buckets) // world, ((rank + 1) * num_buckets) // world


# ---------------------------------------------------------------------------------------- dtypes

# name -> (numpy dtype of the raw element, itemsize)
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("u1"),
}
# safetensors allows more dtypes than sparse slots do (dense state_dicts may hold them)
_ST_EXTRA = {"U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8")}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bit patterns (uint16) of a float32 array returned for a BF16 column."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _decode_elements(raw: np.ndarray, name: str, shape, where: str, bf16: str) -> np.ndarray:
    """raw: uint8 bytes -> array of `shape` with the dtype's meaning."""
    dt = _DTYPES.get(name) or _ST_EXTRA.get(name)
    if dt is None:
        _fail(where, f"unsupported dtype {name!r}")
    arr = raw.view(dt).reshape(shape)
    if name == "BF16":
        if bf16 == "bits":
            return arr.copy()
        return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if name == "BOOL":
        if arr.size and arr.max() > 1:
            _fail(where, "BOOL element that is neither 0 nor 1")
        return arr.astype(np.bool_)
    return arr.astype(dt.newbyteorder("="), copy=True)


# ---------------------------------------------------------------------------------- small checks

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _req(obj: dict, key: str, typ, where: str):
    if not isinstance(obj, dict):
        _fail(where, f"expected an object, got {type(obj).__name__}")
    if key not in obj:
        _fail(where, f"field {key!r} missing")
    v = obj[key]
    ok = _is_int(v) if typ is int else isinstance(v, typ)
    if not ok:
        _fail(where, f"field {key!r} has type {type(v).__name__}, expected {getattr(typ, '__name__', typ)}")
    return v


def _nonneg(v: int, what: str, where: str) -> int:
    if v < 0:
        _fail(where, f"{what} is negative ({v})")
    return v


_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}")


def valid_ckpt_id(s: str) -> bool:
    return isinstance(s, str) and _ID_RE.fullmatch(s) is not None and ".." not in s


def _check_relpath(p, where: str) -> str:
    if not isinstance(p, str) or not p:
        _fail(where, f"path {p!r} is not a non-empty string")
    if p.startswith("/") or "\\" in p or "\x00" in p:
        _fail(where, f"path {p!r} is absolute or contains a backslash/NUL")
    parts = p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        _fail(where, f"path {p!r} is not normalised or leaves the checkpoint")
    return p


# ----------------------------------------------------------------------------------- checked JSON

MANIFEST_LIMIT = 64 << 20
INDEX_LIMIT = 1 << 30


def _reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def _reject_float(s):
    raise ValueError(f"floating-point number {s} in a checked JSON file")


def canonical_json(obj) -> bytes:
    """Keys sorted, separators ',' ':' without whitespace, ASCII with \\uXXXX escapes."""
    # SPEC-GUESS: the spec does not say how characters are escaped beyond "\\uXXXX"; we assume
    # exactly Python's json.dumps(ensure_ascii=True): short escapes \" \\ \n \r \t \b \f, other
    # control characters and every non-ASCII character as lowercase \\u00XX, astral characters as
    # surrogate pairs, '/' not escaped.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def read_checked_json(path: str, limit: int = INDEX_LIMIT, _counter: Optional[list] = None) -> dict:
    where = str(path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        _fail(where, "missing", NotFoundError if os.path.basename(path) == "manifest.json" else CorruptError)
    if size > limit:
        _fail(where, f"checked JSON file of {size} bytes exceeds the {limit}-byte limit")
    with open(path, "rb") as f:
        raw = f.read()
    if _counter is not None:
        _counter[0] += len(raw)
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_reject_float)
    except (UnicodeDecodeError, ValueError) as e:
        _fail(where, f"not valid checked JSON: {e}")
    if not isinstance(obj, dict):
        _fail(where, "top level is not an object")
    stored = _req(obj, "crc32c", int, where)
    body = {k: v for k, v in obj.items() if k != "crc32c"}
    actual = crc32c(canonical_json(body))
    if stored != actual:
        _fail(where, f"self-checksum mismatch: stored {stored:#010x}, canonical form has {actual:#010x}")
    return body


# ------------------------------------------------------------------------------------ manifest

READABLE = (1, 2, 3, 4, 5)

_MANIFEST_FIELDS = {
    "format": str, "format_version": int, "ckpt_id": str, "created_ns": int, "writer": str,
    "num_buckets": int, "hash": str, "checksum": str, "chunk_bytes": int, "shard_num": int,
    "tables": dict, "files": dict, "io_state": dict, "metadata": dict,
}


def _validate_slot_spec(spec, where: str) -> dict:
    dtype = _req(spec, "dtype", str, where)
    if dtype not in _DTYPES:
        _fail(where, f"unknown dtype {dtype!r}")
    shape = _req(spec, "shape", list, where)
    if len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
        _fail(where, f"bad row shape {shape!r}")
    cat = _req(spec, "category", str, where)
    if cat not in ("sparse", "sparse_opt"):
        _fail(where, f"bad category {cat!r}")
    return {"dtype": dtype, "shape": tuple(shape), "category": cat}


def validate_manifest(m: dict, where: str) -> dict:
    # format_version first, so a newer writer's different layout is reported as incompatible
    fv = _req(m, "format_version", int, where)
    if fv not in READABLE:
        _fail(where, f"unknown format_version {fv}", IncompatibleError)
    for k, t in _MANIFEST_FIELDS.items():
        _req(m, k, t, where)
    for k in ("index", "dense", "extras"):
        if k not in m:
            _fail(where, f"field {k!r} missing")
        if m[k] is not None and not isinstance(m[k], str):
            _fail(where, f"field {k!r} is neither a string nor null")
    if m["format"] != "recckpt":
        _fail(where, f"format is {m['format']!r}")
    if m["hash"] != "splitmix64" or m["checksum"] != "crc32c":
        _fail(where, f"unknown hash/checksum {m['hash']!r}/{m['checksum']!r}")
    if not 1 <= m["num_buckets"] < 1 << 24:
        _fail(where, f"num_buckets {m['num_buckets']} out of range")
    if not 1 <= m["chunk_bytes"] < 1 << 31:
        _fail(where, f"chunk_bytes {m['chunk_bytes']} out of range")
    if m["shard_num"] < 1:
        _fail(where, f"shard_num {m['shard_num']} < 1")
    if not valid_ckpt_id(m["ckpt_id"]):
        _fail(where, f"ckpt_id {m['ckpt_id']!r} is not a valid id")
    for field in ("io_state", "worker_steps"):
        for w in (m.get(field) or {}):
            if not (isinstance(w, str) and w.isascii() and w.isdigit() and w == str(int(w)) and int(w) < m["shard_num"]):
                _fail(where, f"{field} key {w!r} is not a worker number below shard_num {m['shard_num']}")
    tables = {}
    for tname, t in m["tables"].items():
        tw = f"{where} table {tname!r}"
        slots = _req(t, "slots", list, tw)
        rows = _nonneg(_req(t, "rows", int, tw), "rows", tw)
        specs = []
        for pair in slots:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                _fail(tw, f"slot entry {pair!r} is not [name, spec]")
            specs.append((pair[0], _validate_slot_spec(pair[1], f"{tw} slot {pair[0]!r}")))
        names = [s for s, _ in specs]
        if len(set(names)) != len(names):
            _fail(tw, f"duplicate slot names {names}")
        changes = t.get("changes", False)
        if changes not in (True, False) or (changes and fv < 3):
            _fail(tw, f"bad 'changes' {changes!r}")
        removed = _nonneg(t["removed"], "removed", tw) if "removed" in t else 0
        if "removed" in t and (not _is_int(t["removed"]) or not changes):
            _fail(tw, "'removed' only in a table that holds changes")
        fn, nrows, blocks, hsize = "hash", 0, None, 0
        if fv >= 4:
            fn = _req(t, "bucket_fn", str, tw)
            if fn not in ("hash", "row_range", "id_range"):
                _fail(tw, f"unknown bucket_fn {fn!r}")
            if fn == "row_range":
                nrows = _req(t, "num_rows", int, tw)
                if not 1 <= nrows < 1 << 40:
                    _fail(tw, f"num_rows {nrows} outside [1, 2**40)")
            elif "num_rows" in t:
                _fail(tw, "num_rows without row_range")
            if fn == "id_range":
                hsize = _req(t, "input_size", int, tw)
                if not 1 <= hsize < 1 << 63:
                    _fail(tw, f"input_size {hsize} outside [1, 2**63)")
                if "column_blocks" in t:
                    _fail(tw, "column_blocks in an id_range table")
            elif "input_size" in t:
                _fail(tw, "input_size without id_range")
            if "column_blocks" in t:
                cb = _req(t, "column_blocks", dict, tw)
                split = _req(cb, "slots", list, tw)
                bl = _req(cb, "blocks", list, tw)
                spec_of = dict(specs)
                if not split or len(set(split)) != len(split) or any(x not in spec_of for x in split):
                    _fail(tw, f"column_blocks slots {split!r} are not distinct slots of the table")
                dims = {spec_of[x]["shape"][-1] if spec_of[x]["shape"] else None for x in split}
                if len(dims) != 1 or None in dims:
                    _fail(tw, "split slots need the same last dim")
                pos = 0
                for b in bl:
                    if not (isinstance(b, list) and len(b) == 2 and all(_is_int(x) for x in b)
                            and b[0] == pos and b[1] > b[0]):
                        _fail(tw, f"column blocks {bl!r} do not partition the last dim from 0")
                    pos = b[1]
                if not bl or pos != dims.pop():
                    _fail(tw, f"column blocks {bl!r} do not partition the split slots' last dim")
                blocks = (tuple(split), [tuple(b) for b in bl])
        elif any(k in t for k in ("bucket_fn", "num_rows", "column_blocks", "input_size")):
            _fail(tw, "version 4 table fields in an older manifest")
        groups = None
        if "column_groups" in t:
            # FORMAT.md "Column groups" (version 5): split slots of one shape (D,) in groups of `width` columns
            if fv < 5 or fn != "row_range":
                _fail(tw, "column_groups need format version 5 and a row_range table")
            cg = _req(t, "column_groups", dict, tw)
            if set(cg) != {"slots", "width"}:
                _fail(tw, f"column_groups fields {sorted(cg)}")
            gs = _req(cg, "slots", list, tw)
            spec_of = dict(specs)
            if not gs or len(set(gs)) != len(gs) or any(x not in spec_of for x in gs):
                _fail(tw, f"column_groups slots {gs!r} are not distinct slots of the table")
            shapes = {spec_of[x]["shape"] for x in gs}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1 or next(iter(shapes))[0] < 1:
                _fail(tw, "grouped slots need one shape (D,), D >= 1")
            width = _req(cg, "width", int, tw)
            if not 1 <= width <= next(iter(shapes))[0]:
                _fail(tw, f"column group width {width} outside [1, D]")
            if blocks is not None and list(blocks[0]) != gs:
                _fail(tw, "column_groups and column_blocks split different slots")
            groups = (tuple(gs), width)
        tables[tname] = {"slots": specs, "rows": rows, "changes": changes, "removed": removed,
                         "bucket_fn": fn, "num_rows": nrows, "blocks": blocks, "input_size": hsize,
                         "groups": groups, "fv": fv}
    files = {}
    for p, e in m["files"].items():
        _check_relpath(p, where)
        fw = f"{where} files[{p!r}]"
        if p == "manifest.json" or p.endswith(".bin"):
            _fail(fw, "manifest.json and .bin shard files must not be listed in files")
        files[p] = (_nonneg(_req(e, "size", int, fw), "size", fw), _req(e, "crc32c", int, fw))
    if (m["index"] is None) != (len(tables) == 0):
        # SPEC-GUESS: "null only when tables is empty" read as: null iff there are no tables
        _fail(where, "index is null iff tables is empty")
    referenced = [m[k] for k in ("index", "dense", "extras") if m[k] is not None]
    for w, p in m["io_state"].items():
        if not (isinstance(w, str) and w.isdigit() and str(int(w)) == w):
            _fail(where, f"io_state key {w!r} is not a decimal worker number")
        if not isinstance(p, str):
            _fail(where, f"io_state[{w!r}] is not a path")
        referenced.append(p)
    for p in referenced:
        _check_relpath(p, where)
        if p not in files:
            _fail(where, f"referenced path {p!r} has no entry in files")
    for k, v in m["metadata"].items():
        if not isinstance(v, str):
            _fail(where, f"metadata[{k!r}] is not a string")
    parent = m.get("parent")
    if parent is not None:
        if fv < 3 or not isinstance(parent, dict):
            _fail(where, "parent needs format version 3 and an object")
        pid = _req(parent, "ckpt_id", str, where + " parent")
        digest = _req(parent, "manifest_sha256", str, where + " parent")
        if not valid_ckpt_id(pid) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            _fail(where, f"bad parent {parent!r}")
        parent = (pid, digest)
    elif any(t["changes"] for t in tables.values()):
        _fail(where, "a table holds changes but there is no parent")
    return {"tables": tables, "files": files, "parent": parent}


def read_manifest(ckpt_dir: str, _counter=None) -> Tuple[dict, dict]:
    path = os.path.join(ckpt_dir, "manifest.json")
    if not os.path.isfile(path):
        _fail(path, "no manifest.json (not a committed checkpoint)", NotFoundError)
    m = read_checked_json(path, MANIFEST_LIMIT, _counter)
    return m, validate_manifest(m, path)


def _file_bytes(ckpt_dir: str, rel: str, size: int, crc: Optional[int], where: str) -> bytes:
    path = os.path.join(ckpt_dir, rel)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        _fail(where, f"listed file {rel!r} is missing")
    if len(data) != size:
        _fail(where, f"file {rel!r} has {len(data)} bytes, manifest says {size}")
    if crc is not None and crc32c(data) != crc:
        _fail(where, f"file {rel!r} CRC mismatch (stored {crc:#010x}, actual {crc32c(data):#010x})")
    return data


# ---------------------------------------------------------------------------------- listing

def _committed_manifest(output_dir: str, name: str) -> Optional[dict]:
    if not valid_ckpt_id(name):
        return None
    d = os.path.join(output_dir, name)
    if not os.path.isdir(d):
        return None
    try:
        m, _ = read_manifest(d)
    except FormatError:
        return None
    return m


def list_committed(output_dir: str) -> List[str]:
    """Committed checkpoint ids, oldest first.

    The version file is used for the order when it is valid and names exactly the committed
    directories; otherwise the directories are listed and ordered by (created_ns, id).
    """
    # SPEC-GUESS: the spec says the version file is "oldest first" but not how a reader orders ids
    # when it has to list directories itself, nor what "stale" means precisely. We use manifest
    # created_ns (ties by id), and "stale" = its id set differs from the committed set.
    committed = {}
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    for n in names:
        if n.startswith("."):
            continue  # .staging-*, .deleting-*
        m = _committed_manifest(output_dir, n)
        if m is not None:
            committed[n] = m
    vf = os.path.join(output_dir, "checkpoint")
    try:
        with open(vf, "rb") as f:
            lines = f.read().decode("utf-8").splitlines()
        if all(valid_ckpt_id(x) for x in lines) and len(set(lines)) == len(lines) \
                and set(lines) == set(committed):
            return lines
    except (OSError, UnicodeDecodeError):
        pass
    return sorted(committed, key=lambda n: (committed[n]["created_ns"], n))


# ------------------------------------------------------------------------------------- index

def _validate_block(b, where: str, with_list: Optional[int], chunk: int) -> dict:
    off = _nonneg(_req(b, "offset", int, where), "offset", where)
    length = _nonneg(_req(b, "length", int, where), "length", where)
    if "crc32c" not in b:
        _fail(where, "field 'crc32c' missing")
    crc = b["crc32c"]
    if with_list is None:
        if not _is_int(crc):
            _fail(where, "buckets crc32c must be one int")
    else:
        if not (isinstance(crc, list) and all(_is_int(c) for c in crc)):
            _fail(where, "column crc32c must be a list of ints")
        if len(crc) != -(-length // chunk):
            _fail(where, f"column has {len(crc)} chunk CRCs, expected ceil({length}/{chunk})")
    return {"offset": off, "length": length, "crc32c": crc}


def validate_index(ix: dict, where: str, mv: dict, manifest: dict, ckpt_dir: Optional[str]) -> dict:
    """Structure checks of an index (merged or per-worker). Returns a normalised form."""
    fv = _req(ix, "format_version", int, where)
    if fv not in READABLE:
        _fail(where, f"unknown format_version {fv}", IncompatibleError)
    if fv != manifest["format_version"]:
        _fail(where, f"format_version {fv} differs from the manifest's {manifest['format_version']}")
    B = _req(ix, "num_buckets", int, where)
    C = _req(ix, "chunk_bytes", int, where)
    if B != manifest["num_buckets"] or C != manifest["chunk_bytes"]:
        _fail(where, "num_buckets/chunk_bytes differ from the manifest's")
    files = []
    for i, fe in enumerate(_req(ix, "files", list, where)):
        fw = f"{where} files[{i}]"
        p = _check_relpath(_req(fe, "path", str, fw), fw)
        size = _nonneg(_req(fe, "size", int, fw), "size", fw)
        files.append((p, size))
    tables = _req(ix, "tables", dict, where)
    out_tables, out_removed = {}, {}
    if fv >= 4:
        for tname, t in tables.items():
            tw = f"{where} table {tname!r}"
            if tname not in mv["tables"]:
                _fail(tw, "table not in the manifest")
            info = mv["tables"][tname]
            if _req(t, "slots", list, tw) != [x for x, _ in info["slots"]]:
                _fail(tw, "slots differ from the manifest's order")
            out_tables[tname] = _v4_segments(_req(t, "segments", dict, tw), tw, files, info["slots"], B, C,
                                             True, info["blocks"], info)
            if "removed" in t:
                if not info["changes"]:
                    _fail(tw, "'removed' only in a table that holds changes")
                out_removed[tname] = _v4_segments(_req(t, "removed", dict, tw), tw + " removed", files, [], B, C,
                                                  False, None, None)
            else:
                out_removed[tname] = []
            if sum(sg["rows"] for sg in out_removed[tname]) != info["removed"]:
                _fail(tw, "removed segments disagree with the manifest's count")
        missing = set(mv["tables"]) - set(out_tables)
        if missing and ckpt_dir is not None:
            _fail(where, f"tables {sorted(missing)} of the manifest are absent from the index")
        return {"files": files, "tables": out_tables, "removed": out_removed, "raw": ix, "format_version": fv}
    for tname, t in tables.items():
        tw = f"{where} table {tname!r}"
        if tname not in mv["tables"]:
            _fail(tw, "table not in the manifest")
        specs = mv["tables"][tname]["slots"]
        slots = _req(t, "slots", list, tw)
        if slots != [s for s, _ in specs]:
            _fail(tw, f"slots {slots} differ from the manifest's order {[s for s, _ in specs]}")
        segs = []
        removed_raw = t.get("removed")
        if removed_raw is not None and not (fv >= 3 and isinstance(removed_raw, list)
                                            and mv["tables"][tname]["changes"]):
            _fail(tw, "'removed' segments only in a version 3 table that holds changes")
        entries = [(f"{tw} segment {si}", seg, specs, segs) for si, seg in enumerate(_req(t, "segments", list, tw))]
        rsegs = []
        entries += [(f"{tw} removed segment {si}", seg, [], rsegs) for si, seg in enumerate(removed_raw or [])]
        for sw, seg, specs, into in entries:
            fi = _req(seg, "file", int, sw)
            if not 0 <= fi < len(files):
                _fail(sw, f"file index {fi} out of range")
            n = _nonneg(_req(seg, "rows", int, sw), "rows", sw)
            bk = _validate_block(_req(seg, "buckets", dict, sw), sw + " buckets", None, C)
            cols_raw = _req(seg, "columns", list, sw)
            if len(cols_raw) != 1 + len(specs):
                _fail(sw, f"{len(cols_raw)} columns, expected ids + {len(specs)} slots")
            cols = [_validate_block(c, f"{sw} column {ci}", 1, C) for ci, c in enumerate(cols_raw)]
            rowbytes = [8] + [_DTYPES[sp["dtype"]].itemsize * int(np.prod(sp["shape"], dtype=np.int64))
                              for _, sp in specs]
            if bk["length"] != 8 * (B + 1):
                _fail(sw, f"buckets block length {bk['length']} != 8*(B+1)")
            for ci, (c, rb) in enumerate(zip(cols, rowbytes)):
                if c["length"] != n * rb:
                    _fail(sw, f"column {ci} length {c['length']} != {n}*{rb}")
            fsize = files[fi][1]
            for name, blk in [("buckets", bk)] + [(f"column {ci}", c) for ci, c in enumerate(cols)]:
                if blk["offset"] + blk["length"] > fsize:
                    _fail(f"{sw} ({files[fi][0]})", f"{name} [{blk['offset']}, +{blk['length']}) beyond file size {fsize}")
            into.append({"file": fi, "rows": n, "buckets": bk, "columns": cols, "rowbytes": rowbytes})
        if sum(sg["rows"] for sg in rsegs) != mv["tables"][tname]["removed"]:
            _fail(tw, f"removed segments hold {sum(sg['rows'] for sg in rsegs)} ids, the manifest says "
                      f"{mv['tables'][tname]['removed']}")
        out_tables[tname] = segs
        out_removed[tname] = rsegs
    missing = set(mv["tables"]) - set(out_tables)
    if missing and ckpt_dir is not None:
        # SPEC-GUESS: index.json lists every manifest table (even with 0 rows / no segments)
        _fail(where, f"tables {sorted(missing)} of the manifest are absent from the index")
    return {"files": files, "tables": out_tables, "removed": out_removed, "raw": ix, "format_version": fv}


def _step(length: int, C: int) -> int:
    """FORMAT.md: step(L) = min(C, max(512, 2^ceil(log2(ceil(L / 64)))))."""
    q = -(-length // 64)
    p = 1
    while p < q:
        p *= 2
    return min(C, max(512, p))


def _slot_columns(specs, info, block: int):
    """FORMAT.md "Column groups": per slot (in order) the list of its columns in a segment of column block
    `block`, each as (row bytes, [c0, c1) of the last dim or None for a whole-row column)."""
    out = []
    blocks = info["blocks"] if info else None
    groups = info["groups"] if info else None
    for sname, sp in specs:
        item = _DTYPES[sp["dtype"]].itemsize
        shape = list(sp["shape"])
        split = (blocks is not None and sname in blocks[0]) or (groups is not None and sname in groups[0])
        if not split:
            out.append([(item * int(np.prod(shape, dtype=np.int64)), None)])
            continue
        unit = item * int(np.prod(shape[:-1], dtype=np.int64))
        c0, c1 = blocks[1][block] if blocks is not None else (0, shape[-1])
        g = groups[1] if groups is not None else c1 - c0
        out.append([(unit * (min(c1, a + g) - a), (a, min(c1, a + g))) for a in range(c0, c1, g)])
    return out


def _v4_segments(sg: dict, tw: str, files, specs, B: int, C: int, with_packed: bool, blocks, info) -> list:
    """FORMAT.md "Index, version 4" (and version 5's row runs and column groups): SEGS (parallel lists + one
    CRC string) -> one dict per segment with every block's offset, length and CRCs, positions computed
    from the rules."""
    runs = info is not None and info["fv"] >= 5 and info["bucket_fn"] == "row_range"
    keys = ["file", "offset", "rows", "dir", "first", "last"] + (["packed"] if with_packed else []) + (
        ["block"] if blocks is not None else []) + (["id0"] if runs else [])
    extra = set(sg) - set(keys) - {"crc32c"}
    if extra:
        _fail(tw, f"unexpected SEGS fields {sorted(extra)}")
    lists = {k: _req(sg, k, list, tw) for k in keys}
    n = len(lists["file"])
    for k, v in lists.items():
        if len(v) != n or not all(_is_int(x) for x in v):
            _fail(tw, f"SEGS list {k!r} is not {n} integers")
    text = _req(sg, "crc32c", str, tw)
    if len(text) % 8 or not re.fullmatch(r"[0-9a-f]*", text):
        _fail(tw, "crc32c is not 8 lower-case hex digits per CRC")
    crcs = [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]
    pos_crc = 0
    out = []
    for i in range(n):
        sw = f"{tw} segment {i}"
        fi, off, rows, k, first, last = (lists[x][i] for x in ("file", "offset", "rows", "dir", "first", "last"))
        packed = lists["packed"][i] if with_packed else 0
        block = lists["block"][i] if blocks is not None else 0
        id0 = lists["id0"][i] if runs else -1
        if not 0 <= fi < len(files):
            _fail(sw, f"file index {fi} out of range")
        run = id0 >= 0
        if id0 < -1:
            _fail(sw, f"id0 {id0} is neither -1 nor a first id")
        if run:
            # a row run: ids [id0, id0 + rows) of the table's N rows, no directory, no ids column
            nrows = info["num_rows"]
            if not (k == 0 and id0 + rows <= nrows and first == id0 * B // nrows
                    and last == (id0 + rows - 1) * B // nrows):
                _fail(sw, f"bad row run id0={id0} rows={rows} dir={k} first={first} last={last}")
        if not (off >= 0 and 1 <= rows < 1 << 32 and (run or 1 <= k <= min(rows, B)) and 0 <= first <= last < B
                and packed in (0, 1)):
            _fail(sw, f"bad segment fields offset={off} rows={rows} dir={k} first={first} last={last} packed={packed}")
        if blocks is not None and not 0 <= block < len(blocks[1]):
            _fail(sw, f"block {block} out of range")
        slot_cols = _slot_columns(specs, info, block) if specs else []
        rowbytes = [8] + [sum(w for w, _ in cols) for cols in slot_cols]
        if pos_crc + (0 if run else 1) > len(crcs):
            _fail(sw, "crc32c string too short")
        bk = {"offset": off, "length": 8 * k, "crc32c": None if run else crcs[pos_crc]}
        pos_crc += 0 if run else 1
        pos = off + 8 * k
        cols, aligned, col_widths, col_ranges = [], [], [8], [None]
        layout = [(8, False, None, True)] + [(w, j == 0, rng, False) for slot in slot_cols
                                              for j, (w, rng) in enumerate(slot)]
        for ci, (rb, begins, rng, is_ids) in enumerate(layout):
            length = 0 if (is_ids and run) else rows * rb
            if begins and length > 0 and not packed:
                pos += -pos % 4096
            st = _step(length, C)
            m = -(-length // st)
            if pos_crc + m > len(crcs):
                _fail(sw, "crc32c string too short")
            cols.append({"offset": pos, "length": length, "crc32c": crcs[pos_crc:pos_crc + m], "step": st})
            aligned.append(begins)
            if ci:
                col_widths.append(rb)
                col_ranges.append(rng)
            pos_crc += m
            pos += length
        if pos > files[fi][1]:
            _fail(sw, f"segment ends at {pos}, beyond its file of {files[fi][1]} bytes")
        out.append({"file": fi, "rows": rows, "buckets": bk, "columns": cols, "rowbytes": rowbytes,
                    "dir": k, "first": first, "last": last, "packed": packed, "block": block, "id0": id0,
                    "aligned": aligned, "colwidths": col_widths, "colranges": col_ranges,
                    "slotcols": [len(c) for c in slot_cols]})
    if pos_crc != len(crcs):
        _fail(tw, f"crc32c string has {len(crcs)} CRCs, the segments need {pos_crc}")
    return out


def _check_file_layout(ix: dict, where: str):
    """'A shard file is a concatenation of segments with no header': every segment is buckets, ids,
    slot 0.. contiguous, except that from version 2 on each non-empty slot column is preceded by the
    zero padding that brings its offset to a multiple of 4096; the segments tile each file exactly."""
    align = 4096 if ix["format_version"] >= 2 else 1
    per_file: Dict[int, List[Tuple[int, int, str]]] = {i: [] for i in range(len(ix["files"]))}
    all_segs = list(ix["tables"].items()) + [(f"{t} (removed)", sg) for t, sg in ix["removed"].items()]
    for tname, segs in all_segs:
        for si, s in enumerate(segs):
            pos = s["buckets"]["offset"] + s["buckets"]["length"]
            for ci, c in enumerate(s["columns"]):
                # a column that begins a slot is aligned (version 5: a slot's later column groups are not)
                begins = s["aligned"][ci] if "aligned" in s else ci > 0
                if begins and c["length"] > 0 and not s.get("packed"):
                    pos += -pos % align
                if c["offset"] != pos:
                    _fail(f"{where} table {tname!r} segment {si}",
                          f"column {ci} at offset {c['offset']}, expected {pos} (segment not contiguous)")
                pos += c["length"]
            per_file[s["file"]].append((s["buckets"]["offset"], pos, f"{tname}#{si}"))
    for fi, spans in per_file.items():
        spans.sort()
        pos = 0
        for lo, hi, name in spans:
            if lo != pos:
                _fail(f"{where} {ix['files'][fi][0]}", f"segment {name} starts at {lo}, expected {pos} (gap/overlap)")
            pos = hi
        if pos != ix["files"][fi][1]:
            _fail(f"{where} {ix['files'][fi][0]}", f"segments end at {pos}, file size is {ix['files'][fi][1]}")


def _check_worker_indexes(ckpt_dir: str, mv: dict, manifest: dict, merged: dict):
    """index.json must be the concatenation of the workers' indexes in worker order."""
    wre = re.compile(r"sparse/worker-(\d{5})\.index\.json")
    workers = sorted((int(mt.group(1)), p) for p in mv["files"] for mt in [wre.fullmatch(p)] if mt)
    if not workers:
        return
    # SPEC-GUESS: we assume the worker files are exactly sparse/worker-00000..(shard_num-1).index.json
    if [w for w, _ in workers] != list(range(manifest["shard_num"])):
        _fail(ckpt_dir, f"worker indexes {[w for w, _ in workers]} do not match shard_num {manifest['shard_num']}")
    files: List[Tuple[str, int]] = []
    tables: Dict[str, list] = {t: [] for t in merged["tables"]}
    removed: Dict[str, list] = {}
    for w, p in workers:
        full = os.path.join(ckpt_dir, p)
        wix = validate_index(_read_index_json(full, manifest["format_version"]), full, mv, manifest, None)
        base = len(files)
        files.extend(wix["files"])
        for t, segs in wix["tables"].items():
            for s in segs:
                tables[t].append(dict(s, file=s["file"] + base))
        for t, segs in wix["removed"].items():
            for s in segs:
                removed.setdefault(t, []).append(dict(s, file=s["file"] + base))
    if files != merged["files"]:
        _fail(ckpt_dir, "index.json files are not the concatenation of the workers' files")
    def rkey(s):
        return (s["file"], s["rows"], json.dumps(s["buckets"]), json.dumps(s["columns"]))
    if {t: [rkey(s) for s in v] for t, v in removed.items() if v} != {
            t: [rkey(s) for s in v] for t, v in merged["removed"].items() if v}:
        _fail(ckpt_dir, "index.json removed segments are not the workers' removed segments")
    for t in merged["tables"]:
        def key(s):
            return (s["file"], s["rows"], json.dumps(s["buckets"]), json.dumps(s["columns"]))
        if [key(s) for s in tables[t]] != [key(s) for s in merged["tables"][t]]:
            if sorted(map(key, tables[t])) == sorted(map(key, merged["tables"][t])):
                _fail(ckpt_dir, f"table {t!r}: index.json segments are the workers' segments in a different order")
            _fail(ckpt_dir, f"table {t!r}: index.json segments differ from the workers' segments")


# ------------------------------------------------------------------------------ segment reading

class _Reader:
    """Opens shard files, reads byte ranges and counts the bytes read."""

    def __init__(self, ckpt_dir: str, files: List[Tuple[str, int]]):
        self.ckpt_dir = ckpt_dir
        self.files = files
        self.handles: Dict[int, Any] = {}
        self.bytes_read = 0
        self.reads = 0

    def _h(self, fi: int):
        if fi not in self.handles:
            rel, size = self.files[fi]
            path = os.path.join(self.ckpt_dir, rel)
            try:
                h = open(path, "rb")
            except FileNotFoundError:
                _fail(path, "shard file is missing")
            actual = os.fstat(h.fileno()).st_size
            if actual != size:
                h.close()
                _fail(path, f"shard file has {actual} bytes, index says {size}")
            self.handles[fi] = h
        return self.handles[fi]

    def read(self, fi: int, offset: int, length: int) -> np.ndarray:
        h = self._h(fi)
        h.seek(offset)
        data = h.read(length)
        self.bytes_read += len(data)
        self.reads += 1
        if len(data) != length:
            _fail(self.files[fi][0], f"short read at {offset}: {len(data)} of {length} bytes")
        return np.frombuffer(data, dtype=np.uint8)

    def close(self):
        for h in self.handles.values():
            h.close()


def _read_buckets(r: _Reader, seg: dict, B: int, where: str, table: Optional[dict] = None) -> np.ndarray:
    """The segment's bucket offsets as B+1 row offsets (a version 4 directory expanded; a version 5 row
    run's computed from its ids, which are stored nowhere)."""
    if seg.get("id0", -1) >= 0:
        n, id0, nrows = seg["rows"], seg["id0"], table["num_rows"]
        first_id = np.array([-(-b * nrows // B) for b in range(B + 1)], dtype=np.int64)  # first id of bucket b
        return np.clip(first_id - id0, 0, n)
    bk = seg["buckets"]
    raw = r.read(seg["file"], bk["offset"], bk["length"])
    if crc32c(raw) != bk["crc32c"]:
        _fail(where, "buckets block CRC mismatch")
    if "dir" in seg:
        k, n = seg["dir"], seg["rows"]
        d = raw.view("<u4").astype(np.int64)
        buckets, starts = d[:k], d[k:]
        if not (buckets[0] == seg["first"] and buckets[-1] == seg["last"] and starts[0] == 0
                and starts[-1] < n and np.all(np.diff(buckets) > 0) and np.all(np.diff(starts) > 0)):
            _fail(where, "bucket directory is not a partition of the rows")
        off = np.full(B + 1, n, dtype=np.int64)
        off[buckets] = starts
        return np.minimum.accumulate(off[::-1])[::-1]
    b = raw.view("<i8").astype(np.int64)
    n = seg["rows"]
    if b[0] != 0 or b[B] != n or np.any(np.diff(b) < 0):
        _fail(where, f"bucket offsets are not a partition of [0, {n})")
    return b


def _read_column_rows(r: _Reader, seg: dict, ci: int, r0: int, r1: int, C: int, where: str) -> np.ndarray:
    """Bytes of rows [r0, r1) of column ci, reading whole checksum chunks and verifying them."""
    col = seg["columns"][ci]
    rb = seg.get("colwidths", seg["rowbytes"])[ci]
    C = col.get("step", C)
    start, end = r0 * rb, r1 * rb
    if end <= start:
        return np.zeros(0, np.uint8)
    j0, j1 = start // C, -(-end // C)
    lo, hi = j0 * C, min(j1 * C, col["length"])
    raw = r.read(seg["file"], col["offset"] + lo, hi - lo)
    got = crc32c_chunks(raw, C)
    want = col["crc32c"][j0:j1]
    if got != want:
        bad = next(j0 + k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        _fail(where, f"column {ci} chunk {bad} CRC mismatch")
    return raw[start - lo:end - lo]


def table_bucket_of(ids, B: int, table: dict) -> np.ndarray:
    """The table's bucket function (FORMAT.md, Buckets and ownership); -1 for a row_range id outside
    [0, N)."""
    if table.get("bucket_fn", "hash") == "id_range":
        h = table["input_size"]
        # exact integers: id * (B - 1) may pass 2**64
        return np.array([int(x) * (B - 1) // h if 0 <= int(x) < h else B - 1 for x in np.asarray(ids).tolist()],
                        dtype=np.int64)
    if table.get("bucket_fn", "hash") == "row_range":
        n = table["num_rows"]
        ids = np.asarray(ids, dtype=np.int64)
        ok = (ids >= 0) & (ids < n)
        return np.where(ok, np.where(ok, ids, 0) * B // n, -1)
    return bucket_of(ids, B)


def _decode_segment_rows(r, seg, specs, r0, r1, b, lo, hi, B, C, where, bf16, table=None, columns=None):
    """Rows [r0, r1) of a segment (of buckets [lo, hi), `b` its bucket offsets): ids and every slot of
    `specs`, a slot stored as column groups read group by group and its groups put side by side; with
    `columns` (a, b), a split slot's columns [a, b) only, reading only the groups that hold any."""
    if seg.get("id0", -1) >= 0:   # a row run: ids [id0, id0 + rows), stored nowhere
        ids = np.arange(seg["id0"] + r0, seg["id0"] + r1, dtype=np.int64)
    else:
        ids = _read_column_rows(r, seg, 0, r0, r1, C, where).view("<i8").astype(np.int64)
    expect = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(b[lo:hi + 1]))
    got = table_bucket_of(ids, B, table or {})
    if not np.array_equal(got, expect):
        k = int(np.nonzero(got != expect)[0][0])
        _fail(where, f"row {r0 + k} (id {ids[k]}) has bucket {got[k]} but lies in bucket {expect[k]}'s range")
    if np.unique(ids).size != ids.size:
        _fail(where, "segment repeats an id")
    slots = {}
    n = r1 - r0
    ci = 1
    for k, (sname, sp) in enumerate(specs):
        ncols = seg["slotcols"][k] if "slotcols" in seg else 1
        ranges = seg["colranges"][ci:ci + ncols] if "colranges" in seg else [None]
        widths = seg["colwidths"][ci:ci + ncols] if "colwidths" in seg else [seg["rowbytes"][ci]]
        item = _DTYPES[sp["dtype"]].itemsize
        unit = item * int(np.prod(sp["shape"][:-1], dtype=np.int64)) if sp["shape"] else item
        pieces = []
        for j, (rng, w) in enumerate(zip(ranges, widths)):
            if columns is not None and rng is not None:
                x0, x1 = max(rng[0], columns[0]), min(rng[1], columns[1])
                if x1 <= x0:
                    continue   # a group outside the columns asked for: not read
                raw = _read_column_rows(r, seg, ci + j, r0, r1, C, where).reshape(n, w)
                pieces.append(raw[:, (x0 - rng[0]) * unit:(x1 - rng[0]) * unit])
            else:
                pieces.append(_read_column_rows(r, seg, ci + j, r0, r1, C, where).reshape(n, w))
        ci += ncols
        raw = np.ascontiguousarray(np.concatenate(pieces, axis=1)) if pieces else np.zeros((n, 0), np.uint8)
        shape = sp["shape"]
        full = item * int(np.prod(shape, dtype=np.int64))
        if raw.shape[1] != full:   # the columns a block (or a window) holds of a split slot
            shape = shape[:-1] + (raw.shape[1] // unit,)
        slots[sname] = _decode_elements(raw.reshape(-1), sp["dtype"], (n,) + shape, f"{where} slot {sname!r}", bf16)
    return ids, slots


def _assemble(parts, specs, tname, where, bf16):
    if parts:
        ids = np.concatenate([p[0] for p in parts])
        slots = {s: np.concatenate([p[1][s] for p in parts]) for s, _ in specs}
    else:
        ids = np.zeros(0, np.int64)
        slots = {}
        for s, sp in specs:
            dt = np.float32 if sp["dtype"] == "BF16" and bf16 != "bits" else (
                np.bool_ if sp["dtype"] == "BOOL" else _DTYPES[sp["dtype"]].newbyteorder("="))
            slots[s] = np.zeros((0,) + sp["shape"], dtype=dt)
    if np.unique(ids).size != ids.size:
        _fail(f"{where} table {tname!r}", "an id appears in more than one segment")
    return {"ids": ids, "slots": slots}


# ----------------------------------------------------------------------------- safetensors

_ST_HEADER_LIMIT = 100 << 20


def read_safetensors(data: bytes, where: str, bf16: str = "float32") -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Parse a safetensors file by hand -> (tensors, __metadata__)."""
    if len(data) < 8:
        _fail(where, "truncated safetensors header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _ST_HEADER_LIMIT or 8 + n > len(data):
        _fail(where, f"safetensors header length {n} invalid for a {len(data)}-byte file")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        _fail(where, f"bad safetensors header: {e}")
    if not isinstance(header, dict):
        _fail(where, "safetensors header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        _fail(where, "__metadata__ is not a string -> string map")
    body = np.frombuffer(data, dtype=np.uint8, offset=8 + n)
    tensors = {}
    spans = []
    for name, e in header.items():
        tw = f"{where} tensor {name!r}"
        dt = _req(e, "dtype", str, tw)
        shape = _req(e, "shape", list, tw)
        offs = _req(e, "data_offsets", list, tw)
        if not all(_is_int(d) and d >= 0 for d in shape) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            _fail(tw, "bad shape/data_offsets")
        b, en = offs
        npdt = _DTYPES.get(dt) or _ST_EXTRA.get(dt)
        if npdt is None:
            _fail(tw, f"unsupported safetensors dtype {dt!r}")
        if not 0 <= b <= en <= body.size or en - b != npdt.itemsize * int(np.prod(shape, dtype=np.int64)):
            _fail(tw, f"data_offsets {offs} inconsistent with dtype/shape or beyond the data")
        tensors[name] = _decode_elements(body[b:en], dt, tuple(shape), tw, bf16)
        spans.append((b, en))
    spans.sort()
    pos = 0
    for b, en in spans:
        if b != pos:
            _fail(where, "safetensors data has holes or overlapping tensors")
        pos = en
    if pos != body.size:
        _fail(where, f"safetensors data is {body.size} bytes, tensors cover {pos}")
    return tensors, meta


# ------------------------------------------------------------------------------------ state trees

class TensorValue(np.ndarray):
    """A tree leaf that was a torch.Tensor when saved ({"__tensor__": key})."""


class DTypeName(str):
    """A tree leaf that was a torch.dtype ({"__dtype__": name})."""

    def __repr__(self):
        return f"DTypeName({str(self)!r})"


_SPECIAL = {
    "__tensor__": (), "__ndarray__": (), "__npscalar__": ("value",), "__tuple__": (), "__dict__": (),
    "__counter__": (), "__odict__": (), "__float__": (), "__bigint__": (), "__bytes__": (), "__dtype__": (),
}


def decode_tree(node, tensors: Dict[str, np.ndarray], where: str = "tree"):
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode_tree(x, tensors, where) for x in node]
    if not isinstance(node, dict):
        _fail(where, f"unexpected JSON value {node!r}")
    tags = [k for k in node if k in _SPECIAL]
    if not tags:
        # SPEC-GUESS: plain dicts never have "__"-prefixed keys (those go through "__dict__"), so an
        # object with an unknown "__" key is rejected rather than read as a dict.
        bad = [k for k in node if k.startswith("__")]
        if bad:
            _fail(where, f"unknown tagged node {bad}")
        return {k: decode_tree(v, tensors, f"{where}.{k}") for k, v in node.items()}
    tag = tags[0]
    if set(node) != {tag, *_SPECIAL[tag]}:
        _fail(where, f"tagged node {tag} has unexpected keys {sorted(node)}")
    v = node[tag]
    if tag in ("__tensor__", "__ndarray__"):
        if not isinstance(v, str) or v not in tensors:
            _fail(where, f"{tag} references missing tensor {v!r}")
        return tensors[v].copy().view(TensorValue) if tag == "__tensor__" else tensors[v].copy()
    if tag == "__npscalar__":
        # SPEC-GUESS: "value" may itself be a tree node (e.g. {"__float__": "nan"}); decode it first.
        return np.dtype(v).type(decode_tree(node["value"], tensors, where))
    if tag == "__tuple__":
        if not isinstance(v, list):
            _fail(where, "__tuple__ is not a list")
        return tuple(decode_tree(x, tensors, where) for x in v)
    if tag in ("__dict__", "__counter__", "__odict__"):
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            _fail(where, f"{tag} is not a list of [key, value] pairs")
        pairs = {decode_tree(k, tensors, where): decode_tree(x, tensors, where) for k, x in v}
        return {"__dict__": dict, "__counter__": collections.Counter, "__odict__": collections.OrderedDict}[tag](pairs)
    if tag == "__float__":
        if v not in ("nan", "inf", "-inf"):
            _fail(where, f"bad __float__ {v!r}")
        return float(v)
    if tag == "__bigint__":
        if not isinstance(v, str) or not re.fullmatch(r"-?[0-9]+", v):
            _fail(where, f"bad __bigint__ {v!r}")
        return int(v)
    if tag == "__bytes__":
        try:
            return base64.b64decode(v, validate=True)
        except (ValueError, TypeError) as e:
            _fail(where, f"bad __bytes__: {e}")
    if tag == "__dtype__":
        if not isinstance(v, str):
            _fail(where, "bad __dtype__")
        return DTypeName(v)
    raise AssertionError(tag)


def _read_tree_file(data: bytes, where: str, bf16: str):
    tensors, meta = read_safetensors(data, where, bf16)
    if "recckpt.tree" not in meta:
        _fail(where, "no 'recckpt.tree' metadata")
    try:
        tree = json.loads(meta["recckpt.tree"])
    except ValueError as e:
        _fail(where, f"recckpt.tree is not JSON: {e}")
    return decode_tree(tree, tensors, where)


# ------------------------------------------------------------------------------------ top level

def _open_index(ckpt_dir: str, manifest: dict, mv: dict, verify_file_crc: bool, counter=None) -> Optional[dict]:
    if manifest["index"] is None:
        return None
    rel = manifest["index"]
    full = os.path.join(ckpt_dir, rel)
    size, crc = mv["files"][rel]
    ix_raw = _read_index_json(full, manifest["format_version"], counter)
    actual = os.stat(full).st_size
    if actual != size:
        _fail(full, f"{actual} bytes, manifest says {size}")
    if verify_file_crc or manifest["format_version"] >= 4:   # version 4: the manifest's CRC is the only one
        _file_bytes(ckpt_dir, rel, size, crc, full)
    ix = validate_index(ix_raw, full, mv, manifest, ckpt_dir)
    return ix


def _read_index_json(path: str, fv: int, counter=None) -> dict:
    """An index file: checked JSON up to version 3; plain JSON (no self-checksum) from version 4."""
    if fv < 4:
        return read_checked_json(path, INDEX_LIMIT, counter)
    if os.stat(path).st_size > INDEX_LIMIT:
        _fail(path, "index exceeds the 1 GiB limit")
    with open(path, "rb") as f:
        raw = f.read()
    if counter is not None:
        counter[0] += len(raw)
    try:
        obj = json.loads(raw.decode("ascii"), parse_constant=_reject_constant, parse_float=_reject_float)
    except (UnicodeDecodeError, ValueError) as e:
        _fail(path, f"not valid JSON: {e}")
    if not isinstance(obj, dict) or "crc32c" in obj:
        _fail(path, "a version 4 index is an object without a crc32c field")
    return obj


def _merge_blocks(parts_by_block: Dict[int, list], specs, info, tname, where, bf16):
    """A column-split table: every block holds the same rows; split slots are the blocks' columns side
    by side, the other slots come from block 0."""
    split = info["blocks"][0]
    whole = {}
    for j in sorted(parts_by_block):
        t = _assemble(parts_by_block[j], specs, tname, where, bf16)
        o = np.argsort(t["ids"], kind="stable")
        whole[j] = (t["ids"][o], {k: v[o] for k, v in t["slots"].items()})
    if sorted(whole) != list(range(len(info["blocks"][1]))):
        _fail(f"{where} table {tname!r}", "a column block has no rows")
    ids = whole[0][0]
    if any(not np.array_equal(w[0], ids) for w in whole.values()):
        _fail(f"{where} table {tname!r}", "column blocks hold different rows")
    slots = {}
    for sname, _ in specs:
        if sname in split:
            slots[sname] = np.concatenate([whole[j][1][sname] for j in sorted(whole)], axis=-1)
        else:
            slots[sname] = whole[0][1][sname]
    return {"ids": ids, "slots": slots}


def read_checkpoint(ckpt_dir: str, bf16: str = "float32") -> dict:
    """Read and fully verify a committed checkpoint directory.

    Returns {"manifest", "tables": {name: {"ids", "slots": {slot: array}}}, "dense", "extras",
    "io_state": {worker: tree}, "bytes_read"}.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    manifest, mv = read_manifest(ckpt_dir)
    B, C = manifest["num_buckets"], manifest["chunk_bytes"]

    # every file listed in the manifest: size and whole-file CRC
    contents = {}
    for rel, (size, crc) in mv["files"].items():
        contents[rel] = _file_bytes(ckpt_dir, rel, size, crc, os.path.join(ckpt_dir, "manifest.json"))

    ix = _open_index(ckpt_dir, manifest, mv, False)
    tables: Dict[str, dict] = {}
    shard_bytes = 0
    if ix is not None:
        _check_file_layout(ix, os.path.join(ckpt_dir, manifest["index"]))
        _check_worker_indexes(ckpt_dir, mv, manifest, ix)
        r = _Reader(ckpt_dir, ix["files"])
        try:
            for i in range(len(ix["files"])):
                r._h(i)  # every listed shard file exists with its size
            for tname, segs in ix["tables"].items():
                info = mv["tables"][tname]
                specs = info["slots"]
                parts: Dict[int, list] = {}
                for si, seg in enumerate(segs):
                    w = f"{ix['files'][seg['file']][0]} (table {tname!r}, segment {si})"
                    b = _read_buckets(r, seg, B, w, info)
                    parts.setdefault(seg.get("block", 0), []).append(
                        _decode_segment_rows(r, seg, specs, 0, seg["rows"], b, 0, B, B, C, w, bf16, info))
                for j in range(len(info["blocks"][1]) if info.get("blocks") else 1):
                    total = sum(s["rows"] for s in segs if s.get("block", 0) == j)
                    if total != info["rows"]:
                        _fail(f"{ckpt_dir} table {tname!r}", f"segments of block {j} hold {total} rows, manifest "
                                                             f"says {info['rows']}")
                if info.get("blocks"):
                    tables[tname] = _merge_blocks(parts, specs, info, tname, ckpt_dir, bf16)
                else:
                    tables[tname] = _assemble(parts.get(0, []), specs, tname, ckpt_dir, bf16)
                gone = []
                for si, seg in enumerate(ix["removed"].get(tname, [])):
                    w = f"{ix['files'][seg['file']][0]} (table {tname!r}, removed segment {si})"
                    b = _read_buckets(r, seg, B, w)
                    gone.append(_decode_segment_rows(r, seg, [], 0, seg["rows"], b, 0, B, B, C, w, bf16, info)[0])
                tables[tname]["removed"] = np.concatenate(gone) if gone else np.zeros(0, np.int64)
                tables[tname]["changes"] = mv["tables"][tname]["changes"]
        finally:
            shard_bytes = r.bytes_read
            r.close()
        # no unlisted .bin files
    listed_bins = {p for p, _ in ix["files"]} if ix else set()
    # SPEC-GUESS: "files: every file of the checkpoint except manifest.json and the .bin shard
    # files" read as: the checkpoint directory holds nothing else.
    for root, _dirs, fnames in os.walk(ckpt_dir):
        for fn in fnames:
            rel = os.path.relpath(os.path.join(root, fn), ckpt_dir).replace(os.sep, "/")
            if rel != "manifest.json" and rel not in mv["files"] and rel not in listed_bins:
                _fail(ckpt_dir, f"file {rel!r} is in the checkpoint but listed nowhere")

    dense: Dict[str, np.ndarray] = {}
    if manifest["dense"] is not None:
        dense, _ = read_safetensors(contents[manifest["dense"]], os.path.join(ckpt_dir, manifest["dense"]), bf16)
    extras = None
    if manifest["extras"] is not None:
        rel = manifest["extras"]
        extras = _read_tree_file(contents[rel], os.path.join(ckpt_dir, rel), bf16)
        if not (isinstance(extras, dict) and set(extras) >= {"objects", "sparse_optimizer"}):
            _fail(os.path.join(ckpt_dir, rel), "extras tree lacks 'objects'/'sparse_optimizer'")
        for name, o in extras["objects"].items():
            if not (isinstance(o, dict) and o.get("kind") in ("state_dict", "value") and "state" in o):
                _fail(os.path.join(ckpt_dir, rel), f"object {name!r} is not {{kind, state}}")
    io_state = {}
    for w, rel in manifest["io_state"].items():
        io_state[int(w)] = _read_tree_file(contents[rel], os.path.join(ckpt_dir, rel), bf16)
    return {"manifest": manifest, "tables": tables, "dense": dense, "extras": extras,
            "io_state": io_state, "bytes_read": shard_bytes}


def read_bucket_range(ckpt_dir: str, table: str, lo: int, hi: int, bf16: str = "float32",
                      columns: Optional[Tuple[int, int]] = None) -> dict:
    """Rows of buckets [lo, hi) of one table, reading only those byte ranges of each column
    (widened to whole checksum chunks, every chunk read is verified) plus each segment's buckets block.
    `columns` (a, b): of a table with column groups, the columns [a, b) of its split slots only, reading
    only the groups that hold any of them (FORMAT.md, what a loading rank reads).

    Returns {"ids", "slots", "bytes_read" (shard-file bytes), "meta_bytes_read" (manifest + index),
    "reads"}.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    counter = [0]
    manifest, mv = read_manifest(ckpt_dir, counter)
    B, C = manifest["num_buckets"], manifest["chunk_bytes"]
    if not 0 <= lo <= hi <= B:
        raise ValueError(f"bucket range [{lo}, {hi}) outside [0, {B}]")
    if table not in mv["tables"]:
        raise KeyError(table)
    ix = _open_index(ckpt_dir, manifest, mv, True, counter)
    specs = mv["tables"][table]["slots"]
    r = _Reader(ckpt_dir, ix["files"])
    parts = []
    info = mv["tables"][table]
    if info.get("blocks"):
        raise ValueError("read_bucket_range reads tables without column blocks")
    try:
        for si, seg in enumerate(ix["tables"][table]):
            if "dir" in seg and (seg["last"] < lo or seg["first"] >= hi):
                continue   # FORMAT.md: nothing of a segment whose [first, last] is outside the range
            w = f"{ix['files'][seg['file']][0]} (table {table!r}, segment {si})"
            b = _read_buckets(r, seg, B, w, info)
            r0, r1 = int(b[lo]), int(b[hi])
            parts.append(_decode_segment_rows(r, seg, specs, r0, r1, b, lo, hi, B, C, w, bf16, info, columns))
    finally:
        r.close()
    out = _assemble(parts, specs, table, ckpt_dir, bf16)
    out.update(bytes_read=r.bytes_read, meta_bytes_read=counter[0], reads=r.reads)
    return out


def read_index(ckpt_dir: str) -> dict:
    """The validated index.json, one dict per segment with every block's offset, length and CRCs
    (versions 1-3 as stored; version 4 computed from its rules): {"files", "tables", "removed",
    "raw", "format_version"}."""
    manifest, mv = read_manifest(ckpt_dir)
    return _open_index(ckpt_dir, manifest, mv, True)


def segment_offsets(ckpt_dir: str, ix: dict, seg: dict, B: int) -> np.ndarray:
    """The B+1 bucket row offsets of one segment of `read_index`'s result (verified)."""
    r = _Reader(ckpt_dir, ix["files"])
    try:
        return _read_buckets(r, seg, B, ckpt_dir)
    finally:
        r.close()


def shard_bytes_total(ckpt_dir: str) -> int:
    """Total size of the checkpoint's shard files (per index.json)."""
    manifest, mv = read_manifest(ckpt_dir)
    ix = _open_index(ckpt_dir, manifest, mv, False)
    return sum(s for _, s in ix["files"]) if ix else 0


# ------------------------------------------------------------------------------------ chains

def read_chain(output_dir: str, ckpt_id: str, bf16: str = "float32") -> dict:
    """Read an incremental checkpoint with its whole chain (FORMAT.md "Incremental checkpoints"): follow
    `parent` through sibling directories, checking each parent's manifest SHA-256 and bucket count, then
    compose every table base first, the newest row or removal of an id winning.

    Returns {"links": [ckpt ids, base first], "tables": {name: {"ids", "slots"}}, "newest": the newest
    link's read_checkpoint result}."""
    output_dir = os.fspath(output_dir)
    chain, seen = [], set()
    cur = ckpt_id
    expect_sha = None
    while True:
        if cur in seen:
            _fail(output_dir, f"the chain of {ckpt_id!r} loops at {cur!r}")
        seen.add(cur)
        d = os.path.join(output_dir, cur)
        mpath = os.path.join(d, "manifest.json")
        if not os.path.isfile(mpath):
            _fail(mpath, f"link {cur!r} of the chain of {ckpt_id!r} is missing")
        with open(mpath, "rb") as f:
            raw = f.read()
        if expect_sha is not None and hashlib.sha256(raw).hexdigest() != expect_sha:
            _fail(mpath, f"link {cur!r}: manifest SHA-256 differs from what its child recorded")
        ck = read_checkpoint(d, bf16)
        _, mv = read_manifest(d)
        chain.append((cur, ck, mv))
        if mv["parent"] is None:
            break
        cur, expect_sha = mv["parent"]
    chain.reverse()
    B = chain[-1][1]["manifest"]["num_buckets"]
    if any(ck["manifest"]["num_buckets"] != B for _, ck, _ in chain):
        _fail(output_dir, f"the links of the chain of {ckpt_id!r} differ in num_buckets")
    for tname in chain[-1][2]["tables"]:
        fns = {(mv["tables"][tname]["bucket_fn"], mv["tables"][tname]["num_rows"],
                mv["tables"][tname]["input_size"]) for _, _, mv in chain
               if tname in mv["tables"]}
        if len(fns) > 1:
            _fail(output_dir, f"table {tname!r}: the links of the chain differ in bucket function")
    newest = chain[-1][1]
    tables = {}
    for tname, spec in chain[-1][2]["tables"].items():
        # links from the newest back to the first one holding the table whole
        k = len(chain) - 1
        while chain[k][2]["tables"][tname]["changes"]:
            k -= 1
            if k < 0 or tname not in chain[k][2]["tables"]:
                _fail(output_dir, f"table {tname!r}: changes without an earlier link holding the table")
            if chain[k][2]["tables"][tname]["slots"] != spec["slots"]:
                _fail(output_dir, f"table {tname!r}: slots differ between links of the chain")
        state: Dict[int, tuple] = {}      # id -> (link, row index) of its newest row
        for j in range(k, len(chain)):
            t = chain[j][1]["tables"][tname]
            for i in t.get("removed", np.zeros(0, np.int64)).tolist() if j > k else []:
                state.pop(i, None)
            for r, i in enumerate(t["ids"].tolist()):
                state[i] = (j, r)
        ids = np.array(sorted(state), dtype=np.int64)
        slots = {}
        for sname, _ in spec["slots"]:
            rows = [chain[state[i][0]][1]["tables"][tname]["slots"][sname][state[i][1]] for i in ids.tolist()]
            proto = newest["tables"][tname]["slots"][sname]
            slots[sname] = np.stack(rows) if rows else proto[:0]
        tables[tname] = {"ids": ids, "slots": slots}
    return {"links": [c for c, _, _ in chain], "tables": tables, "newest": newest}


# ------------------------------------------------------------------------------ content digests
# FORMAT.md "Content digests": per table, slot and dense tensor, two 64-bit lane sums of one hash per
# (id, element position, element value), recomputed here from the rows this module reads.

_DIGEST_SEED = (0x243F6A8885A308D3, 0x13198A2E03707344)
_DIGEST_STEP = (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93)


def fmix64(x) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, uint64 with wrap-around."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
        return z ^ (z >> np.uint64(33))


def _row_keys(ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    u = np.asarray(ids, dtype=np.int64).view(np.uint64)
    return (mix64((u ^ np.uint64(_DIGEST_SEED[0])).view(np.int64)),
            fmix64(u ^ np.uint64(_DIGEST_SEED[1])))


def _hex(a: np.ndarray, b: np.ndarray) -> str:
    return f"{int(a.sum(dtype=np.uint64)):016x}{int(b.sum(dtype=np.uint64)):016x}"


def _mul_term(v: np.ndarray, x: np.ndarray) -> np.ndarray:
    """mulsum128's term of elements of at most 4 bytes: (v xor low half of x) times (high half of x, or 1),
    both 32-bit, an exact 64-bit product."""
    lo = (v ^ x) & np.uint64(0xFFFFFFFF)
    return lo * ((x >> np.uint64(32)) | np.uint64(1))


def digest_rows(ids: np.ndarray, rows: np.ndarray, group: int = 4096, function: str = "mulsum128") -> str:
    """The slot digest of `rows` ([n, *row shape], the on-disk dtype; BF16 as its uint16 bits) under
    `function` (the manifest's `digests.hash`)."""
    if function not in DIGEST_FUNCTIONS:
        raise ValueError(f"unknown digest function {function!r}")
    n = len(ids)
    ka, kb = _row_keys(ids)
    flat = np.ascontiguousarray(rows).reshape(n, -1) if n else np.zeros((0, 0), np.uint8)
    size = flat.dtype.itemsize
    e = np.arange(flat.shape[1], dtype=np.uint64)
    sa, sb = np.zeros(1, np.uint64), np.zeros(1, np.uint64)
    for i in range(0, n, group):   # bounded memory: a group of rows at a time
        v = flat[i:i + group].view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]).astype(np.uint64)
        with np.errstate(over="ignore"):
            xa = ka[i:i + group, None] + e[None, :] * np.uint64(_DIGEST_STEP[0])
            xb = kb[i:i + group, None] + e[None, :] * np.uint64(_DIGEST_STEP[1])
            if function == "mulsum128" and size <= 4:
                sa += _mul_term(v, xa).sum(dtype=np.uint64)
                sb += _mul_term(v, xb).sum(dtype=np.uint64)
            else:   # rowsum128, and mulsum128's 8-byte elements
                sa += mix64((v ^ xa).view(np.int64)).sum(dtype=np.uint64)
                sb += fmix64(v ^ xb).sum(dtype=np.uint64)
    return _hex(sa, sb)


def digest_ids(ids: np.ndarray) -> str:
    ka, kb = _row_keys(ids)
    return _hex(ka, kb)


DIGEST_FUNCTIONS = ("rowsum128", "mulsum128")


def content_digests(ck: dict, function: str = "mulsum128") -> dict:
    """The `digests` object that FORMAT.md defines, recomputed under `function` from a
    read_checkpoint(..., bf16="bits") result: every table stored whole (not `changes`), every dense tensor."""
    tables = {}
    for tname, t in ck["tables"].items():
        if t.get("changes"):
            continue
        tables[tname] = {"rows": len(t["ids"]), "ids": digest_ids(t["ids"]),
                         "slots": {s: digest_rows(t["ids"], a, function=function) for s, a in t["slots"].items()}}
    dense = {}
    for k, a in ck["dense"].items():
        dense[k] = {"shape": list(a.shape),
                    "digest": digest_rows(np.zeros(1, np.int64), a.reshape(1, -1), function=function)}
    return {"hash": function, "tables": tables, "dense": dense}


def check_digests(ckpt_dir: str) -> dict:
    """Read `ckpt_dir` fully and compare the manifest's `digests` with the recomputed ones (a table or
    dense key the manifest has no digest for is skipped). Returns the recomputed digests."""
    ck = read_checkpoint(ckpt_dir, bf16="bits")
    have = ck["manifest"].get("digests")
    if have is None or have.get("hash") not in DIGEST_FUNCTIONS:
        return content_digests(ck)
    got = content_digests(ck, have["hash"])
    for tname, d in have["tables"].items():
        if tname not in got["tables"]:
            _fail(ckpt_dir, f"digests name table {tname!r}, which is not stored whole")
        mine = got["tables"][tname]
        if d["rows"] != mine["rows"] or d["ids"] != mine["ids"]:
            _fail(ckpt_dir, f"table {tname!r}: ids digest {d['ids']} ({d['rows']} rows), recomputed "
                            f"{mine['ids']} ({mine['rows']} rows)")
        for s, x in d["slots"].items():
            if mine["slots"].get(s) != x:
                _fail(ckpt_dir, f"table {tname!r} slot {s!r}: digest {x}, recomputed {mine['slots'].get(s)}")
    for k, d in have.get("dense", {}).items():
        mine = got["dense"].get(k)
        if mine is None or d["digest"] != mine["digest"] or d["shape"] != mine["shape"]:
            _fail(ckpt_dir, f"dense {k!r}: digest {d}, recomputed {mine}")
    return got
