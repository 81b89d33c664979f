"""A loader racing retention in another process: each load either loads a complete checkpoint or fails
with CheckpointDeletedError ("deleted while it was being loaded"), never as corrupt; and retention
rewrites the version file before it deletes, so it never names a deleted checkpoint for long."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from helpers.shared_dir_child import Model
from recckpt import Saver
from recckpt.errors import CheckpointDeletedError, CheckpointNotFoundError

SAVER = """
import sys, time, torch
sys.path[:0] = [{root!r}, {tests!r}]
from helpers.shared_dir_child import Model
from recckpt import Saver, SaveOptions
m = Model()
ids = torch.arange(20000)
s = Saver(m, output_dir={out!r}, max_keep=1, concurrency=2,
          options=SaveOptions(num_buckets=16, chunk_bytes=1024, segment_bytes=1 << 15, fsync=False))
deadline = time.monotonic() + {seconds}
k = 0
while time.monotonic() < deadline:
    m.t.set_rows(ids, {{"embedding": torch.full((ids.numel(), 8), float(k))}})
    m.tag.copy_(torch.tensor([k, k]))
    s.save(f"ckpt_{{k}}")
    k += 1
"""


def test_loads_racing_retention_are_complete_or_deleted_errors(tmp_path, slow_mode):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    seconds = 60 if slow_mode else 8
    code = SAVER.format(root=os.path.dirname(tests), tests=tests, out=str(out), seconds=seconds)
    proc = subprocess.Popen([sys.executable, "-c", code])
    outcomes = {"ok": 0, "deleted": 0, "not_found": 0}
    try:
        while not (out / "checkpoint").exists():
            time.sleep(0.05)
            assert proc.poll() is None, "the saving process died"
        while proc.poll() is None:
            m = Model()
            try:
                res = Saver(m, output_dir=out).load()
            except CheckpointDeletedError as e:
                assert "deleted while it was being loaded" in str(e)
                outcomes["deleted"] += 1
                continue
            except CheckpointNotFoundError:
                outcomes["not_found"] += 1   # deleted between listing and opening its manifest
                continue
            k = int(res.ckpt_id.split("_")[1])
            assert m.tag.tolist() == [k, k]
            assert m.t.ids.numel() == 20000 and torch.all(m.t.cols["embedding"] == float(k))
            outcomes["ok"] += 1
            listed = (out / "checkpoint").read_text().split()
            assert len(listed) <= 2, listed   # the newest, and at most one being committed meanwhile
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0
    assert outcomes["ok"] > 0, outcomes
