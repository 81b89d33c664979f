"""The indexes of a chain's links validated together, in one pass of `index_parse.index_from_json`.

A load of a chain opens every link; validating a hundred small increment indexes one by one cost about
as much as the whole full load of their base (the validation is vectorised over segments, so each call
pays a fixed price). Version 4 and 5 links whose manifests describe their tables alike (bucket count, chunk
size, and per table everything but its row and removed-id counts) and whose index holds version 4's
fields only have their indexes concatenated by the format's own merge rule (docs/FORMAT.md, "Merging": the files one after
another, each table's SEGS lists and CRC strings concatenated, `file` re-pointed) and validated once,
as a worker index is (its rows are not compared with the manifest); the validated segments are then
cut back per link.

What that leaves to one index alone is checked per link before the merge, on the raw JSON: every field
list of a SEGS as long as its `file` list and the same fields in every link, every `file` naming one of
the link's own files, the table rows (per column block) and removed ids its manifest records, the
shard bytes its manifest records, the tables of its manifest and no other; and after it, that each
link's CRC string holds exactly its segments' checksums. A link that fails any of these, or a group
whose merged validation fails, is validated on its own (`CheckpointReader.parsed_index`), which finds
and words the problem exactly: the merge only ever saves time, it never decides what is valid.

Links of a later format version are validated on their own, and so is an index carrying a field version
4 does not have: the merge concatenates only what it knows to be per segment or per file, and a later
field (version 5's row runs, `id0`, whose rules span segments: runs of a column block must not overlap)
may have rules that span segments. A version 5 index without them (tables bucketed by hash or by id
range) has version 4's fields and rules, and is merged. Teaching this module a later version means adding
it to `MERGED_VERSIONS` with its fields.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from . import gcpause, names
from .checkpoint import CheckpointReader
from .index_parse import index_from_json
from .schema import IndexDoc, Manifest

_PARTS = ("segments", "removed")
#: The format versions whose indexes are merged, and the fields of their indexes and of their SEGS; any
#: other version, or an index holding any other field, is validated on its own (module docstring).
MERGED_VERSIONS = (names.SEGMENT_DIR_SINCE, names.COLUMN_GROUPS_SINCE)   # a version 5 index with version 4's
#                                                                       fields (no row runs) has version 4's rules
_TOP = frozenset({"format_version", "num_buckets", "chunk_bytes", "files", "tables"})
_SEGS = frozenset({"file", "offset", "rows", "dir", "first", "last", "packed", "block", "crc32c"})


@dataclass
class _Span:
    """Where one link's index lies in the merged one."""
    link: CheckpointReader
    first_file: int
    files: int
    segs: dict[tuple[str, str], tuple[int, int, int]]   # (table, part) -> (first segment, segments, CRC chars)


def parse_indexes(links: Sequence[CheckpointReader]) -> None:
    """Validate the indexes of `links` not parsed yet, together where their manifests allow (module
    docstring). Links left out, and links of a group that did not validate together, are left to their
    own `parsed_index`, which reports any problem; nothing here raises for a bad index."""
    groups: list[tuple[tuple, list[CheckpointReader]]] = []
    for link in links:
        m = link.manifest
        if link.index_parsed or m.index is None or m.format_version not in MERGED_VERSIONS:
            continue
        sig = _signature(m)
        for key, members in groups:
            if key == sig:
                members.append(link)
                break
        else:
            groups.append((sig, [link]))
    for _, members in groups:
        if len(members) > 1:
            _validate_group(members)


def _signature(m: Manifest) -> tuple:
    """What an index is validated against, beyond each link's own counts: the tables' every other field,
    so that one a later version adds to them is compared too."""
    return (m.format_version, m.num_buckets, m.chunk_bytes,
            [(name, list(t.slots.items()), replace(t, rows=0, removed=0)) for name, t in m.tables.items()])


def _validate_group(links: list[CheckpointReader]) -> None:
    objs = []
    for link in links:
        try:
            objs.append(link.index_object())
        except (CorruptCheckpointError, IncompatibleCheckpointError):
            objs.append(None)   # (its own parse reports it)
    merged, spans = _merge([(link, obj) for link, obj in zip(links, objs) if obj is not None])
    del objs
    if len(spans) < 2:
        return
    ref = spans[0].link.manifest
    try:
        with gcpause.paused():
            doc = index_from_json(merged, spans[0].link.describe(ref.index), ref, worker=True)
    except (CorruptCheckpointError, IncompatibleCheckpointError):
        return                  # each link's own validation finds which one, and says why
    docs = [_cut(doc, span) for span in spans]
    if all(d is not None for d in docs):
        for span, d in zip(spans, docs):
            span.link.use_index(d)


def _merge(items: list[tuple[CheckpointReader, dict]]) -> tuple[dict, list[_Span]]:
    """The merged index object of the links whose raw index passes the per-link checks, and their spans."""
    files: list = []
    tables: dict[str, dict] = {}
    crcs: dict[tuple[str, str], list[str]] = {}
    keys: dict[tuple[str, str], frozenset] = {}
    spans = []
    ref = None
    for link, obj in items:
        m = link.manifest
        span = _Span(link, len(files), 0, {})
        try:
            if not _fits(obj, m, span, keys, tables, crcs):
                continue
        except (TypeError, KeyError, AttributeError, ValueError, IndexError):
            continue            # malformed: its own validation says how
        if ref is None:
            ref = m
        files += obj["files"]
        spans.append(span)
    merged = {"format_version": ref.format_version if ref else 0, "num_buckets": ref.num_buckets if ref else 0,
              "chunk_bytes": ref.chunk_bytes if ref else 0, "files": files, "tables": tables}
    for (name, part), texts in crcs.items():
        tables[name][part]["crc32c"] = "".join(texts)
    return merged, spans


def _fits(obj, m: Manifest, span: _Span, keys: dict, tables: dict, crcs: dict) -> bool:
    """Check what the merged validation cannot see of one link's raw index and, if it passes, add its
    tables to the merge (module docstring). False leaves the link to its own validation."""
    if (type(obj) is not dict or obj.keys() != _TOP or type(obj["files"]) is not list
            or type(obj["tables"]) is not dict):
        return False
    if (obj.get("format_version"), obj.get("num_buckets"), obj.get("chunk_bytes")) != (
            m.format_version, m.num_buckets, m.chunk_bytes):
        return False
    nfiles = len(obj["files"])
    if m.shard_bytes is not None and sum(f["size"] for f in obj["files"]) != m.shard_bytes:
        return False
    if obj["tables"].keys() != m.tables.keys():
        return False
    adds = []
    for name, t in obj["tables"].items():
        info = m.tables[name]
        if (type(t) is not dict or "segments" not in t or not t.keys() <= {"slots", *_PARTS}
                or t.get("slots") != list(info.slots)):
            return False
        for part in _PARTS:
            if part not in t:   # (only "removed": without it, no ids were removed)
                if info.removed:
                    return False
                continue
            seg = t[part]
            if (type(seg) is not dict or not seg.keys() <= _SEGS or type(seg.get("file")) is not list
                    or type(seg.get("crc32c")) is not str):
                return False
            n = len(seg["file"])
            if keys.setdefault((name, part), frozenset(seg)) != frozenset(seg):
                return False
            if any(type(v) is not list or len(v) != n for k, v in seg.items() if k != "crc32c"):
                return False
            if not all(type(f) is int and 0 <= f < nfiles for f in seg["file"]):
                return False
            if part == "segments":
                nblocks = len(info.column_blocks.blocks) if info.column_blocks is not None else 1
                per_block = [0] * nblocks
                for b, r in zip(seg.get("block", [0] * n), seg["rows"]):
                    per_block[b] += r
                if any(x != info.rows for x in per_block):
                    return False
            elif sum(seg["rows"]) != info.removed:
                return False
            adds.append((name, part, seg, n))
    for name, part, seg, n in adds:
        t = tables.setdefault(name, {"slots": list(m.tables[name].slots)})
        into = t.setdefault(part, {k: [] for k in seg if k != "crc32c"})
        span.segs[(name, part)] = (len(into["file"]), n, len(seg["crc32c"]))
        for k, v in seg.items():
            if k == "file":
                into[k] += [f + span.first_file for f in v]
            elif k != "crc32c":
                into[k] += v
        crcs.setdefault((name, part), []).append(seg["crc32c"])
    span.files = nfiles
    return True


def _cut(doc: IndexDoc, span: _Span) -> IndexDoc | None:
    """The part of the merged `doc` that is `span`'s link's index, its segments' `file` pointing into
    its own files again; None if the link's CRC strings did not hold exactly its segments' checksums."""
    out = IndexDoc(doc.num_buckets, doc.chunk_bytes, format_version=doc.format_version, blocked=set(doc.blocked))
    out.files = doc.files[span.first_file:span.first_file + span.files]
    out.geometry = {name: doc.geometry[name] for name, _ in span.segs if name in doc.geometry}
    for (name, part), (first, n, chars) in span.segs.items():
        whole = doc.tables[name][1] if part == "segments" else doc.removed[name]
        mine = whole[first:first + n]
        if 8 * sum(1 + sum(len(c.crc32c) for c in seg.columns) for seg in mine) != chars:
            return None
        if span.first_file:
            mine = [replace(seg, file=seg.file - span.first_file) for seg in mine]
        if part == "segments":
            out.tables[name] = (doc.tables[name][0], mine)
        else:
            out.removed[name] = mine
    return out
