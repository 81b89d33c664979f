"""The structural rule of shard files, checked before any byte of them is read or any buffer sized.

Every shard file is tiled exactly by the blocks the index places in it (each segment's bucket offsets,
ids and slot columns): no overlap, no gap, no block shared by two segments, the last block ending at
the file's recorded size. Only format version 2's alignment padding (zeros before a non-empty slot
column, up to the next multiple of layout.COLUMN_ALIGN) lies between blocks. With the sizes checked against
the files on disk, this bounds every read and allocation of a load by the bytes on disk: a block
listed twice, or zero-row segments sharing one large bucket block, would otherwise be read (and
buffered) once per mention. The loader and `verify` both use this module; `verify` reports every
finding, the loader stops at the first.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import CorruptCheckpointError
from . import layout
from .schema import IndexDoc

#: Misplaced blocks quoted per file in a finding (the count is always given).
EXAMPLES = 3


def overclaimed_file(obj) -> tuple[str, int, int] | None:
    """For a version 1-3 index as parsed JSON, before it is validated segment by segment (a few Python
    objects per segment: a hostile index of 100 000 copies of one segment took 5x a json.loads to
    refuse): (path, bytes claimed, recorded size) of the first file whose blocks add up to more bytes
    than its recorded size. Blocks that tile a file add up to at most its size (padding lies between
    them), so this is a sure refusal, found in one light pass. Anything malformed gives None: the full
    validation reports it precisely."""
    def count(x) -> int:
        if type(x) is not int or x < 0:
            raise ValueError
        return x
    try:
        files = obj["files"]
        sizes = [count(f["size"]) for f in files]
        claimed = [0] * len(sizes)
        for t in obj["tables"].values():
            for segs in (t["segments"], t.get("removed", [])):
                for seg in segs:
                    fi = count(seg["file"])
                    claimed[fi] += count(seg["buckets"]["length"]) + sum(count(c["length"]) for c in seg["columns"])
    except (TypeError, KeyError, IndexError, AttributeError, ValueError):
        return None
    for f, c, n in zip(files, claimed, sizes):
        if c > n:
            return str(f.get("path")), c, n
    return None


def tiling_problems(index: IndexDoc, describe: Callable[[str], str]) -> dict[int, CorruptCheckpointError]:
    """file position in `index.files` -> the finding for that file, for every file not tiled exactly.
    `describe(rel)` names a file in messages. Linear in the number of blocks (plus a sort)."""
    nfiles = len(index.files)
    fis, offs, lens, aligned = [], [], [], []
    ver = index.format_version
    # Table segments and an incremental checkpoint's removed-id segments share the shard files; a column
    # that begins a slot is aligned (format/geometry.py: the other column groups of a slot follow directly).
    begins = {name: index.geometry_of(name) for name in index.tables}
    for name, segs in [(name, segs) for name, (_, segs) in index.tables.items()] + [
            (None, segs) for segs in index.removed.values()]:
        for s in segs:
            first = begins[name].begins_slot(s.block) if name is not None else [False]
            fis.append(s.file)
            offs.append(s.buckets.offset)
            lens.append(s.buckets.length)
            aligned.append(False)
            for k, c in enumerate(s.columns):
                fis.append(s.file)
                offs.append(c.offset)
                lens.append(c.length)
                aligned.append(layout.is_aligned(k, c.length, ver) and first[k] and not s.packed)
    fi = np.asarray(fis, dtype=np.int64)
    off = np.asarray(offs, dtype=np.int64)   # schema validation: 0 <= offset + length <= size < 2**63
    ln = np.asarray(lens, dtype=np.int64)
    al = np.asarray(aligned, dtype=bool)
    order = np.lexsort((ln, off, fi))
    fi, off, ln, al = fi[order], off[order], ln[order], al[order]
    end = off + ln
    # Where each block must start: where the previous block of its file ends (0 for a file's first),
    # moved up to the alignment boundary for an aligned column.
    first = np.ones(len(fi), dtype=bool)
    first[1:] = fi[1:] != fi[:-1]
    prev_end = np.zeros(len(fi), dtype=np.int64)
    prev_end[1:] = end[:-1]
    prev_end[first] = 0
    want = np.where(al, layout.align_up(prev_end), prev_end)
    bad = np.nonzero(off != want)[0]
    out: dict[int, CorruptCheckpointError] = {}
    by_file: dict[int, list[int]] = {}
    for i in bad.tolist():
        by_file.setdefault(int(fi[i]), []).append(i)
    # The blocks of a file must reach exactly its recorded size (a file with no block must be empty).
    last_end = np.zeros(nfiles, dtype=np.int64)
    if len(fi):
        last = np.ones(len(fi), dtype=bool)
        last[:-1] = fi[:-1] != fi[1:]
        last_end[fi[last]] = end[last]
    sizes = np.asarray([s for _, s in index.files], dtype=np.int64)
    for f in range(nfiles):
        misplaced = by_file.get(f, [])
        short = last_end[f] != sizes[f] if nfiles else False
        if not misplaced and not short:
            continue
        rel = index.files[f][0]
        where = describe(rel)
        parts = []
        if misplaced:
            ex = ", ".join(f"[{off[i]}, {end[i]}) where byte {want[i]} was due" for i in misplaced[:EXAMPLES])
            parts.append(f"{len(misplaced)} block(s) overlap, repeat or leave a gap ({ex}"
                         f"{', ...' if len(misplaced) > EXAMPLES else ''})")
        if short:
            parts.append(f"the blocks end at byte {last_end[f]} of {sizes[f]}")
        out[f] = CorruptCheckpointError(
            f"{where}: the index's blocks do not tile the file: {'; '.join(parts)}. Every byte of a shard "
            f"file belongs to exactly one block; the index is corrupt or hostile", where)
    return out


def check_tiling(index: IndexDoc, describe: Callable[[str], str]) -> None:
    """Raise the first finding of `tiling_problems` (saying how many files are affected)."""
    problems = tiling_problems(index, describe)
    if problems:
        first = problems[min(problems)]
        if len(problems) > 1:
            raise CorruptCheckpointError(f"{first} (and {len(problems) - 1} more shard files)", first.path)
        raise first
