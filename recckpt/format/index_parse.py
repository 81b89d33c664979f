"""An index read back: validated field by field (docs/FORMAT.md), against its manifest where given; a
version 4 or 5 index's tables all at once where they are in order. Raises CorruptCheckpointError naming
the file and the field, before any offset in it is used."""
from __future__ import annotations

import binascii
from dataclasses import dataclass, replace

import numpy as np

from ..errors import IncompatibleCheckpointError
from . import layout
from .field_checks import I63, U32, Fields
from .geometry import TableGeometry
from .hashing import NUM_BUCKETS_LIMIT
from .names import (
    COLUMN_GROUPS_SINCE,
    FORMAT_VERSION,
    INCREMENTAL_SINCE,
    READABLE_FORMAT_VERSIONS,
    SEGMENT_DIR_SINCE,
)
from .schema import (
    Column,
    IndexDoc,
    Manifest,
    Segment,
)


def index_from_json(obj: dict, path: str, manifest: Manifest | None = None, *, worker: bool = False) -> IndexDoc:
    """Validate an index; with a manifest, also check every column length against the slot specs.
    `worker`: a worker's own index (sparse/worker-W.index.json), whose tables hold that worker's rows
    only: its row counts are not compared with the manifest's. A version 4 index needs the manifest
    (its column lengths follow from the slot specs)."""
    v = Fields(path)
    if worker and obj.get("format_version") != FORMAT_VERSION and not (
            isinstance(obj.get("format_version"), int) and obj["format_version"] >= SEGMENT_DIR_SINCE):
        manifest = None   # versions 1-3: a worker index is checked on its own
    ver = v.int(v.get(obj, "format_version", ""), "format_version")
    if ver not in READABLE_FORMAT_VERSIONS:
        raise IncompatibleCheckpointError(f"{path}: index format version {ver} is not supported")
    if manifest is not None and ver != manifest.format_version:
        v.fail("format_version", f"{ver} but the manifest says {manifest.format_version}")
    nb = v.int(v.get(obj, "num_buckets", ""), "num_buckets", 1, NUM_BUCKETS_LIMIT)
    cb = v.int(v.get(obj, "chunk_bytes", ""), "chunk_bytes", 1, 1 << 31)
    if manifest is not None and (nb, cb) != (manifest.num_buckets, manifest.chunk_bytes):
        v.fail("num_buckets/chunk_bytes", "disagree with the manifest")
    doc = IndexDoc(nb, cb, format_version=ver)
    for i, f in enumerate(v.list(v.get(obj, "files", ""), "files")):
        doc.files.append((v.relpath(v.get(f, "path", f"files[{i}]"), f"files[{i}].path"),
                          v.int(v.get(f, "size", f"files[{i}]"), f"files[{i}].size")))
    nfiles = len(doc.files)
    if ver >= SEGMENT_DIR_SINCE:
        return _index_v4(v, obj, doc, manifest, worker)

    def column(c, where, exact_len=None, one_crc=False):
        off = v.int(v.get(c, "offset", where), f"{where}.offset")
        ln = v.int(v.get(c, "length", where), f"{where}.length")
        crcs = tuple(v.int(x, f"{where}.crc32c", 0, U32)
                     for x in (v.list(v.get(c, "crc32c", where), f"{where}.crc32c")
                               if not one_crc else [v.get(c, "crc32c", where)]))
        if exact_len is not None and ln != exact_len:
            v.fail(f"{where}.length", f"{ln} but the rows and slot shape imply {exact_len}")
        if not one_crc and len(crcs) != -(-ln // cb):
            v.fail(f"{where}.crc32c", f"{len(crcs)} checksums for {ln} bytes in {cb}-byte chunks")
        return Column(off, ln, crcs)

    def segment(s, sw, slots, row_bytes):
        """One segment of `slots` (row_bytes: [8, per slot] or None when unknown), validated."""
        fi = v.int(v.get(s, "file", sw), f"{sw}.file", 0, max(nfiles, 1))
        if fi >= nfiles:
            v.fail(f"{sw}.file", "no such file")
        rows = v.int(v.get(s, "rows", sw), f"{sw}.rows")
        buckets = column(v.get(s, "buckets", sw), f"{sw}.buckets", 8 * (nb + 1), one_crc=True)
        cols_raw = v.list(v.get(s, "columns", sw), f"{sw}.columns")
        if len(cols_raw) != len(slots) + 1:
            v.fail(f"{sw}.columns", f"{len(cols_raw)} columns for ids + {len(slots)} slots")
        cols = tuple(replace(column(c, f"{sw}.columns[{k}]", None if row_bytes is None else rows * row_bytes[k]),
                             step=cb)
                     for k, c in enumerate(cols_raw))
        if row_bytes is None and cols[0].length != 8 * rows:
            v.fail(f"{sw}.columns[0].length", "ids column length is not 8 * rows")
        size = doc.files[fi][1]
        for k, c in enumerate((buckets,) + cols):
            if c.offset + c.length > size:
                v.fail(sw, f"block {k} [{c.offset}, {c.offset + c.length}) lies beyond the end of "
                           f"{doc.files[fi][0]} ({size} bytes)")
        if ver >= layout.ALIGNED_FROM_VERSION:
            for k, c in enumerate(cols[1:], 1):
                want = layout.column_start(cols[k - 1].offset + cols[k - 1].length, k, c.length, ver)
                if c.offset != want:
                    v.fail(f"{sw}.columns[{k}].offset", f"{c.offset}, expected {want}: in format version {ver} "
                                                        f"a slot column follows the previous column, padded "
                                                        f"to a multiple of {layout.COLUMN_ALIGN} when not empty")
        return Segment(fi, rows, replace(buckets, step=max(buckets.length, 1)), cols, 0, 0, nb - 1)

    for name, t in v.dict(v.get(obj, "tables", ""), "tables").items():
        where = f"tables[{name!r}]"
        slots = [v.str(s, f"{where}.slots") for s in v.list(v.get(t, "slots", where), f"{where}.slots")]
        row_bytes = None
        if manifest is not None:
            info = manifest.tables.get(name)
            if info is None:
                v.fail(where, "table is not in the manifest")
            if slots != list(info.slots):
                v.fail(f"{where}.slots", f"{slots} disagree with the manifest's {list(info.slots)}")
            row_bytes = [8] + [info.slots[s].row_bytes for s in slots]
        segs = [segment(s, f"{where}.segments[{j}]", slots, row_bytes)
                for j, s in enumerate(v.list(v.get(t, "segments", where), f"{where}.segments"))]
        if "removed" in t:
            if ver < INCREMENTAL_SINCE:
                v.fail(f"{where}.removed", f"format version {ver} has no removed ids")
            doc.removed[name] = [segment(s, f"{where}.removed[{j}]", [], [8])
                                 for j, s in enumerate(v.list(t["removed"], f"{where}.removed"))]
        doc.tables[name] = (slots, segs)
    if manifest is not None and not worker:
        _check_shard_bytes(v, doc, manifest)
    if manifest is not None:
        for name, info in manifest.tables.items():
            if name not in doc.tables:
                v.fail("tables", f"table {name!r} of the manifest has no index entry")
            rows = sum(s.rows for s in doc.tables[name][1])
            if rows != info.rows:
                v.fail(f"tables[{name!r}]", f"segments hold {rows} rows, the manifest says {info.rows}")
            gone = sum(s.rows for s in doc.removed.get(name, []))
            if gone != info.removed:
                v.fail(f"tables[{name!r}].removed", f"segments hold {gone} removed ids, the manifest says "
                                                    f"{info.removed}")
    return doc


def _check_shard_bytes(v: Fields, doc: IndexDoc, manifest: Manifest) -> None:
    """The merged index's shard files add up to the manifest's `shard_bytes`, where it records them."""
    total = sum(n for _, n in doc.files)
    if manifest.shard_bytes is not None and manifest.shard_bytes != total:
        v.fail("files", f"shard files of {total} bytes, the manifest's shard_bytes says {manifest.shard_bytes}")


# ------------------------------------------------------------------------------ version 4 index
def _crcs_from_hex(text: str) -> np.ndarray | None:
    """CRC32Cs written as 8 lower-case hex digits each, as uint32; None where `text` holds any other
    character (or is not a whole number of CRCs). `unhexlify` refuses anything but hex digits, and writing
    the bytes back as hex matches the text only where every digit was lower case: two passes in C, where a
    regular expression costs ten times more on the megabytes of CRCs an index of many tables holds."""
    if len(text) % 8 or not text.isascii():
        return None
    try:
        raw = binascii.unhexlify(text)
    except binascii.Error:
        return None
    if raw.hex() != text:
        return None
    return np.frombuffer(raw, dtype=">u4").astype(np.uint32)


_SEG_KEYS = ("file", "offset", "rows", "dir", "first", "last")


def _int_array(v: Fields, raw, where: str, n: int | None) -> np.ndarray:
    """A JSON list of integers as int64, checked in one vectorised step (no per-element Python)."""
    lst = v.list(raw, where)
    if n is not None and len(lst) != n:
        v.fail(where, f"{len(lst)} entries, the other lists have {n}")
    if not lst:
        return np.zeros(0, dtype=np.int64)
    try:
        a = np.asarray(lst)
    except (OverflowError, ValueError, TypeError):
        v.fail(where, "expected a list of integers")
    if a.ndim != 1 or a.dtype.kind not in "iu" or a.dtype.itemsize > 8:
        v.fail(where, "expected a list of integers")
    if a.dtype.kind == "u" and a.size and a.max() >= I63:
        v.fail(where, "an integer beyond 2**63")
    return a.astype(np.int64, copy=False)


@dataclass
class _SegArrays:
    """One table's SEGS after the vectorised checks (phase 1), before its CRCs are decoded."""
    where: str
    raw: dict
    a: dict[str, np.ndarray]
    packed: np.ndarray
    block: np.ndarray
    id0: np.ndarray        # [s] version 5: first id of a row run, -1 for a segment storing its ids
    starts: np.ndarray     # [s, ncols] column offsets
    lengths: np.ndarray    # [s, ncols] (columns past a segment's block's count have length 0)
    ends: np.ndarray       # [s] where each segment ends
    ncols: list[int]       # columns of a segment of each block (ids first)
    rows_total: int | None = None   # rows of every segment together (None: summed here)

    def __post_init__(self):
        if self.rows_total is None:
            self.rows_total = int(self.a["rows"].sum())


def _segs_v4(v: Fields, raw, where: str, doc: IndexDoc, geo: TableGeometry | None,
             with_packed: bool, with_block: bool, nblocks: int) -> _SegArrays:
    """Phase 1 of one table's SEGS, vectorised (no per-segment Python): list lengths, ranges, column
    positions by the layout rule, each segment inside its file. `geo`: the table's columns per column
    block (format/geometry.py); None for removed ids (one column, the ids). Version 5: a row_range table's
    segments carry `id0`, and a row run (id0 >= 0) stores no directory and no ids."""
    seg = v.dict(raw, where)
    a = {k: _int_array(v, v.get(seg, k, where), f"{where}.{k}", None if k == "file" else len(seg["file"]))
         for k in _SEG_KEYS}
    s = len(a["file"])
    runs = geo is not None and geo.runs and doc.format_version >= COLUMN_GROUPS_SINCE
    packed = (_int_array(v, v.get(seg, "packed", where), f"{where}.packed", s) if with_packed
              else np.zeros(s, dtype=np.int64))
    block = (_int_array(v, v.get(seg, "block", where), f"{where}.block", s) if with_block
             else np.zeros(s, dtype=np.int64))
    id0 = (_int_array(v, v.get(seg, "id0", where), f"{where}.id0", s) if runs
           else np.full(s, -1, dtype=np.int64))
    for key, present in (("packed", with_packed), ("block", with_block), ("id0", runs)):
        if key in seg and not present:
            v.fail(f"{where}.{key}", "not a field of these segments")
    extra = set(seg) - set(_SEG_KEYS) - {"packed", "block", "id0", "crc32c"}
    if extra:
        v.fail(where, f"unknown fields {sorted(extra)!r:.80}")
    nb, nfiles = doc.num_buckets, len(doc.files)

    def check(ok: np.ndarray, key: str, rule: str) -> None:
        if not ok.all():
            i = int(np.argmin(ok))
            v.fail(f"{where}.{key}[{i}]", f"{rule}")

    run = id0 >= 0
    check((a["file"] >= 0) & (a["file"] < nfiles), "file", f"not a file of the index ({nfiles} files)")
    check(a["offset"] >= 0, "offset", "negative")
    check((a["rows"] >= 1) & (a["rows"] < U32), "rows", "expected 1 <= rows < 2**32")
    check(run | ((a["dir"] >= 1) & (a["dir"] <= np.minimum(a["rows"], nb))), "dir",
          "expected 1 <= dir <= min(rows, B)")
    check((a["first"] >= 0) & (a["first"] <= a["last"]) & (a["last"] < nb), "first",
          "expected 0 <= first <= last < B")
    check(a["last"] - a["first"] + 1 >= a["dir"], "dir", "more directory entries than buckets in [first, last]")
    check((packed == 0) | (packed == 1), "packed", "expected 0 or 1")
    check((block >= 0) & (block < max(nblocks, 1)), "block", "not a column block of the table")
    if runs:
        n_rows = geo.num_rows
        check(id0 >= -1, "id0", "expected -1 (ids stored) or the first id of a row run")
        check(~run | (a["dir"] == 0), "dir", "a row run (id0 >= 0) has no directory: expected 0")
        # (id0 + rows could wrap in int64 for a hostile id0 near 2**63; N - rows cannot)
        check(~run | (id0 <= n_rows - a["rows"]), "id0", f"the row run passes the table's {n_rows} rows")
        u0 = np.where(run, id0, 0).astype(np.uint64)
        last_id = np.where(run, id0 + a["rows"] - 1, 0).astype(np.uint64)
        b0 = (u0 * np.uint64(nb) // np.uint64(n_rows)).astype(np.int64)   # < 2**64: exact in uint64
        b1 = (last_id * np.uint64(nb) // np.uint64(n_rows)).astype(np.int64)
        check(~run | ((a["first"] == b0) & (a["last"] == b1)), "first",
              "a row run's first and last buckets are those of its first and last ids")
        # Each id once per column block: the runs of a block must not overlap (explicit ids are checked
        # by the loaders, which read them).
        r = np.nonzero(run)[0]
        order = r[np.lexsort((id0[r], block[r]))]
        same = block[order][1:] == block[order][:-1]
        ends = id0[order][:-1] + a["rows"][order][:-1]
        if np.any(same & (id0[order][1:] < ends)):
            i = int(order[1:][np.argmax(same & (id0[order][1:] < ends))])
            v.fail(f"{where}.id0[{i}]", "row runs of one column block overlap: each row is stored once")
    widths = [[8]] if geo is None else [geo.widths(j) for j in range(max(nblocks, 1))]
    aligned = [[False]] if geo is None else [geo.begins_slot(j) for j in range(max(nblocks, 1))]
    ncols = [len(w) for w in widths]
    width = max(ncols)
    if any(x * (U32 - 1) >= (1 << 62) for rbs in widths for x in rbs):
        v.fail(where, "a slot row is too large for any segment")
    rb = np.asarray([w + [0] * (width - len(w)) for w in widths], dtype=np.int64)[block]     # [s, ncols]
    al = np.asarray([x + [False] * (width - len(x)) for x in aligned], dtype=bool)[block]   # [s, ncols]
    lengths = a["rows"][:, None] * rb                          # < 2**62 (checked above)
    lengths[run, 0] = 0                                        # a run stores no ids
    starts = np.empty_like(lengths)
    pos = a["offset"] + 8 * a["dir"]
    check(pos < (1 << 62), "offset", "beyond any file")
    unpadded = packed.astype(bool)
    for k in range(width):
        ln = lengths[:, k]
        starts[:, k] = np.where(unpadded | (ln == 0) | ~al[:, k], pos, layout.align_up(pos))
        pos = starts[:, k] + lengths[:, k]
        check(pos < (1 << 62), "offset", "beyond any file")
    sizes = np.asarray([sz for _, sz in doc.files], dtype=np.int64)
    if s:
        check(pos <= sizes[a["file"]], "offset", "the segment ends beyond its file")
    return _SegArrays(where, seg, a, packed, block, id0, starts, lengths, pos, ncols)


def _tiling_v4(v: Fields, doc: IndexDoc, parts: list[_SegArrays]) -> None:
    """The segments of every table tile each shard file exactly (docs/FORMAT.md, Tiling), checked on
    the arrays before anything per segment is built: a segment listed twice, overlapping or leaving a
    gap is refused in one vectorised pass, naming the file."""
    nfiles = len(doc.files)
    if not parts:
        fi = off = end = np.zeros(0, dtype=np.int64)
    else:
        fi = np.concatenate([p.a["file"] for p in parts])
        off = np.concatenate([p.a["offset"] for p in parts])
        end = np.concatenate([p.ends for p in parts])
    order = np.lexsort((end, off, fi))
    fi, off, end = fi[order], off[order], end[order]
    first = np.ones(len(fi), dtype=bool)
    first[1:] = fi[1:] != fi[:-1]
    want = np.zeros(len(fi), dtype=np.int64)
    want[1:] = end[:-1]
    want[first] = 0
    last_end = np.zeros(nfiles, dtype=np.int64)
    if len(fi):
        last = np.ones(len(fi), dtype=bool)
        last[:-1] = fi[:-1] != fi[1:]
        last_end[fi[last]] = end[last]
    sizes = np.asarray([sz for _, sz in doc.files], dtype=np.int64)
    bad = np.nonzero(off != want)[0]
    short = np.nonzero(last_end != sizes)[0]
    if bad.size or short.size:
        f = int(fi[bad[0]]) if bad.size and (not short.size or fi[bad[0]] <= short[0]) else int(short[0])
        nbad = int(np.count_nonzero(fi[bad] == f)) if bad.size else 0
        parts_msg = []
        if nbad:
            i = int(bad[np.argmax(fi[bad] == f)])
            parts_msg.append(f"{nbad} segment(s) overlap, repeat or leave a gap (one at [{off[i]}, {end[i]}) "
                             f"where byte {want[i]} was due)")
        if last_end[f] != sizes[f]:
            parts_msg.append(f"the segments end at byte {last_end[f]} of {sizes[f]}")
        files_bad = len(set(fi[bad].tolist()) | set(short.tolist()))
        more = f" (and {files_bad - 1} more shard files)" if files_bad > 1 else ""
        v.fail("files", f"{doc.files[f][0]}: the index's segments do not tile the file: {'; '.join(parts_msg)}"
                        f"{more}. Every byte of a shard file belongs to exactly one segment; the index is corrupt "
                        f"or hostile")


def _segments_from(v: Fields, doc: IndexDoc, p: _SegArrays) -> list[Segment]:
    """Phase 2: decode the table's CRC string and build its Segment records."""
    steps = layout.checksum_steps(p.lengths, doc.chunk_bytes)
    has_dir = (p.id0 < 0).astype(np.int64)   # the directory's CRC (a run has none), then the columns'
    counts = has_dir + layout.crc_count(p.lengths, steps).sum(axis=1)
    text = v.str(v.get(p.raw, "crc32c", p.where), f"{p.where}.crc32c")
    total = int(counts.sum())
    crcs = _crcs_from_hex(text) if len(text) == 8 * total else None
    if crcs is None:
        v.fail(f"{p.where}.crc32c", f"expected {total} CRCs as {8 * total} lower-case hex digits, got "
                                    f"{len(text)} characters")
    a = {k: x.tolist() for k, x in p.a.items()}
    packed_l, block_l, id0_l, dir_l = p.packed.tolist(), p.block.tolist(), p.id0.tolist(), has_dir.tolist()
    starts_l, lengths_l, steps_l = p.starts.tolist(), p.lengths.tolist(), steps.tolist()
    ends_l = np.cumsum(counts).tolist()
    out = []
    lo = 0
    for i in range(len(a["file"])):
        c = lo + dir_l[i]
        cols = []
        for k in range(p.ncols[block_l[i]]):
            ln, st = lengths_l[i][k], steps_l[i][k]
            m = -(-ln // st)
            cols.append(Column(starts_l[i][k], ln, crcs[c:c + m], st))
            c += m
        off, k_dir = a["offset"][i], a["dir"][i]
        out.append(Segment(a["file"][i], a["rows"][i], Column(off, 8 * k_dir, crcs[lo:lo + dir_l[i]], 8 * k_dir),
                           tuple(cols), k_dir, a["first"][i], a["last"][i], bool(packed_l[i]), block_l[i],
                           id0_l[i]))
        lo = ends_l[i]
    return out


def _index_v4(v: Fields, obj: dict, doc: IndexDoc, manifest: Manifest | None, worker: bool) -> IndexDoc:
    tables = v.dict(v.get(obj, "tables", ""), "tables")
    if manifest is None:
        if tables:
            v.fail("tables", "a version 4 index is validated against its manifest (its slot specs)")
        return doc
    # Phase 1: fields, ranges, where every segment ends, row counts; every table at once, or (when
    # anything is wrong) table by table, which finds and words the first problem.
    phase1 = _phase1_all_tables(v, tables, doc, manifest, worker)
    if phase1 is None:
        phase1 = _phase1_by_table(v, tables, doc, manifest, worker)
    if not worker:
        for name in manifest.tables:
            if name not in tables:
                v.fail("tables", f"table {name!r} of the manifest has no index entry")
        _check_shard_bytes(v, doc, manifest)
    _tiling_v4(v, doc, [p for _, _, segs, rem, _ in phase1 for p in (segs, rem) if p is not None])
    # Phase 2: the CRCs, and the records the readers use: every table at once when all pass, else table by
    # table (which finds and words the first problem).
    parts = [p for _, _, segs, rem, _ in phase1 for p in (segs, rem) if p is not None]
    at_once = _segments_all(parts, doc)
    built = iter(at_once if at_once is not None else [_segments_from(v, doc, p) for p in parts])
    for name, slots, segs, removed, blocked in phase1:
        doc.tables[name] = (slots, next(built))
        if removed is not None:
            doc.removed[name] = next(built)
        if blocked:
            doc.blocked.add(name)
    return doc


def _phase1_all_tables(v: Fields, tables: dict, doc: IndexDoc, manifest: Manifest, worker: bool) -> list | None:
    """`_phase1_by_table`'s result with every table's segments checked at once (`_segs_v4_all`), or None
    when anything would fail (the caller then runs `_phase1_by_table` for the exact finding)."""
    items, tabs = [], []
    for name, t in tables.items():
        info = manifest.tables.get(name)
        if type(t) is not dict or info is None or "segments" not in t or t.get("slots") != list(info.slots):
            return None
        geo = info.geometry(doc.format_version)
        where = f"tables[{name!r}]"
        # (the geometry has row runs only where the index's version has them)
        items.append(_SegsInput(f"{where}.segments", t["segments"], geo.widths_per_block, geo.begins_per_block,
                                True, info.column_blocks is not None, geo.num_rows))
        if "removed" in t:
            if not info.changes:
                return None
            items.append(_SegsInput(f"{where}.removed", t["removed"], *_IDS_ONLY, False, False))
        tabs.append((name, info, "removed" in t, geo))
    parts = _segs_v4_all(items, doc)
    if parts is None:
        return None
    out, k = [], 0
    for name, info, has_removed, geo in tabs:
        segs = parts[k]
        removed = parts[k + 1] if has_removed else None
        k += 2 if has_removed else 1
        if not worker:
            nblocks = len(geo.blocks)
            per_block = (np.bincount(segs.block, weights=segs.a["rows"], minlength=nblocks).tolist() if nblocks > 1
                         else (segs.rows_total,))
            gone = removed.rows_total if removed is not None else 0
            if any(r != info.rows for r in per_block) or gone != info.removed:
                return None
        doc.geometry[name] = geo
        out.append((name, list(info.slots), segs, removed, info.column_blocks is not None))
    return out


def _phase1_by_table(v: Fields, tables: dict, doc: IndexDoc, manifest: Manifest, worker: bool) -> list:
    """Phase 1 of `_index_v4`, vectorised per table: [(name, slots, table segs, removed segs or None,
    column-split)]; raises at the first problem."""
    return [_phase1_table(v, name, t, doc, manifest, worker) for name, t in tables.items()]


def _phase1_table(v: Fields, name, t, doc: IndexDoc, manifest: Manifest, worker: bool) -> tuple:
    """Phase 1 of one table, vectorised: (name, slots, table segs, removed segs or None, column-split);
    raises at its first problem."""
    where = f"tables[{name!r}]"
    slots = [v.str(x, f"{where}.slots") for x in v.list(v.get(t, "slots", where), f"{where}.slots")]
    info = manifest.tables.get(name)
    if info is None:
        v.fail(where, "table is not in the manifest")
    if slots != list(info.slots):
        v.fail(f"{where}.slots", f"{slots} disagree with the manifest's {list(info.slots)}")
    cb = info.column_blocks
    nblocks = len(cb.blocks) if cb is not None else 1
    geo = doc.geometry[name] = info.geometry(doc.format_version)
    segs = _segs_v4(v, v.get(t, "segments", where), f"{where}.segments", doc, geo, True,
                    cb is not None, nblocks)
    removed = None
    if "removed" in t:
        if not info.changes:
            v.fail(f"{where}.removed", "removed ids in a table that is not saved as changes")
        removed = _segs_v4(v, t["removed"], f"{where}.removed", doc, None, False, False, 1)
    if not worker:
        per_block = np.bincount(segs.block, weights=segs.a["rows"], minlength=nblocks)
        if np.any(per_block != info.rows):
            v.fail(where, f"segments hold {per_block.astype(np.int64).tolist()[:8]} rows per column block, "
                          f"the manifest says {info.rows}")
        gone = removed.rows_total if removed is not None else 0
        if gone != info.removed:
            v.fail(f"{where}.removed", f"segments hold {gone} removed ids, the manifest says {info.removed}")
    return name, slots, segs, removed, cb is not None


# --------------------------------------------------------------- version 4 and 5 index, every table at once
# An index's tables validated all at once, version 5 row runs and column groups included: the checks of
# `_segs_v4` and `_segments_from` (one table at a time, about twenty numpy calls each) run on every table's
# segment lists concatenated, so an index of a thousand small tables costs a few numpy passes and one loop
# over its segments, not a thousand rounds of calls.
#
# The rules are the per-table functions'; these only batch them, and answer None whenever anything is out
# of order: the caller then runs the per-table functions, which find the same first problem and word it
# exactly (naming the table, field and position). A hostile or corrupt index is refused with the same
# message either way, only more slowly.
_LIMIT62 = 1 << 62
#: The columns of removed ids' segments: the ids alone (row bytes and alignment, as _SegsInput takes them).
_IDS_ONLY = ([[8]], [[False]])
#: The keys a table's SEGS holds: (with packed, with block, with id0) -> keys.
_SEGS_KEYS = {(p, b, r): frozenset(_SEG_KEYS) | {"crc32c"} | ({"packed"} if p else set()) | ({"block"} if b else set())
              | ({"id0"} if r else set()) for p in (False, True) for b in (False, True) for r in (False, True)}


@dataclass(frozen=True)
class _SegsInput:
    """One table's SEGS as `_segs_v4` takes it."""
    where: str
    raw: object
    row_bytes: list[list[int]]   # per column block: bytes of a row of each column, ids first
    begins_slot: list[list[bool]]  # per column block: whether each column begins a slot (is padded)
    with_packed: bool
    with_block: bool
    runs_over: int = 0           # > 0: a version 5 row_range table of this many rows (segments carry id0)


def _ints_or_none(values: list) -> np.ndarray | None:
    """`values` as int64 when every one is a Python int in [-2**63, 2**63), else None."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, values)) != {int}:
        return None
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        return None


def _segs_v4_all(items: list[_SegsInput], doc: IndexDoc) -> list[_SegArrays] | None:
    """`_segs_v4` of every item, or None where any of them would fail."""
    #: The optional fields, with the value a segment without the field has. Where no table has one, it is
    #: filled in as an array (a hostile index of 200 000 segments costs no list of 200 000 Python ints).
    absent = {"packed": 0, "block": 0, "id0": -1}
    somewhere = {"packed": any(it.with_packed for it in items), "block": any(it.with_block for it in items),
                 "id0": any(it.runs_over > 0 for it in items)}
    cols = {k: [] for k in (*_SEG_KEYS, *absent)}
    counts, widths, aligned, base, nblocks, runs_over = [], [], [], [], [], []
    layouts = {}   # a shared geometry's lists (by identity, alive for this call) -> their first row in widths
    for it in items:
        raw = it.raw
        if type(raw) is not dict or raw.keys() != _SEGS_KEYS[(it.with_packed, it.with_block, it.runs_over > 0)]:
            return None
        n = len(raw["file"]) if type(raw["file"]) is list else -1
        for k in _SEG_KEYS:
            lst = raw[k]
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        for k, present in (("packed", it.with_packed), ("block", it.with_block), ("id0", it.runs_over > 0)):
            if not somewhere[k]:
                continue
            lst = raw[k] if present else [absent[k]] * n
            if type(lst) is not list or len(lst) != n:
                return None
            cols[k] += lst
        if any(x * (U32 - 1) >= _LIMIT62 for rbs in it.row_bytes for x in rbs):
            return None   # "a slot row is too large for any segment"
        counts.append(n)
        key = (id(it.row_bytes), id(it.begins_slot))
        row = layouts.get(key)
        if row is None:
            row = layouts[key] = len(widths)
            widths += it.row_bytes
            aligned += it.begins_slot
        base.append(row)
        nblocks.append(len(it.row_bytes))
        runs_over.append(it.runs_over)
    a = {}
    total = sum(counts)
    for k, lst in cols.items():
        a[k] = _ints_or_none(lst) if somewhere.get(k, True) else np.full(total, absent[k], dtype=np.int64)
        if a[k] is None:
            return None
    nb, nfiles = doc.num_buckets, len(doc.files)
    fi, off, rows, dirs, first, last, packed, block, id0 = (a[k] for k in (*_SEG_KEYS, "packed", "block", "id0"))
    counts_a = np.asarray(counts, dtype=np.int64)
    table_of = np.repeat(np.arange(len(items)), counts_a)
    n_rows = np.asarray(runs_over, dtype=np.int64)[table_of]   # 0 for a table without row runs (id0 all -1)
    run = id0 >= 0
    ok = ((fi >= 0) & (fi < nfiles) & (off >= 0) & (rows >= 1) & (rows < U32)
          & np.where(run, dirs == 0, (dirs >= 1) & (dirs <= np.minimum(rows, nb)))
          & (first >= 0) & (first <= last) & (last < nb)
          & (last - first + 1 >= dirs) & ((packed == 0) | (packed == 1))
          & (block >= 0) & (block < np.asarray(nblocks, dtype=np.int64)[table_of])
          & (id0 >= -1) & (~run | (id0 <= n_rows - rows)))
    if not ok.all():
        return None
    if run.any():
        r = np.nonzero(run)[0]
        nb64, nr = np.uint64(nb), n_rows[r].astype(np.uint64)   # id0 < N <= 2**40, B <= 2**24: exact
        b0 = (id0[r].astype(np.uint64) * nb64 // nr).astype(np.int64)
        b1 = ((id0[r] + rows[r] - 1).astype(np.uint64) * nb64 // nr).astype(np.int64)
        if not ((first[r] == b0) & (last[r] == b1)).all():
            return None
        order = r[np.lexsort((id0[r], block[r], table_of[r]))]   # each row once per table and column block
        same = (table_of[order][1:] == table_of[order][:-1]) & (block[order][1:] == block[order][:-1])
        if np.any(same & (id0[order][1:] < id0[order][:-1] + rows[order][:-1])):
            return None
    ncols = [len(w) for w in widths]
    width = max(ncols, default=1)
    rb = np.array([w + [0] * (width - len(w)) for w in widths], dtype=np.int64).reshape(len(widths), width)
    al = np.array([b + [False] * (width - len(b)) for b in aligned], dtype=bool).reshape(len(widths), width)
    which = np.asarray(base, dtype=np.int64)[table_of] + block
    lengths = rows[:, None] * rb[which]   # < 2**62
    lengths[run, 0] = 0                    # a run stores no ids
    al = al[which] & ~packed.astype(bool)[:, None]
    starts = np.empty_like(lengths)
    pos = off + 8 * dirs
    if (pos >= _LIMIT62).any():
        return None
    for k in range(width):
        ln = lengths[:, k]
        starts[:, k] = np.where(al[:, k] & (ln != 0), layout.align_up(pos), pos)
        pos = starts[:, k] + ln
        if (pos >= _LIMIT62).any():
            return None
    if len(pos) and (pos > np.asarray([sz for _, sz in doc.files], dtype=np.int64)[fi]).any():
        return None
    out, lo = [], 0
    rows_before = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows, out=rows_before[1:])   # exact: fewer than 2**31 segments of fewer than 2**32 rows
    rows_before = rows_before.tolist()
    for it, n, b0 in zip(items, counts, base):
        hi = lo + n
        nc = ncols[b0:b0 + len(it.row_bytes)]
        w = max(nc)
        out.append(_SegArrays(it.where, it.raw, {k: a[k][lo:hi] for k in _SEG_KEYS}, packed[lo:hi],
                              block[lo:hi], id0[lo:hi], starts[lo:hi, :w], lengths[lo:hi, :w], pos[lo:hi], nc,
                              rows_total=rows_before[hi] - rows_before[lo]))
        lo = hi
    return out


def _segments_all(parts: list[_SegArrays], doc: IndexDoc) -> list[list[Segment]] | None:
    """`_segments_from` of every part (phase 1 passed), or None where any CRC string is wrong."""
    if not parts:
        return []
    width = max(p.lengths.shape[1] for p in parts)
    lengths = np.zeros((sum(len(p.ends) for p in parts), width), dtype=np.int64)
    lo = 0
    for p in parts:
        lengths[lo:lo + len(p.ends), :p.lengths.shape[1]] = p.lengths
        lo += len(p.ends)
    has_dir = (np.concatenate([p.id0 for p in parts]) < 0).astype(np.int64)   # a row run has no directory
    steps = layout.checksum_steps(lengths, doc.chunk_bytes)
    per_col = layout.crc_count(lengths, steps)
    counts = has_dir + per_col.sum(axis=1)   # the directory's CRC, then the columns'
    texts, lo = [], 0
    for p in parts:
        text = p.raw.get("crc32c") if type(p.raw) is dict else None
        n = len(p.ends)
        if type(text) is not str or len(text) != 8 * int(counts[lo:lo + n].sum()):
            return None
        texts.append(text)
        lo += n
    crcs = _crcs_from_hex("".join(texts))
    if crcs is None:
        return None
    ends = np.cumsum(counts).tolist()
    lengths_l, steps_l, per_l, dir_l = lengths.tolist(), steps.tolist(), per_col.tolist(), has_dir.tolist()
    out, i, c0 = [], 0, 0
    for p in parts:
        file_l, off_l, rows_l, k_dir_l, first_l, last_l = (p.a[k].tolist() for k in _SEG_KEYS)
        packed_l, block_l, id0_l, starts_l = p.packed.tolist(), p.block.tolist(), p.id0.tolist(), p.starts.tolist()
        segs = []
        for j in range(len(file_l)):
            c = c0 + dir_l[i]
            cs = []
            for k in range(p.ncols[block_l[j]]):
                m = per_l[i][k]
                cs.append(Column(starts_l[j][k], lengths_l[i][k], crcs[c:c + m], steps_l[i][k]))
                c += m
            k_dir = k_dir_l[j]
            segs.append(Segment(file_l[j], rows_l[j], Column(off_l[j], 8 * k_dir, crcs[c0:c0 + dir_l[i]], 8 * k_dir),
                                tuple(cs), k_dir, first_l[j], last_l[j], bool(packed_l[j]), block_l[j], id0_l[j]))
            c0 = ends[i]
            i += 1
        out.append(segs)
    return out
