"""A shared output directory: two real processes save into one local directory and into one S3 prefix
at the same time, with colliding ids, as a job restarted while its old instance still writes. Every
save that reported success is committed, verifies, and holds what that process saved; no id is reported
saved by both. A small sample in CI; at least 100 saves per store behind the slow flag."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import torch

from helpers.shared_dir_child import Model, value
from recckpt import Saver, verify
from recckpt.format import catalog

logging.getLogger("werkzeug").setLevel(logging.ERROR)
CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers",
                     "shared_dir_child.py")


def run_rivals(url, tmp_path, n, storage_options=None, procs=2, env=None):
    start = tmp_path / "start"
    outs = [tmp_path / f"result{t}.json" for t in range(procs)]
    extra = [json.dumps(storage_options)] if storage_options else []
    children = [subprocess.Popen([sys.executable, CHILD, url, str(t + 1), str(n), str(start), str(outs[t]), *extra],
                                 env=env) for t in range(procs)]
    start.write_text("go")
    for c in children:
        assert c.wait(timeout=600) == 0
    return [json.loads(o.read_text()) for o in outs]


def check(url, results, storage_options=None, others=()):
    winners = {}
    for t, res in enumerate(results, start=1):
        for ckpt_id, outcome, detail in res:
            assert outcome in ("ok", "exists"), f"process {t}, {ckpt_id}: {detail}"
            if outcome == "ok":
                assert ckpt_id not in winners, f"{ckpt_id} reported saved by processes {winners[ckpt_id]} and {t}"
                winners[ckpt_id] = (t, detail)
    s = Saver(Model(), output_dir=url, storage_options=storage_options)
    committed = set(s.checkpoints())
    for ckpt_id, (t, rows) in winners.items():
        assert ckpt_id in committed, f"{ckpt_id}: process {t} reported success, but it is not committed"
        rep = verify(f"{url.rstrip('/')}/{ckpt_id}", storage_options=storage_options)
        assert rep.ok, rep.summary() if hasattr(rep, "summary") else str(rep)
        m = Model()
        Saver(m, output_dir=url, storage_options=storage_options).load(ckpt_id=ckpt_id)
        k = int(ckpt_id.split("_")[1])
        assert m.tag.tolist() == value(t, k), f"{ckpt_id} holds {m.tag.tolist()}, process {t} saved {value(t, k)}"
        assert m.t.ids.numel() == rows
        assert torch.all(m.t.cols["embedding"] == float(t * 1000 + k))
    assert committed - set(others) == set(winners), \
        f"committed but reported failed by both: {committed - set(others) - set(winners)}"
    listed = catalog.read_version_file(s.storage) or []
    assert set(listed) <= committed
    return winners


def test_two_processes_one_local_dir(tmp_path, slow_mode):
    n = 60 if slow_mode else 8
    out = tmp_path / "out"
    winners = check(str(out), run_rivals(str(out), tmp_path, n))
    assert len(winners) == n
    left = [x for x in os.listdir(out) if x.startswith((".staging-", ".owner-", ".deleting-"))]
    assert not left, left


def test_two_processes_one_s3_prefix(tmp_path, slow_mode, s3_server, s3_bucket):
    n = 60 if slow_mode else 6
    url = f"s3://{s3_bucket}/shared"
    winners = check(url, run_rivals(url, tmp_path, n, s3_server.options()), s3_server.options())
    assert len(winners) == n
    left = [p for p in s3_server.fs().find(f"{s3_bucket}/shared") if "/.owner-" in p]
    assert not left, left


def _save_while_a_rival_is_mid_save(url, tmp_path, in_flight, storage_options=None):
    """Process 1 saves ckpt_0 slowly; while its files are being written (`in_flight()` says so), this
    process saves with a fresh Saver, whose start-up recovery must leave process 1's files alone."""
    start, out = tmp_path / "start1", tmp_path / "result1.json"
    env = dict(os.environ, SHARED_DIR_CHILD_PAUSE_S="0.05")
    extra = [json.dumps(storage_options)] if storage_options else []
    child = subprocess.Popen([sys.executable, CHILD, url, "1", "1", str(start), str(out), *extra], env=env)
    start.write_text("go")
    try:
        deadline = time.monotonic() + 120
        while not in_flight():
            assert child.poll() is None and time.monotonic() < deadline, "the rival never got going"
            time.sleep(0.05)
        m = Model()
        m.tag.copy_(torch.tensor(value(2, 9)))
        Saver(m, output_dir=url, max_keep=None, storage_options=storage_options).save("other")
        assert child.poll() is None, "the rival finished before this save ran its recovery: slow it down"
    finally:
        assert child.wait(timeout=300) == 0
    results = json.loads(out.read_text())
    assert results == [["ckpt_0", "ok", results[0][2]]], results
    check(url, [results], storage_options, others={"other"})


def test_recovery_of_a_restarted_job_leaves_a_live_rivals_staging_alone(tmp_path):
    out = tmp_path / "out"

    def in_flight():
        return out.is_dir() and any(n.startswith(".staging-ckpt_0-") for n in os.listdir(out))
    _save_while_a_rival_is_mid_save(str(out), tmp_path, in_flight)
