"""Code that knows only an older format version refuses today's checkpoints with a clear error: the recckpt
that read versions 1-3 refuses version 4's and later, the one that read 1-4 refuses version 5's.

The reader under test is recckpt as it was just before version V + 1 (the parent of the commit that set
FORMAT_VERSION = V + 1), taken from this repository's history with `git archive` into a temporary
directory and run in a subprocess against a checkpoint written by today's recckpt (a hash table and a
fixed-size table: TorchRec's layout, column groups and row runs in version 5). The old Python code is given
today's engine module: the refusal happens on the manifest, before the engine reads a shard."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers.fake_tables import FixedRows
from recckpt import HashTable, SaveOptions, Saver
from recckpt.format.names import FORMAT_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def _old_recckpt(dst: str, version: int) -> str:
    """recckpt as it was when it wrote format `version`, extracted into `dst`."""
    try:
        # every commit that added or removed the line; the oldest one introduced the version
        changed = _git("log", "--format=%H", "-S", f"FORMAT_VERSION = {version + 1}", "--",
                       "recckpt/format/names.py").split()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs the git history of the repository: {e}")
    first_newer = changed[-1] if changed else ""
    if not first_newer:
        pytest.skip(f"the history has no commit that introduced format version {version + 1} (a shallow clone?)")
    old = f"{first_newer}^"
    if f"FORMAT_VERSION = {version}" not in _git("show", f"{old}:recckpt/format/names.py"):
        pytest.skip(f"{old} is not a format version {version} recckpt")
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
assert names.FORMAT_VERSION == int(sys.argv[3])
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
                raise SystemExit("verify passed a checkpoint of a newer format version")
            raise Exception(r.problems[0])
        out[what] = None
    except Exception as e:
        out[what] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("old_version", [3, 4])
def test_an_older_reader_refuses_todays_checkpoint(tmp_path, old_version):
    old = _old_recckpt(str(tmp_path / "old"), old_version)
    m = torch.nn.Module()
    m.t = HashTable("t", 4)
    m.t.import_rows(torch.arange(100), {"embedding": torch.randn(100, 4)})
    m.fixed = FixedRows()
    Saver(m, output_dir=str(tmp_path / "out"), options=SaveOptions(fsync=False)).save("c")
    ckpt = str(tmp_path / "out" / "c")
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert man["format_version"] == FORMAT_VERSION and "column_groups" in man["tables"]["fixed"]
    env = dict(os.environ, PYTHONPATH=old)
    p = subprocess.run([sys.executable, "-c", CHILD, ckpt, old, str(old_version)], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out = json.loads(lines[0][len("RESULT "):])
    refusal = f"format version {FORMAT_VERSION} is not supported"
    for what in ("load", "open"):
        name, msg = out[what]
        assert name == "IncompatibleCheckpointError", out
        assert refusal in msg and "upgrade recckpt" in msg, msg
        assert "manifest.json" in msg
    assert refusal in out["verify"][1], out
