"""`recckpt ls`, `inspect` and `verify` run without importing torch (nearly all of a new process's time
would otherwise be torch's import: the issue's "under a second on 100 checkpoints" target). Checked in a
fresh interpreter, as a user runs the command; a control proves the check sees torch when it is loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.checkpoints import make_checkpoint, table_rows
from recckpt.format import dtypes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import contextlib, io, json, sys
from recckpt.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "out": out.getvalue()}))
"""


def _run(*argv, script=SCRIPT) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, check=False,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("no-torch")
    rows = table_rows(200)
    # dense, a registered object holding a tensor and a plain value, per-worker IO state, two workers
    make_checkpoint(str(root), "ckpt_1", rows, extras={"lr": 0.1, "rng": torch.get_rng_state()})
    make_checkpoint(str(root), "ckpt_2", rows, workers=2, extras={"lr": 0.2})
    return root


@pytest.mark.parametrize("argv", [
    ["ls", "{root}"], ["ls", "--json", "{root}"],
    ["inspect", "{root}/ckpt_1"], ["inspect", "--json", "{root}/ckpt_2"],
    ["verify", "{root}/ckpt_1", "{root}/ckpt_2"], ["verify", "--json", "{root}/ckpt_1"],
])
def test_listing_inspecting_and_verifying_leave_torch_out(out_dir, argv):
    res = _run(*[a.format(root=out_dir) for a in argv])
    assert res["code"] == 0, res["out"]
    assert res["out"]
    assert res["torch"] is False, f"{' '.join(argv)} imported torch"


def test_inspect_shows_dense_objects_and_io_state_without_torch(out_dir):
    res = _run("inspect", "--json", str(out_dir / "ckpt_1"))
    doc = json.loads(res["out"])
    assert res["torch"] is False
    assert doc["dense"]["lin.weight"] == {"dtype": "F32", "shape": [3, 4]}
    assert doc["objects"]["lr"]["state"] == 0.1
    assert doc["objects"]["rng"]["state"].startswith("ndarray(uint8")   # a tensor, shown by dtype and shape
    assert doc["io_state"]["0"] == {"reader": {"pos": 100}}
    assert doc["tables"]["user"]["rows"] == 200


def _run_any(*argv) -> dict:
    """As _run, for a verb whose exit code the caller checks (diff exits 1 on differences)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, env=env, check=False,
                       timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("values", [False, True])
def test_diff_leaves_torch_out(out_dir, values):
    """Digests, dense state and registered objects compared as numpy; with --values, rows too."""
    argv = ["diff", "--json", str(out_dir / "ckpt_1"), str(out_dir / "ckpt_2")] + (["--values"] if values else [])
    res = _run_any(*argv)
    doc = json.loads(res["out"])
    assert res["code"] == 1 and doc["objects"]["changed"] == ["lr"] and doc["layout"]["workers"] == [1, 2]
    assert doc["contents"] == {} and doc["not_compared"] == {}   # same rows, by digest, on 1 and 2 workers
    assert res["torch"] is False


@pytest.mark.parametrize("fmt", ["parquet", "npy"])
def test_fp32_export_leaves_torch_out(out_dir, tmp_path, fmt):
    res = _run("export", str(out_dir / "ckpt_2"), "--out", str(tmp_path / fmt), "--format", fmt)
    assert res["code"] == 0 and "exported 200 rows" in res["out"] or "exported" in res["out"]
    assert res["torch"] is False


def test_an_incremental_checkpoint_too(tmp_path):
    """Its chain is opened and folded (format.fold) to count its rows and check its links: no torch."""
    from unit.test_incremental import run_chain
    _, _, snaps = run_chain(tmp_path, n_incr=2)
    res = _run("inspect", "--json", str(tmp_path / "c2"))
    doc = json.loads(res["out"])
    assert doc["parent"] == "c1" and doc["tables"]["emb"]["rows"] == len(snaps["c2"]["embedding"])
    assert res["torch"] is False
    res = _run("verify", str(tmp_path / "c2"))
    assert res["code"] == 0 and "chain of 3 links" in res["out"] and res["torch"] is False


def test_the_check_sees_torch_when_it_is_loaded(out_dir):
    """Control: reading tensors does import torch, and the probe reports it."""
    script = ("import json, sys, recckpt\n"
              "v = recckpt.open(sys.argv[1]); v.dense_tensors()\n"
              "print(json.dumps({'torch': 'torch' in sys.modules}))")
    assert _run(str(out_dir / "ckpt_1"), script=script)["torch"] is True


def test_dtype_names_agree_with_torch():
    """The format's dtype table is plain data (no torch at import); it must match torch's dtypes."""
    for name in dtypes.names():
        t = dtypes.torch_dtype(name)
        assert dtypes.name_of(t) == name
        assert torch.empty((), dtype=t).element_size() == dtypes.itemsize(name)
        np_name = dtypes.numpy_dtype(name)
        if np_name is not None:
            assert torch.empty(0, dtype=t).numpy().dtype == np.dtype(np_name), name
    with pytest.raises(TypeError, match="cannot be stored"):
        dtypes.name_of(torch.complex64)


@pytest.mark.parametrize("argv,torch_expected", [
    (["--format", "parquet"], False), (["--format", "npy", "--dtype", "int8"], False),
    (["--format", "parquet", "--dtype", "fp16"], True),          # torch's F16C conversion
    (["--format", "safetensors"], True),                         # the safetensors writer takes tensors
])
def test_export_imports_torch_only_where_it_needs_it(out_dir, tmp_path, argv, torch_expected):
    """Issue 29 item 7: `recckpt export` imported torch for every format and dtype."""
    res = _run("export", str(out_dir / "ckpt_1"), "--out", str(tmp_path / "o"), *argv)
    assert res["code"] == 0, res["out"]
    assert res["torch"] is torch_expected, f"export {' '.join(argv)}: torch imported = {res['torch']}"
