"""Code that knows only format version 3 refuses a version 4 checkpoint with a clear error.

The reader under test is recckpt as it was just before version 4 (the parent of the commit that set
FORMAT_VERSION = 4), taken from this repository's history with `git archive` into a temporary
directory and run in a subprocess against a checkpoint written by today's recckpt. The old Python code
is given today's engine module: the refusal happens on the manifest, before the engine reads a shard."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from recckpt import HashTable, SaveOptions, Saver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def _old_recckpt(dst: str) -> str:
    try:
        first_v4 = _git("log", "-n1", "--format=%H", "-S", "FORMAT_VERSION = 4", "--", "recckpt/format/names.py")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs the git history of the repository: {e}")
    if not first_v4:
        pytest.skip("the history has no commit that introduced format version 4 (a shallow clone?)")
    old = f"{first_v4}^"
    if "FORMAT_VERSION = 3" not in _git("show", f"{old}:recckpt/format/names.py"):
        pytest.skip(f"{old} is not a format version 3 recckpt")
    os.makedirs(dst)
    archive = subprocess.run(["git", "-C", ROOT, "archive", old, "recckpt"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "recckpt", "_C*.so")):
        shutil.copy(so, os.path.join(dst, "recckpt"))
    return dst


CHILD = r"""
import json, sys
import recckpt
assert recckpt.__file__.startswith(sys.argv[2]), recckpt.__file__
from recckpt.format import names
assert names.FORMAT_VERSION == 3
out = {}
for what in ("load", "open", "verify"):
    try:
        if what == "load":
            import torch
            recckpt.Saver(torch.nn.Linear(2, 2), output_dir=sys.argv[1] + "/../x").load(sys.argv[1], direct_path=True)
        elif what == "open":
            recckpt.open(sys.argv[1])
        else:
            r = recckpt.verify(sys.argv[1])
            if r.ok:
                raise SystemExit("verify passed a version 4 checkpoint")
            raise Exception(r.problems[0])
        out[what] = None
    except Exception as e:
        out[what] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


def test_version_3_reader_refuses_a_version_4_checkpoint(tmp_path):
    old = _old_recckpt(str(tmp_path / "old"))
    m = torch.nn.Module()
    m.t = HashTable("t", 4)
    m.t.import_rows(torch.arange(100), {"embedding": torch.randn(100, 4)})
    Saver(m, output_dir=str(tmp_path / "out"), options=SaveOptions(fsync=False)).save("c")
    ckpt = str(tmp_path / "out" / "c")
    assert json.load(open(os.path.join(ckpt, "manifest.json")))["format_version"] == 4
    env = dict(os.environ, PYTHONPATH=old)
    p = subprocess.run([sys.executable, "-c", CHILD, ckpt, old], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out = json.loads(lines[0][len("RESULT "):])
    for what in ("load", "open"):
        name, msg = out[what]
        assert name == "IncompatibleCheckpointError", out
        assert "format version 4 is not supported" in msg and "upgrade recckpt" in msg, msg
        assert "manifest.json" in msg
    assert "format version 4 is not supported" in out["verify"][1], out
