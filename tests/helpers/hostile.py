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
    bound = 2 * disk + (256 << 20)
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


def _repeat_segment(b: str, times: int) -> str:
    idx = read_json(b, "index.json")
    segs = idx["tables"]["user"]["segments"]
    seg = max(segs, key=lambda x: x["rows"])
    segs.extend(dict(seg) for _ in range(times - 1))
    write_json(b, "index.json", idx)
    m = read_json(b, "manifest.json")
    m["tables"]["user"]["rows"] += seg["rows"] * (times - 1)
    write_json(b, "manifest.json", m)
    return idx["files"][seg["file"]]["path"]


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


def _shared_zero_block(b: str, copies: int) -> str:
    """A new shard file holding one all-zero bucket block, shared by `copies` zero-row segments of
    table 'user' (a valid partition of 0 rows each time it is read)."""
    from recckpt import _C
    idx = read_json(b, "index.json")
    nb = idx["num_buckets"]
    block = bytes(8 * (nb + 1))
    rel = "sparse/shard-00000-900.bin"
    open(os.path.join(b, rel), "wb").write(block)
    fi = len(idx["files"])
    idx["files"].append({"path": rel, "size": len(block)})
    end = len(block)
    seg = {"file": fi, "rows": 0, "buckets": {"offset": 0, "length": len(block), "crc32c": _C.crc32c(block)},
           "columns": [{"offset": end, "length": 0, "crc32c": []}, {"offset": end, "length": 0, "crc32c": []}]}
    idx["tables"]["user"]["segments"].extend(dict(seg) for _ in range(copies))
    write_json(b, "index.json", idx)
    return rel


def gen_shared_bucket_block(work):
    """5000 zero-row segments sharing one 8 MiB all-zero bucket block (2**20 buckets): 40 GB of reads
    for 8 MiB on disk, unless sharing is refused."""
    out, b = _big_checkpoints(work, 1000, num_buckets=1 << 20)
    rel = _shared_zero_block(b, 5000)
    return Case("shared_bucket_block", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_shared_bucket_block_verify(work):
    out, b = _big_checkpoints(work, 1000, num_buckets=1 << 20)
    rel = _shared_zero_block(b, 5000)
    return Case("shared_bucket_block_verify", out, "verify", "b", "CorruptCheckpointError", rel, seconds=30)


def gen_overlapping_segments(work):
    """Two segments' ids columns swapped: each still lies inside the file, but they overlap others."""
    out, b = _two_checkpoints(work)
    idx = read_json(b, "index.json")
    segs = [s for s in idx["tables"]["user"]["segments"] if s["rows"]]
    segs[0]["buckets"]["offset"] = segs[0]["columns"][0]["offset"]   # inside its own ids column
    write_json(b, "index.json", idx)
    rel = idx["files"][segs[0]["file"]]["path"]
    return Case("overlapping_segments", out, "load_id", "b", "CorruptCheckpointError", rel, seconds=20)


def gen_gap_at_file_end(work):
    """4 KiB appended to a shard file (its recorded size updated): bytes no block accounts for."""
    out, b = _two_checkpoints(work)
    idx = read_json(b, "index.json")
    rel = idx["files"][0]["path"]
    with open(os.path.join(b, rel), "ab") as f:
        f.write(bytes(4096))
    idx["files"][0]["size"] += 4096
    write_json(b, "index.json", idx)
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
    """Manifest and index claim 2**24 - 1 buckets (128 MiB bucket blocks per segment) over small files."""
    out, b = _two_checkpoints(work)
    nb = (1 << 24) - 1
    idx = read_json(b, "index.json")
    idx["num_buckets"] = nb
    for t in idx["tables"].values():
        for seg in t["segments"]:
            seg["buckets"]["length"] = 8 * (nb + 1)
    write_json(b, "index.json", idx)
    _edit_manifest(b, lambda m: m.__setitem__("num_buckets", nb))
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


GENERATORS = [v for k, v in sorted(globals().items()) if k.startswith("gen_")]
