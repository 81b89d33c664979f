"""Listing an output directory of many checkpoints (issue 26 item 5): `recckpt ls` and
`CheckpointManager.restore()` on N checkpoints (default 10 000), with the catalog, against the listing
that reads every manifest (the catalog removed: what recckpt did before it), in the same run.

The newest checkpoint is a real one saved by a CheckpointManager (restore loads it). The older ones are
copies of its manifest under other ids and steps, re-signed, without their data files: a listing reads
only manifests (or the catalog), so that is all they need to be (verify would call them corrupt).

    python benchmarks/bench_catalog.py [--n 10000] [--s3] [--s3-n 10000] [--s3-endpoint URL] [--no-local]

--s3 repeats it on an S3-compatible server on 127.0.0.1 (moto, in its own process). --s3-endpoint: use a
server already running there instead (bucket "bench"; the output directory is built once and kept, so
that a rerun skips the ~6 minutes moto takes to store 10 000 manifests).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402

from recckpt import CheckpointManager, HashTable, SaveOptions, Saver, list_checkpoints  # noqa: E402
from recckpt.format import catalog, checked_json, names  # noqa: E402
from recckpt.storage import open_storage  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 8)
        self.lin = torch.nn.Linear(8, 1)


def manager(url, storage_options):
    m = Model()
    s = Saver(m, output_dir=url, max_keep=None, options=SaveOptions(fsync=False), storage_options=storage_options)
    return m, CheckpointManager(s, save_interval=1)


def build(url, n, storage_options, put_many):
    """n-1 manifest-only copies (steps 1..n-1), then a real checkpoint at step n, through the manager."""
    m, mgr = manager(url, storage_options)
    m.emb(torch.arange(1000))
    mgr.global_step = 0
    mgr.save()                                     # ckpt_0: a real one, to copy the manifest of
    st = open_storage(url, storage_options)
    proto = checked_json.loads(st.read_bytes(f"ckpt_0/{names.MANIFEST}"), "m", 1 << 26)
    proto.pop("crc32c", None)
    files, ids = {}, ["ckpt_0"]
    for k in range(1, n):
        doc = dict(proto, ckpt_id=f"ckpt_{k}", created_ns=proto["created_ns"] + k,
                   metadata=dict(proto["metadata"], **{"recckpt.global_step": str(k)}))
        files[f"ckpt_{k}/{names.MANIFEST}"] = checked_json.dumps(doc)
        ids.append(f"ckpt_{k}")
    put_many(files)
    catalog.write_version_file(st, ids, fsync=False)
    m, mgr = manager(url, storage_options)
    m.emb(torch.arange(1000))
    mgr.global_step = n
    mgr.save()              # its listing reads the copies' manifests; then it writes the catalog of all n + 1
    return st


def best(fn, rounds):
    out, t = None, float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def measure(url, storage_options, n, rounds, cli: bool):
    st = open_storage(url, storage_options)
    res = {}
    cat = st.read_bytes(names.CATALOG)
    res["catalog_bytes"] = len(cat)
    res["ls_api_s"], listing = best(lambda: list_checkpoints(url, storage_options), rounds)
    assert len(listing.checkpoints) == n + 1 and listing.checkpoints[-1].step == n

    def restore():
        _, mgr = manager(url, storage_options)
        return mgr.restore()
    res["restore_s"], step = best(restore, rounds)
    assert step == n
    if cli:
        env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}

        def run_cli():
            subprocess.run([sys.executable, "-m", "recckpt", "ls", "--json", url], env=env, check=True,
                           capture_output=True)
        res["ls_cli_s"], _ = best(run_cli, rounds)
        res["python_import_s"], _ = best(lambda: subprocess.run(
            [sys.executable, "-c", "import recckpt.cli.main"], env=env, check=True), rounds)
    # the baseline: the same listing reading every manifest (no catalog)
    st.remove_file(names.CATALOG)
    res["ls_manifests_s"], listing = best(lambda: list_checkpoints(url, storage_options), 1)
    assert len(listing.checkpoints) == n + 1
    res["rebuild_s"], _ = best(lambda: catalog.sync_version_file(st, fsync=False), 1)
    res["speedup"] = res["ls_manifests_s"] / res["ls_api_s"]
    return res


def local(a):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")

        def put_local(files):
            for rel, data in files.items():
                os.makedirs(os.path.join(out, os.path.dirname(rel)), exist_ok=True)
                with open(os.path.join(out, rel), "wb") as f:
                    f.write(data)
        t0 = time.perf_counter()
        build(out, a.n, None, put_local)
        print(f"local: built {a.n + 1} checkpoints in {time.perf_counter() - t0:.1f}s", flush=True)
        print("local", json.dumps(measure(out, None, a.n, a.rounds, cli=True), indent=1), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--s3-n", type=int, default=10_000)
    ap.add_argument("--s3-endpoint", default=None)
    ap.add_argument("--no-local", action="store_true")
    a = ap.parse_args()
    logging.getLogger("recckpt").setLevel(logging.ERROR)
    if a.s3_endpoint:
        from helpers.s3_server import S3Server
        server = S3Server(a.s3_endpoint)
        opts, fs, url = server.options(), server.fs(), "s3://bench/run"
        if not fs.exists("bench"):
            server.client().create_bucket(Bucket="bench")
        if not fs.exists(f"bench/run/{names.CATALOG}"):
            build(url, a.s3_n, opts, lambda files: fs.pipe({f"bench/run/{k}": v for k, v in files.items()}))
        print("s3 (moto)", json.dumps(measure(url, opts, a.s3_n, a.rounds, cli=False), indent=1), flush=True)
        return
    if not a.no_local:
        local(a)
    if a.s3:
        from helpers.s3_server import server_process
        with server_process() as server:
            server.client().create_bucket(Bucket="bench")
            opts = server.options()
            fs = server.fs()
            url = "s3://bench/run"
            t0 = time.perf_counter()
            build(url, a.s3_n, opts, lambda files: fs.pipe({f"bench/run/{k}": v for k, v in files.items()}))
            print(f"s3: built {a.s3_n + 1} checkpoints in {time.perf_counter() - t0:.1f}s", flush=True)
            print("s3 (moto)", json.dumps(measure(url, opts, a.s3_n, a.rounds, cli=False), indent=1), flush=True)


if __name__ == "__main__":
    main()
