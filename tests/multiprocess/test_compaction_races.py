"""Every writer claims what it writes (issue 30 item 1): a compaction running in one process while other
processes run `gc` and first saves (each a fresh Saver, whose start-up recovery sweeps the directory)
into the same output directory. Before compactions claimed their staging, recovery took it for a crashed
save's and removed it mid-write (5 of 5 trials in the issue). (`recckpt.compact` takes no storage
options, so it reaches S3 only with credentials from the environment: the local directory is the case.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

import recckpt
from helpers.tables import table_contents
from recckpt import HashTable, SaveOptions, Saver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "helpers", "recovery_rival_child.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))


def _model():
    return torch.nn.ModuleDict({"t": HashTable("t", 16)})


def make_chain(url, n, storage_options=None):
    """c1 (n rows), c2 and c3 (increments of n/5 rows each)."""
    m = _model()
    t = m["t"]
    t.import_rows(torch.arange(n), {"embedding": torch.randn(n, 16)})
    s = Saver(m, output_dir=url, max_keep=None, options=SaveOptions(fsync=False), storage_options=storage_options)
    s.save("c1")
    for k in (2, 3):
        t.import_rows(torch.arange(k * 1000, k * 1000 + n // 5), {"embedding": torch.randn(n // 5, 16)})
        s.save(f"c{k}", incremental=True)
    assert s.last_save.parent == "c2"


def race(url, tmp_path, compact_argv, env=ENV):
    """Rivals (gc, first saves) run in loops; the compaction runs among them; returns the rivals' results."""
    start, stop = tmp_path / "go", tmp_path / "stop"
    rivals = [subprocess.Popen([sys.executable, CHILD, mode, url, "600", str(start), str(stop)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mode in ("gc", "first_saves")]
    start.write_text("go")
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"{start}.{mode}.ready") for mode in ("gc", "first_saves")):
        assert time.monotonic() < deadline and all(r.poll() is None for r in rivals), "the rivals never got going"
        time.sleep(0.05)
    try:
        p = subprocess.run(compact_argv, env=env, capture_output=True, text=True, timeout=600)
    finally:
        stop.write_text("stop")
    out = []
    for r in rivals:
        so, se = r.communicate(timeout=300)
        assert r.returncode == 0, se[-3000:]
        out.append(json.loads(so.strip().splitlines()[-1]))
    assert p.returncode == 0, f"the compaction failed: {p.stderr[-3000:]}"
    return out


def assert_same_state(url, a, b, storage_options=None):
    ma, mb = _model(), _model()
    Saver(ma, output_dir=url, storage_options=storage_options).load(ckpt_id=a)
    Saver(mb, output_dir=url, storage_options=storage_options).load(ckpt_id=b)
    ca, cb = table_contents(ma["t"]), table_contents(mb["t"])
    assert set(ca["embedding"]) == set(cb["embedding"])
    for i, row in ca["embedding"].items():
        assert torch.equal(row, cb["embedding"][i])


def test_compaction_next_to_gc_and_first_saves_local(tmp_path, slow_mode):
    out = tmp_path / "out"
    make_chain(str(out), 1_000_000 if slow_mode else 400_000)
    gc_res, save_res = race(str(out), tmp_path, [sys.executable, "-m", "recckpt", "compact", str(out / "c3"),
                                                 str(out / "c3_full"), "--memory-mb", "1"])
    assert gc_res["errors"] == [] and save_res["errors"] == [], (gc_res, save_res)
    assert gc_res["done"] >= 2 and save_res["done"] >= 2, (gc_res, save_res)
    recckpt.verify(str(out / "c3_full")).raise_if_failed()
    assert_same_state(str(out), "c3", "c3_full")
    assert not [n for n in os.listdir(out) if n.startswith(".owner-")]
