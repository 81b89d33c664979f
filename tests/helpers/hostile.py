"""Test helper: edit a checkpoint the way an attacker would, re-signing every checksum so that only
structural validation stands between the file and the loader."""
from __future__ import annotations

import json as _json
import os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys
from dataclasses import dataclass as _dataclass

from recckpt import _C
from recckpt.format import checked_json

CAP = 1 << 30


def _is_index(rel: str) -> bool:
    return rel == "index.json" or rel.endswith(".index.json")


def read_json(ckpt: str, rel: str) -> dict:
    """A metadata file as JSON: checked (its self-checksum verified), or a format version 4 index."""
    data = open(os.path.join(ckpt, rel), "rb").read()
    if _is_index(rel) and b'"crc32c":' not in data[-40:] and _json.loads(data).get("format_version", 0) >= 4:
        return checked_json.loads_unchecked(data, rel, CAP)
    return checked_json.loads(data, rel, CAP)


def write_json(ckpt: str, rel: str, obj: dict) -> None:
    """Write a metadata file as its format version has it (a checked JSON file with a valid
    self-checksum; a version 4 index without one) and, unless it is the manifest, re-sign it there."""
    if _is_index(rel) and isinstance(obj.get("format_version"), int) and obj["format_version"] >= 4:
        open(os.path.join(ckpt, rel), "wb").write(checked_json.dumps_unchecked(obj))
    else:
        open(os.path.join(ckpt, rel), "wb").write(checked_json.dumps(obj))
    if rel != "manifest.json":
        resign(ckpt, rel)


def flip_byte(path: str, offset: int, mask: int = 0x01) -> None:
    """Damage a file in place: XOR the byte at `offset` with `mask` (no checksum re-signed)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def resign(ckpt: str, rel: str) -> None:
    """Record `rel`'s current size and CRC in the manifest and re-sign the manifest."""
    data = open(os.path.join(ckpt, rel), "rb").read()
    m = read_json(ckpt, "manifest.json")
    m["files"][rel] = {"size": len(data), "crc32c": _C.crc32c(data)}
    write_json(ckpt, "manifest.json", m)


# ================================================================ the hostile-input corpus
# One generator per attack class. Each builds, under a fresh directory, an output directory holding a
# good checkpoint "a" (step 3) and the attacked checkpoint "b" (step 4, or "a" itself for attacks on
# the only checkpoint), and returns a Case: what to run on it in a child process and what must happen.

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


@_dataclass(frozen=True)
class Case:
    name: str
    out_dir: str
    action: str                 # see hostile_child.py: load, load_id, verify, listing
    ckpt_id: str | None = None
    error: str | None = None    # exact class name of the error that must escape (None: must succeed)
    names: str | None = None    # what the error (or the verify report) must name: the file
    seconds: float = 30.0       # the time bound of the action in the child
    expect_step: int | None = None   # on success: the step the loaded model must hold
    json_ratio: float | None = None  # also bound the action by this many times a json.loads of the
    #                                  checkpoint's index.json, measured in the same child
    rss_per_disk_byte: float = 2.0   # peak RSS growth bound: this many times the bytes on disk + 256 MB

    def to_json(self) -> str:
        return _json.dumps(self.__dict__)


@_dataclass(frozen=True)
class Outcome:
    error: str | None
    message: str
    path: str | None
    seconds: float
    rss_growth: int             # peak RSS during the action minus RSS before it, bytes
    detail: dict

    @property
    def text(self) -> str:
        return f"{self.error}: {self.message} (path={self.path})"


def bytes_on_disk(root: str) -> int:
    """Regular-file bytes under `root`, links not followed (a link to /dev/zero counts 0)."""
    total = 0
    root = root[len("local://"):] if root.startswith("local://") else root
    for d, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            if _stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def run_case(case: Case, timeout: float | None = None) -> Outcome:
    """Run `case` in a child process (time and memory measured there); a hang is killed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.path.dirname(_HERE)]))
    budget = timeout if timeout is not None else case.seconds + 60   # + interpreter and torch start-up
    try:
        p = _subprocess.run([_sys.executable, "-m", "helpers.hostile_child", case.to_json()], env=env,
                            capture_output=True, text=True, timeout=budget)
    except _subprocess.TimeoutExpired:
        raise AssertionError(f"{case.name}: the child did not finish in {budget:.0f} s (hang)") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise AssertionError(f"{case.name}: child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    r = _json.loads(lines[-1][len("RESULT "):])
    return Outcome(r["error"], r["message"], r["path"], r["seconds"], r["rss_growth"], r["detail"])


def check_case(case: Case) -> Outcome:
    """Run a case and assert its three bounds: the exact error (and the file it names), the time, the
    peak memory (at most 2x the bytes on disk + 256 MB)."""
    disk = bytes_on_disk(case.out_dir)
    out = run_case(case)
    assert out.error == case.error, f"{case.name}: expected {case.error}, got {out.text}"
    if case.names is not None:   # verify: any of its findings may name the file
        named = [out.message, out.path or "", *out.detail.get("problems", [])]
        assert any(case.names in t for t in named), \
            f"{case.name}: the error does not name {case.names!r}: {out.text} {out.detail}"
    if case.error is None and case.expect_step is not None:
        assert out.detail.get("step") == case.expect_step, f"{case.name}: loaded {out.detail}"
    assert out.seconds <= case.seconds, f"{case.name}: took {out.seconds:.1f} s (bound {case.seconds} s)"
    if case.json_ratio is not None:
        base = out.detail["json_loads_seconds"]
        assert out.seconds <= case.json_ratio * base, (
            f"{case.name}: took {out.seconds:.2f} s, {out.seconds / base:.2f}x a plain json.loads of the index "
            f"({base:.2f} s; bound {case.json_ratio}x)")
    bound = int(case.rss_per_disk_byte * disk) + (256 << 20)
    assert out.rss_growth <= bound, (f"{case.name}: peak RSS grew {out.rss_growth >> 20} MiB, bound "
                                     f"{bound >> 20} MiB ({disk} bytes on disk)")
    return out


import stat as _stat  # noqa: E402


def _two_checkpoints(work: str, ids=("a", "b"), opts=None) -> tuple[str, str]:
    """<work>/out with checkpoints ids[0] (step 3) and ids[1] (step 4); returns (out_dir, path of ids[1])."""
    from helpers import stress_harness as h
    out = os.path.join(work, "out")
    m, e, r = h.Model(), {}, h.Reader()
    for step, cid in ((3, ids[0]), (4, ids[1])):
        h.set_step_state(m, e, r, step)
        h.make_saver(out, m, e, r, max_keep=None, opts=opts or h.OPTS).save(cid)
    return out, os.path.join(out, ids[1])


def _edit_manifest(ckpt: str, fn) -> None:
    m = read_json(ckpt, "manifest.json")
    fn(m)
    write_json(ckpt, "manifest.json", m)


def _write_raw_manifest(ckpt: str, body: bytes) -> None:
    """A manifest whose self-checksum is valid over `body` (canonical JSON without the crc32c key)."""
    from recckpt import _C
    raw = body[:-1] + b',"crc32c":' + str(_C.crc32c(body)).encode() + b"}"
    open(os.path.join(ckpt, "manifest.json"), "wb").write(raw)


# ---- listing: one bad manifest must not disable the output directory (the older checkpoint loads)
def gen_listing_worker_steps_superscript(work):
    out, b = _two_checkpoints(work)
    _edit_manifest(b, lambda m: m.__setitem__("worker_steps", {"²": 1}))
    return Case("listing_worker_steps_superscript", out, "listing", expect_step=3)


def gen_listing_worker_steps_5000_digits(work):
    out, b = _two_checkpoints(work)
    _edit_manifest(b, lambda m: m.__setitem__("worker_steps", {"9" * 5000: 1}))
    return Case("listing_worker_steps_5000_digits", out, "listing", expect_step=3)


def gen_listing_manifest_deep_nesting(work):
    out, b = _two_checkpoints(work)
    body = checked_json.canonical(read_json(b, "manifest.json"))
    _write_raw_manifest(b, body[:-1] + b',"x":' + b"[" * 990 + b"]" * 990 + b"}")
    return Case("listing_manifest_deep_nesting", out, "listing", expect_step=3)


# ---- the one JSON parser, reached through a load by id
def gen_manifest_deep_nesting(work):
    out, b = _two_checkpoints(work)
    body = checked_json.canonical(read_json(b, "manifest.json"))
    _write_raw_manifest(b, body[:-1] + b',"x":' + b'{"y":' * 990 + b"1" + b"}" * 990 + b"}")
    return Case("manifest_deep_nesting", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json")


def gen_manifest_long_number(work):
    out, b = _two_checkpoints(work)
    body = checked_json.canonical(read_json(b, "manifest.json"))
    _write_raw_manifest(b, body[:-1] + b',"x":' + b"7" * 4000 + b"}")
    return Case("manifest_long_number", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json")


def gen_manifest_duplicate_key(work):
    out, b = _two_checkpoints(work)
    body = checked_json.canonical(read_json(b, "manifest.json"))
    _write_raw_manifest(b, body[:-1] + b',"shard_num":1,"shard_num":1}')
    return Case("manifest_duplicate_key", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json")


def gen_index_deep_nesting(work):
    out, b = _two_checkpoints(work)
    from recckpt import _C
    body = checked_json.canonical(read_json(b, "index.json"))
    body = body[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    raw = body[:-1] + b',"crc32c":' + str(_C.crc32c(body)).encode() + b"}"
    open(os.path.join(b, "index.json"), "wb").write(raw)
    resign(b, "index.json")
    return Case("index_deep_nesting", out, "load_id", "b", "CorruptCheckpointError", "b/index.json")



# ---- only regular files: FIFOs, devices and links where a file should be
def gen_version_file_fifo(work):
    """A FIFO as <output_dir>/checkpoint: the advisory version file is rebuilt; nothing blocks."""
    out, _ = _two_checkpoints(work)
    os.remove(os.path.join(out, "checkpoint"))
    os.mkfifo(os.path.join(out, "checkpoint"))
    return Case("version_file_fifo", out, "load", seconds=20, expect_step=4)


def gen_version_file_dev_zero(work):
    """<output_dir>/checkpoint -> /dev/zero (stat size 0, endless bytes): never read."""
    out, _ = _two_checkpoints(work)
    os.remove(os.path.join(out, "checkpoint"))
    os.symlink("/dev/zero", os.path.join(out, "checkpoint"))
    return Case("version_file_dev_zero", out, "load", seconds=20, expect_step=4)


def gen_manifest_fifo(work):
    out, b = _two_checkpoints(work)
    os.remove(os.path.join(b, "manifest.json"))
    os.mkfifo(os.path.join(b, "manifest.json"))
    return Case("manifest_fifo", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json", seconds=20)


def gen_listing_manifest_fifo(work):
    out, b = _two_checkpoints(work)
    os.remove(os.path.join(b, "manifest.json"))
    os.mkfifo(os.path.join(b, "manifest.json"))
    return Case("listing_manifest_fifo", out, "listing", expect_step=3)


def gen_shard_link_dev_zero(work):
    out, b = _two_checkpoints(work)
    rel = read_json(b, "index.json")["files"][0]["path"]
    os.remove(os.path.join(b, rel))
    os.symlink("/dev/zero", os.path.join(b, rel))
    return Case("shard_link_dev_zero", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=20)


def gen_dense_fifo(work):
    out, b = _two_checkpoints(work)
    os.remove(os.path.join(b, "dense.safetensors"))
    os.mkfifo(os.path.join(b, "dense.safetensors"))
    return Case("dense_fifo", out, "load_id", "b", "CorruptCheckpointError", "dense.safetensors", seconds=20)


def gen_index_is_directory(work):
    out, b = _two_checkpoints(work)
    os.remove(os.path.join(b, "index.json"))
    os.mkdir(os.path.join(b, "index.json"))
    return Case("index_is_directory", out, "load_id", "b", "CorruptCheckpointError", "index.json", seconds=20)


def gen_local_url_link_outside(work):
    """local:// URLs get the same link checks as plain paths: a dense file linked to an identical copy
    outside the checkpoint (so every checksum matches) is refused."""
    out, b = _two_checkpoints(work)
    victim = os.path.join(work, "outside.safetensors")
    _shutil.copyfile(os.path.join(b, "dense.safetensors"), victim)
    os.remove(os.path.join(b, "dense.safetensors"))
    os.symlink(victim, os.path.join(b, "dense.safetensors"))
    return Case("local_url_link_outside", "local://" + out, "load_id", "b", "CorruptCheckpointError",
                "dense.safetensors", seconds=20)


# ---- structure: blocks must tile every shard file before anything is read or allocated
def _big_checkpoints(work, rows: int, num_buckets: int = 16) -> tuple[str, str]:
    """Like _two_checkpoints, with `rows` rows in table 'user' (40 bytes a row on disk)."""
    import torch

    from helpers import stress_harness as h
    from recckpt import SaveOptions
    out = os.path.join(work, "out")
    opts = SaveOptions(num_buckets=num_buckets, chunk_bytes=1 << 16, segment_bytes=64 << 20, fsync=False)
    m, e, r = h.Model(), {}, h.Reader()
    for step, cid in ((3, "a"), (4, "b")):
        h.set_step_state(m, e, r, step)
        if cid == "b":
            m.user.import_rows(torch.arange(10 ** 9, 10 ** 9 + rows), {"embedding": torch.ones(rows, 8)})
        h.make_saver(out, m, e, r, max_keep=None, opts=opts).save(cid)
    return out, os.path.join(out, "b")


def _parsed_index(ckpt: str):
    """The checkpoint's validated index (recckpt's reader), for positions and CRCs of its segments."""
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.storage import open_storage
    return CheckpointReader(open_storage(ckpt), "").index


def _seg_hex(seg) -> str:
    """The CRCs of one segment as format version 4's index stores them (hex, directory first)."""
    import numpy as np
    parts = [seg.buckets.crc32c] + [c.crc32c for c in seg.columns]
    return "".join(np.asarray(p, dtype=">u4").tobytes().hex() for p in parts)


def resign_segment_crcs(ckpt: str, table: str) -> None:
    """Recompute, from the shard bytes, every CRC of `table`'s segments in a format version 4 checkpoint
    (index.json and the single worker's index), as an attacker who edited rows would."""
    import numpy as np

    from recckpt import _C
    doc = _parsed_index(ckpt)
    hexes = []
    for seg in doc.tables[table][1]:
        data = open(os.path.join(ckpt, doc.files[seg.file][0]), "rb").read()
        crcs = [_C.crc32c(data[seg.buckets.offset:seg.buckets.offset + seg.buckets.length])]
        for c in seg.columns:
            if c.length:
                crcs += [int(x) for x in _C.crc32c_chunks(np.frombuffer(data[c.offset:c.offset + c.length], np.uint8),
                                                          c.step)]
        hexes.append("".join(f"{x:08x}" for x in crcs))
    for rel in ("index.json", "sparse/worker-00000.index.json"):
        idx = read_json(ckpt, rel)
        idx["tables"][table]["segments"]["crc32c"] = "".join(hexes)
        write_json(ckpt, rel, idx)


_SEG_LISTS = ("file", "offset", "rows", "dir", "first", "last", "packed", "block", "id0")


def _append_copies(idx: dict, table: str, i: int, seg_obj, times: int) -> None:
    """Append `times` copies of segment `i` (a format version 4 SEGS entry) to `table`'s segments."""
    segs = idx["tables"][table]["segments"]
    for k in _SEG_LISTS:
        if k in segs:
            segs[k].extend([segs[k][i]] * times)
    segs["crc32c"] += _seg_hex(seg_obj) * times


def _recount_rows(m: dict, table: str, extra: int) -> None:
    """Add `extra` rows to `table` in a manifest, and to its content digest's row count where it has one
    (format version 4 checks the two agree before the index is read)."""
    m["tables"][table]["rows"] += extra
    digest = m.get("digests", {}).get("tables", {}).get(table)
    if digest is not None:
        digest["rows"] += extra


def _repeat_segment(b: str, times: int) -> str:
    doc = _parsed_index(b)
    objs = doc.tables["user"][1]
    i = max(range(len(objs)), key=lambda j: objs[j].rows)
    idx = read_json(b, "index.json")
    _append_copies(idx, "user", i, objs[i], times - 1)
    write_json(b, "index.json", idx)
    m = read_json(b, "manifest.json")
    _recount_rows(m, "user", objs[i].rows * (times - 1))
    write_json(b, "manifest.json", m)
    return idx["files"][objs[i].file]["path"]


def gen_repeated_segment(work):
    """One segment listed 100 times (rows re-counted in the manifest): a load would read and buffer it
    100 times over. Refused by the tiling rule before any read."""
    out, b = _big_checkpoints(work, 1 << 20)   # ~40 MiB of rows
    rel = _repeat_segment(b, 100)
    return Case("repeated_segment", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_repeated_segment_mmap(work):
    out, b = _big_checkpoints(work, 1 << 20)
    rel = _repeat_segment(b, 100)
    return Case("repeated_segment_mmap", out, "load_id_mmap", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_repeated_segment_verify(work):
    out, b = _big_checkpoints(work, 1 << 20)
    rel = _repeat_segment(b, 100)
    return Case("repeated_segment_verify", out, "verify", "b", "CorruptCheckpointError", rel, seconds=30)


def _shared_one_row_segment(b: str, copies: int) -> str:
    """A new shard file holding one 1-row segment of table 'user', listed `copies` times: every copy
    passes the field checks on its own (format version 4 has no zero-row segments, and a directory is
    never larger than its rows, so the bucket-block amplification of versions 1-3 cannot be written;
    what is left to try is sharing)."""
    import numpy as np

    from recckpt import _C
    doc = _parsed_index(b)
    seg = doc.tables["user"][1][0]
    src = open(os.path.join(b, doc.files[seg.file][0]), "rb").read()
    one_id = np.frombuffer(src[seg.columns[0].offset:seg.columns[0].offset + 8], "<i8")
    emb_rb = seg.columns[1].length // seg.rows
    row = src[seg.columns[1].offset:seg.columns[1].offset + emb_rb]
    bucket = int(_C.bucket_of(one_id, doc.num_buckets)[0])
    block = np.array([bucket, 0], "<u4").tobytes() + one_id.tobytes() + row
    rel = "sparse/shard-00000-900.bin"
    open(os.path.join(b, rel), "wb").write(block)
    idx = read_json(b, "index.json")
    fi = len(idx["files"])
    idx["files"].append({"path": rel, "size": len(block)})
    segs = idx["tables"]["user"]["segments"]
    for k, v in (("file", fi), ("offset", 0), ("rows", 1), ("dir", 1), ("first", bucket), ("last", bucket),
                 ("packed", 1)):
        segs[k].extend([v] * copies)
    crcs = [_C.crc32c(block[:8]), _C.crc32c(block[8:16]), _C.crc32c(row)]
    segs["crc32c"] += "".join(f"{c:08x}" for c in crcs) * copies
    write_json(b, "index.json", idx)
    m = read_json(b, "manifest.json")
    _recount_rows(m, "user", copies)
    if m.get("shard_bytes") is not None:
        m["shard_bytes"] += len(block)    # the new shard file (format version 4 checks the total)
    write_json(b, "manifest.json", m)
    return rel


def gen_shared_bucket_block(work):
    """5000 one-row segments sharing the bytes of one: 5000 reads of one block unless sharing is refused."""
    out, b = _big_checkpoints(work, 1000, num_buckets=1 << 20)
    rel = _shared_one_row_segment(b, 5000)
    return Case("shared_bucket_block", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_shared_bucket_block_verify(work):
    out, b = _big_checkpoints(work, 1000, num_buckets=1 << 20)
    rel = _shared_one_row_segment(b, 5000)
    return Case("shared_bucket_block_verify", out, "verify", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_overlapping_segments(work):
    """A segment moved onto another one's bytes in the same file: each still lies inside the file, but
    they overlap. Which segments share a file depends on which writer thread took them, so the pair is
    looked up rather than assumed (4 segments in 2 files: some file holds two)."""
    out, b = _two_checkpoints(work)
    idx = read_json(b, "index.json")
    segs = idx["tables"]["user"]["segments"]
    by_file: dict[int, list[int]] = {}
    for k, f in enumerate(segs["file"]):
        by_file.setdefault(f, []).append(k)
    shared = next(ks for ks in by_file.values() if len(ks) > 1)
    # the smaller segment moves onto the larger one's offset, so it still ends inside the file
    moved, onto = sorted(shared, key=lambda k: segs["rows"][k])[:2]
    segs["offset"][moved] = segs["offset"][onto]
    write_json(b, "index.json", idx)
    rel = idx["files"][segs["file"][moved]]["path"]
    return Case("overlapping_segments", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=20)


def _index_duplicated_segments(work, copies: int):
    """The issue's hostile index: one big segment listed `copies` times (about 1.2 KB of index each)."""
    out, b = _big_checkpoints(work, 205_000)
    rel = _repeat_segment(b, copies)
    return out, b, rel


def gen_index_200k_duplicated_segments(work):
    """A ~245 MB index.json (under the 1 GiB cap) holding 200 000 copies of one segment: refused by load
    in at most 2x the time of a plain json.loads of the same bytes in the same process (issue 30)."""
    out, b, rel = _index_duplicated_segments(work, 200_000)
    return Case("index_200k_duplicated_segments", out, "load_id", "b", "CorruptCheckpointError", rel,
                seconds=120, json_ratio=2.0)


def gen_index_200k_duplicated_segments_verify(work):
    out, b, rel = _index_duplicated_segments(work, 200_000)
    return Case("index_200k_duplicated_segments_verify", out, "verify", "b", "CorruptCheckpointError", rel,
                seconds=120, json_ratio=2.0)


def gen_index_200k_duplicated_segments_inspect(work):
    out, b, rel = _index_duplicated_segments(work, 200_000)
    return Case("index_200k_duplicated_segments_inspect", out, "inspect", "b", "CorruptCheckpointError", rel,
                seconds=120, json_ratio=2.0)


# A version 3 index is one JSON object per segment, and it is decoded whole before any rule applies:
# Python's object tree of compact JSON takes about 6x its text (measured: 409 MiB for a 62 MiB index).
# That is the legacy format's bound, stated here rather than hidden; version 4's struct-of-arrays index
# keeps the 2x bound of every other case.
_V3_INDEX_RSS = 7.0


def _v3_index_duplicated_segments(work, copies: int):
    """Format version 3 (checked JSON, one object per segment): the fixture written by the pre-v4 code,
    its one segment listed `copies` times (rows re-counted in the manifest)."""
    import shutil
    out = os.path.join(work, "out")
    shutil.copytree(os.path.join(_ROOT, "tests", "fixtures", "v3", "out"), out)
    b = os.path.join(out, "base")
    idx = read_json(b, "index.json")
    segs = idx["tables"]["user"]["segments"]
    one = segs[0]
    segs.extend([one] * (copies - 1))
    write_json(b, "index.json", idx)
    m = read_json(b, "manifest.json")
    _recount_rows(m, "user", one["rows"] * (copies - 1))
    write_json(b, "manifest.json", m)
    return out, idx["files"][one["file"]]["path"]


def gen_v3_index_200k_duplicated_segments(work):
    """A ~125 MB version 3 index of 200 000 copies of one segment: refused by load in at most 2x the time
    of a plain json.loads of the same bytes (before the fix: 5x, per-segment validation first)."""
    out, rel = _v3_index_duplicated_segments(work, 200_000)
    return Case("v3_index_200k_duplicated_segments", out, "load_id", "base", "CorruptCheckpointError", rel,
                seconds=120, json_ratio=2.0, rss_per_disk_byte=_V3_INDEX_RSS)


def gen_v3_index_200k_duplicated_segments_verify(work):
    out, rel = _v3_index_duplicated_segments(work, 200_000)
    return Case("v3_index_200k_duplicated_segments_verify", out, "verify", "base", "CorruptCheckpointError", rel,
                seconds=120, json_ratio=2.0, rss_per_disk_byte=_V3_INDEX_RSS)


def gen_gap_at_file_end(work):
    """4 KiB appended to a shard file (its recorded size updated): bytes no block accounts for."""
    out, b = _two_checkpoints(work)
    idx = read_json(b, "index.json")
    rel = idx["files"][0]["path"]
    with open(os.path.join(b, rel), "ab") as f:
        f.write(bytes(4096))
    idx["files"][0]["size"] += 4096
    write_json(b, "index.json", idx)
    m = read_json(b, "manifest.json")
    if m.get("shard_bytes") is not None:
        m["shard_bytes"] += 4096          # format version 4 checks the total before the tiling
        write_json(b, "manifest.json", m)
    return Case("gap_at_file_end", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=20)


# ---- verify on a hostile tree
def gen_verify_directory_link_loop(work):
    """`a -> .` inside the checkpoint: verify lists it as an unlisted link and does not follow it."""
    out, b = _two_checkpoints(work)
    os.symlink(".", os.path.join(b, "a"))
    os.symlink("..", os.path.join(b, "sparse", "up"))
    return Case("verify_directory_link_loop", out, "verify", "b", None, seconds=20)


def gen_verify_worker_index_odd_digits(work):
    """A listed worker index named with a superscript digit: a recckpt error naming it, not ValueError."""
    out, b = _two_checkpoints(work)
    old, new = "sparse/worker-00000.index.json", "sparse/worker-0000\u00b2.index.json"
    os.rename(os.path.join(b, old), os.path.join(b, new))
    m = read_json(b, "manifest.json")
    m["files"][new] = m["files"].pop(old)
    write_json(b, "manifest.json", m)
    return Case("verify_worker_index_odd_digits", out, "verify", "b", "CorruptCheckpointError",
                "worker-0000\u00b2", seconds=20)


# ---- safetensors headers and state trees go through the same bounded parser
def _rewrite_header(ckpt: str, rel: str, edit) -> None:
    import struct
    path = os.path.join(ckpt, rel)
    data = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", data)
    head = edit(data[8:8 + n])
    open(path, "wb").write(struct.pack("<Q", len(head)) + head + data[8 + n:])
    resign(ckpt, rel)


def gen_dense_header_deep_nesting(work):
    out, b = _two_checkpoints(work)
    _rewrite_header(b, "dense.safetensors", lambda h: h[:-1] + b',"x":' + b"[" * 3000 + b"]" * 3000 + b"}")
    return Case("dense_header_deep_nesting", out, "load_id", "b", "CorruptCheckpointError", "dense.safetensors",
                seconds=20)


def gen_extras_tree_long_number(work):
    """A state tree (a string inside the extras header) holding a 4000-digit number."""
    out, b = _two_checkpoints(work)

    def edit(head):
        obj = _json.loads(head)
        obj["__metadata__"]["recckpt.tree"] = '{"objects":{"state":{"kind":"value","state":' + "9" * 4000 + "}}}"
        return _json.dumps(obj).encode()
    _rewrite_header(b, "extras.safetensors", edit)
    return Case("extras_tree_long_number", out, "load_id", "b", "CorruptCheckpointError", "extras.safetensors",
                seconds=20)


# ---- sizes and links of metadata files
def gen_manifest_over_size_cap(work):
    """A 65 MiB manifest (valid JSON padding): refused by its size, before it is read."""
    out, b = _two_checkpoints(work)
    with open(os.path.join(b, "manifest.json"), "ab") as f:
        f.write(b" " * (65 << 20))
    return Case("manifest_over_size_cap", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json",
                seconds=20)


def gen_manifest_symlink(work):
    """b/manifest.json -> a's manifest (a valid, checked file): links are refused, never followed."""
    out, b = _two_checkpoints(work)
    os.remove(os.path.join(b, "manifest.json"))
    os.symlink(os.path.join(out, "a", "manifest.json"), os.path.join(b, "manifest.json"))
    return Case("manifest_symlink", out, "load_id", "b", "CorruptCheckpointError", "b/manifest.json", seconds=20)


# ---- new classes: claimed counts no file could hold, directory loops
def gen_num_buckets_claimed_huge(work):
    """The index claims 2**24 - 1 buckets (in versions 1-3, 128 MiB bucket blocks per segment; a version 4
    directory is bounded by its rows, so only the disagreement with the manifest remains to refuse)."""
    out, b = _two_checkpoints(work)
    nb = (1 << 24) - 1
    idx = read_json(b, "index.json")
    idx["num_buckets"] = nb
    write_json(b, "index.json", idx)
    return Case("num_buckets_claimed_huge", out, "load_id", "b", "CorruptCheckpointError", "b/index.json",
                seconds=20)


def gen_listing_checkpoint_dir_link_loop(work):
    """<output_dir>/c -> c (a link to itself): listing skips it, the rest keeps working."""
    out, _ = _two_checkpoints(work)
    os.symlink("c", os.path.join(out, "c"))
    return Case("listing_checkpoint_dir_link_loop", out, "listing", expect_step=4)


# ---- hash flooding: ids chosen so that mix64(id) = k * 4096 (all in bucket 0, and before the id map's
# keyed homes, all in one home slot: every insert probed past all earlier ones, quadratic)
def _flooded(work, n, chain=False):
    """<work>/out with "a" (step 3) and "b" (step 4) whose table 'user' holds n chosen ids; with chain,
    also "c" (step 5), an increment on "b" rewriting every other row (its load folds the chain)."""
    import numpy as np
    import torch

    from helpers import stress_harness as h
    from recckpt import SaveOptions
    from recckpt.format.hashing import unmix64
    out, _ = _two_checkpoints(work, ids=("a", "b0"))
    m, e, r = h.Model(), {}, h.Reader()
    h.set_step_state(m, e, r, 4)
    ids = torch.from_numpy(unmix64(np.arange(n, dtype=np.uint64) * np.uint64(4096)))
    m.user.clear_rows()
    m.user.import_rows(ids, {"embedding": torch.zeros(n, 8)})
    s = h.make_saver(out, m, e, r, max_keep=None, opts=SaveOptions(fsync=False))
    s.save("b")
    if chain:
        m.user.import_rows(ids[::2], {"embedding": torch.ones(len(ids[::2]), 8)})
        e["step"] = 5
        s.save("c", incremental=True)
        assert s.last_save.parent == "b", s.last_save
    return out


def gen_id_flood_200k(work):
    return Case("id_flood_200k", _flooded(work, 200_000), "load_id", "b", seconds=10, expect_step=4)


def gen_id_flood_1m(work):
    return Case("id_flood_1m", _flooded(work, 1_000_000), "load_id", "b", seconds=20, expect_step=4)


def gen_id_flood_chain_200k(work):
    return Case("id_flood_chain_200k", _flooded(work, 200_000, chain=True), "load_id", "c", seconds=10,
                expect_step=5)


# ---- format version 5: column groups and row runs of a fixed-size (TorchRec) table
def _fixed_checkpoints(work) -> tuple[str, str]:
    """Like _two_checkpoints, with a fixed-size table 'fixed' (5000 x 24, embedding and Adagrad state: row
    runs, 6 column groups a slot) in "b"."""
    from helpers import stress_harness as h
    from helpers.fake_tables import FixedRows
    out = os.path.join(work, "out")
    m, e, r = h.Model(), {}, h.Reader()
    for step, cid in ((3, "a"), (4, "b")):
        h.set_step_state(m, e, r, step)
        if cid == "b":
            m.fixed = FixedRows("fixed", 5000, 24)
        h.make_saver(out, m, e, r, max_keep=None).save(cid)
    return out, os.path.join(out, "b")


def _edit_segs(b: str, table: str, edit) -> None:
    """Apply `edit(SEGS dict)` to `table`'s segments in index.json and the worker index (re-signed)."""
    for rel in ("index.json", "sparse/worker-00000.index.json"):
        idx = read_json(b, rel)
        edit(idx["tables"][table]["segments"])
        write_json(b, rel, idx)


def gen_row_run_past_the_table(work):
    """A row run whose ids [id0, id0 + rows) pass the table's N rows (first/last moved along): a load
    would write rows the table does not have."""
    out, b = _fixed_checkpoints(work)

    def edit(segs):
        segs["id0"][-1] += 100
        segs["first"][-1] = segs["id0"][-1] * 16 // 5000
        segs["last"][-1] = 15
    _edit_segs(b, "fixed", edit)
    return Case("row_run_past_the_table", out, "load_id", "b", "CorruptCheckpointError", "index.json")


def gen_row_runs_overlap(work):
    """Two row runs holding the same rows (the second's id0 moved onto the first's): each id once per table
    is the rule; a load would write those rows twice, the rows between never."""
    out, b = _fixed_checkpoints(work)

    def edit(segs):
        id0 = segs["id0"][1] = segs["id0"][0]
        segs["first"][1], segs["last"][1] = id0 * 16 // 5000, (id0 + segs["rows"][1] - 1) * 16 // 5000
    _edit_segs(b, "fixed", edit)
    return Case("row_runs_overlap", out, "verify", "b", "CorruptCheckpointError", "index.json")


def gen_row_run_in_a_hash_table(work):
    """`id0` on a hash table's segments: only a row_range table's segments may be runs."""
    out, b = _fixed_checkpoints(work)
    _edit_segs(b, "user", lambda segs: segs.__setitem__("id0", [0] * len(segs["file"])))
    return Case("row_run_in_a_hash_table", out, "load_id", "b", "CorruptCheckpointError", "index.json")


def gen_row_run_with_a_directory(work):
    """A row run (id0 >= 0) that claims a directory of one entry: its bytes would be read as rows."""
    out, b = _fixed_checkpoints(work)
    _edit_segs(b, "fixed", lambda segs: segs["dir"].__setitem__(0, 1))
    return Case("row_run_with_a_directory", out, "verify", "b", "CorruptCheckpointError", "index.json")


def gen_column_group_width_changed(work):
    """The manifest's column group width changed from 4 to 5 (re-signed): every group column's length by
    the rule changes, so the index's columns no longer match the files (a group of the wrong length)."""
    out, b = _fixed_checkpoints(work)
    _edit_manifest(b, lambda m: m["tables"]["fixed"]["column_groups"].__setitem__("width", 5))
    return Case("column_group_width_changed", out, "load_id", "b", "CorruptCheckpointError", "index.json")


def gen_column_group_width_zero(work):
    """A column group width of 0 (or past D): no group can be cut; refused from the manifest."""
    out, b = _fixed_checkpoints(work)
    _edit_manifest(b, lambda m: m["tables"]["fixed"]["column_groups"].__setitem__("width", 0))
    return Case("column_group_width_zero", out, "load_id", "b", "CorruptCheckpointError", "manifest.json")


def gen_column_groups_of_different_shapes(work):
    """column_groups naming slots of different shapes (only slots of one shape (D,) split into groups)."""
    out, b = _fixed_checkpoints(work)

    def edit(m):
        t = m["tables"]["fixed"]
        t["slots"][1][1]["shape"] = [12]
    _edit_manifest(b, edit)
    return Case("column_groups_of_different_shapes", out, "verify", "b", "CorruptCheckpointError", "manifest.json")


def gen_column_groups_on_a_hash_table(work):
    """column_groups on a hash table (only a row_range table stores them)."""
    out, b = _fixed_checkpoints(work)
    _edit_manifest(b, lambda m: m["tables"]["user"].__setitem__("column_groups", {"slots": ["embedding"], "width": 4}))
    return Case("column_groups_on_a_hash_table", out, "load_id", "b", "CorruptCheckpointError", "manifest.json")


def gen_group_column_crc_flipped(work):
    """One byte of a column group flipped (its CRC left as it was): a whole-row load, which places every
    group into rows, must fail naming the shard file, never load the byte."""
    out, b = _fixed_checkpoints(work)
    doc = _parsed_index(b)
    seg = doc.tables["fixed"][1][0]
    col = seg.columns[3]   # the embedding's third group
    path = os.path.join(b, doc.files[seg.file][0])
    data = bytearray(open(path, "rb").read())
    data[col.offset + col.length // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    return Case("group_column_crc_flipped", out, "verify", "b", "CorruptCheckpointError", doc.files[seg.file][0])


GENERATORS = [v for k, v in sorted(globals().items()) if k.startswith("gen_")]
