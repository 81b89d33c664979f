"""What a serving user met when an export could not go through (helper attack on export and the reader):
each case now fails before any byte is written, or cleans up, with an error naming the table, slot, id or
option and what to do."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import recckpt
from helpers.tables import DictTable
from recckpt import ExportOptions, SaveOptions, Saver
from recckpt.errors import InvalidArgumentError
from recckpt.state.protocol import SlotSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save(out, tables: dict, ckpt="c") -> str:
    """Save DictTables {name: {slot: (SlotSpec, rows)}} with ids 0..n-1; returns the checkpoint path."""
    m = torch.nn.Module()
    for i, (name, slots) in enumerate(tables.items()):
        t = DictTable(name, {s: spec for s, (spec, _) in slots.items()})
        n = len(next(iter(slots.values()))[1])
        t.set_rows(torch.arange(n), {s: rows for s, (_, rows) in slots.items()})
        setattr(m, f"t{i}", t)
    Saver(m, output_dir=str(out), options=SaveOptions(fsync=False)).save(ckpt)
    return os.path.join(str(out), ckpt)


def _emb(n, fill=None):
    rows = torch.randn(n, 4) if fill is None else torch.full((n, 4), fill)
    return {"embedding": (SlotSpec(torch.float32, (4,), "sparse"), rows)}


def test_int8_refusal_names_the_table_slot_and_id(tmp_path):
    """'a row holds NaN or infinity' named no table: with many tables the user could not tell which to
    export as fp32."""
    bad = torch.randn(50, 4)
    bad[17, 2] = float("inf")
    bad[20, 1] = float("nan")
    ck = _save(tmp_path / "run", {"good": _emb(30), "bad": {"embedding": (SlotSpec(torch.float32, (4,), "sparse"),
                                                                         bad)}})
    with pytest.raises(InvalidArgumentError, match=r"table 'bad', slot 'embedding', id (17|20): dtype=int8: .*NaN"):
        recckpt.export(ck, tmp_path / "o", ExportOptions(dtype="int8"))
    assert not (tmp_path / "o").exists()


def test_a_table_named_like_the_export_manifest_is_refused_first(tmp_path):
    ck = _save(tmp_path / "run", {"export.json": _emb(5), "plain": _emb(5)})
    with pytest.raises(InvalidArgumentError, match=r"table 'export.json' would take the name .* --tables"):
        recckpt.export(ck, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    got = recckpt.export(ck, tmp_path / "o", ExportOptions(tables=["plain"]))
    assert got.tables["plain"]["rows"] == 5


def test_a_name_that_cannot_be_a_file_says_how_to_skip_it(tmp_path):
    ck = _save(tmp_path / "run", {"user/item": _emb(5), "plain": _emb(5)})
    with pytest.raises(InvalidArgumentError, match=r"table 'user/item' cannot be used as a file name .* --tables"):
        recckpt.export(ck, tmp_path / "o")


def test_a_zero_width_slot_is_refused_for_parquet_and_exported_as_npy(tmp_path):
    ck = _save(tmp_path / "run", {"t": {"embedding": (SlotSpec(torch.float32, (4,), "sparse"), torch.randn(6, 4)),
                                        "empty": (SlotSpec(torch.float32, (0,), "sparse"), torch.empty(6, 0))}})
    with pytest.raises(InvalidArgumentError, match=r"slot 'empty' of table 't' .* no values per row .* npy or "
                                                   r"safetensors"):
        recckpt.export(ck, tmp_path / "o", ExportOptions(slots=["empty"]))
    assert not (tmp_path / "o").exists()
    got = recckpt.export(ck, tmp_path / "o", ExportOptions(slots=["empty"], format="npy"))
    assert got.tables["t"]["rows"] == 6


@pytest.mark.parametrize("where", ["inside", "itself", "parent_link"])
def test_out_inside_the_source_checkpoint_or_its_chain_is_refused(tmp_path, where):
    """A committed checkpoint is never written: an export into it made verify report unlisted files, and
    retention would delete the export with it."""
    ck = _save(tmp_path / "run", {"t": _emb(8)})
    src = ck
    if where == "parent_link":   # an increment: its parent is a link of what the export reads
        from unit.test_incremental import run_chain
        run_chain(str(tmp_path / "chain"), n_incr=1)
        src = str(tmp_path / "chain" / "c1")
        assert recckpt.open(src).links == ["c0", "c1"]
        out = str(tmp_path / "chain" / "c0" / "serving")
    else:
        out = ck if where == "itself" else os.path.join(ck, "serving")
    with pytest.raises(InvalidArgumentError, match=r"is inside checkpoint .* export to a directory outside it"):
        recckpt.export(src, out)
    assert not os.path.exists(os.path.join(out, "t")) and not (where != "itself" and os.path.exists(out))


def test_empty_out_and_a_file_given_as_the_checkpoint(tmp_path):
    ck = _save(tmp_path / "run", {"t": _emb(8)})
    with pytest.raises(InvalidArgumentError, match=r"out_dir \(--out\) is empty"):
        recckpt.export(ck, "")
    with pytest.raises(recckpt.errors.RecckptError, match=r"manifest.json is a file, not a checkpoint; pass its "
                                                          r"checkpoint directory"):
        recckpt.export(os.path.join(ck, "manifest.json"), tmp_path / "o")


def _cli(*args, **kw):
    # buffered output, as a user's shell has it (not PYTHONUNBUFFERED, which CI may set): the last write
    # then happens at the flush
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "recckpt", *args], env=env, cwd=ROOT, **kw)


def test_sigterm_mid_export_leaves_out_empty_and_the_rerun_works(tmp_path):
    """timeout(1), Kubernetes and Slurm stop a job with SIGTERM: the export left 130 MB of parts and no
    export.json, and the same command was then refused. Now SIGTERM cleans up as Ctrl-C does, then ends the
    process by the signal (a shell's status 143)."""
    n = 400_000
    ck = _save(tmp_path / "run", {"big": {"embedding": (SlotSpec(torch.float32, (64,), "sparse"),
                                                        torch.randn(n, 64))}})
    out = tmp_path / "o"
    p = _cli("export", ck, "--out", str(out), "--format", "npy", "--shard-rows", "20000", "--chunk-rows", "4096",
             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "big").exists() or not os.listdir(out / "big"):   # the export is writing parts
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else "slow"
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == -signal.SIGTERM, err
    assert "terminated" in err
    assert not out.exists(), os.listdir(out)
    q = _cli("export", ck, "--out", str(out), "--format", "npy", stderr=subprocess.PIPE, text=True)
    assert q.wait(timeout=120) == 0, q.stderr.read()
    assert sum(np.load(f).shape[0] for f in (out / "big").glob("*id*.npy")) == n


def test_a_refused_leftover_out_says_it_may_be_a_killed_export(tmp_path):
    """SIGKILL cannot be cleaned up: the refusal now says the directory has no export.json, but only where
    it holds nothing but table folders of parts: never for the output directory holding the checkpoint."""
    ck = _save(tmp_path / "run", {"t": _emb(8)})
    (tmp_path / "o" / "t").mkdir(parents=True)
    (tmp_path / "o" / "t" / "part-00000.parquet").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match=r"no export.json: if it is an export that was killed, remove it"):
        recckpt.export(ck, tmp_path / "o")
    with pytest.raises(InvalidArgumentError, match=r"exists and is not an empty directory") as e:
        recckpt.export(ck, tmp_path / "run")
    assert "remove it" not in str(e.value)


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path):
    """`recckpt inspect CK | head -1` printed 'error: BrokenPipeError' and exited 1."""
    ck = _save(tmp_path / "run", {f"t{i}": _emb(4) for i in range(30)})
    p = _cli("inspect", ck, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()   # the reader is gone before the first line, as `head -1` is after its own
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert "Error" not in err and "error" not in err, err


def test_reader_arguments_as_users_pass_them(tmp_path):
    """A bare string is one slot or key (not its letters); numpy integers are integers; a bool is not a
    worker."""
    ck = _save(tmp_path / "run", {"t": _emb(40)})
    view = recckpt.open(ck)
    rows = sum(len(ids) for ids, cols in view.iter_rows("t", slots="embedding") if list(cols) == ["embedding"])
    assert rows == 40
    assert sum(len(ids) for ids, _ in view.iter_rows("t", shard=(np.int64(0), np.int64(1)))) == 40
    assert sum(len(ids) for ids, _ in view.iter_rows("t", buckets=[0, np.int32(view.num_buckets)])) == 40
    with pytest.raises(InvalidArgumentError, match=r"io_state: worker must be an integer in \[0, 1\), got True"):
        view.io_state(True)
    assert view.io_state(np.int64(0)) is None
    with pytest.raises(InvalidArgumentError, match=r"no dense keys \['w'\]"):
        view.dense_tensors("w")


def test_int8_refusal_of_a_float64_beyond_float32_names_the_id(tmp_path):
    """int8 works in float32: a finite float64 beyond its range is infinity there, refused naming the id."""
    rows = torch.randn(9, 4, dtype=torch.float64)
    rows[4, 0] = 1e300
    ck = _save(tmp_path / "run", {"w": {"embedding": (SlotSpec(torch.float64, (4,), "sparse"), rows)}})
    with pytest.raises(InvalidArgumentError, match=r"table 'w', slot 'embedding', id 4: dtype=int8"):
        recckpt.export(ck, tmp_path / "o", ExportOptions(dtype="int8"))


def test_sigterm_ends_an_in_process_caller_too(tmp_path):
    """A program calling recckpt.cli.main.main() in-process, stopped by SIGTERM, is stopped (after the
    command cleans up), not left running with the signal swallowed."""
    ck = _save(tmp_path / "run", {"t": _emb(8)})
    code = ("import importlib, os, signal\n"
            "m = importlib.import_module('recckpt.cli.main')\n"
            "def slow(args):   # a command the signal stops midway\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    signal.pause()\n"
            "m.cmd_inspect = slow\n"
            f"m.main(['inspect', {ck!r}])\n"
            "print('host still running')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGTERM, (p.returncode, p.stdout, p.stderr)
    assert "host still running" not in p.stdout and "terminated (SIGTERM)" in p.stderr


def test_sigterm_turned_into_another_error_by_c_code_still_ends_the_command_as_terminated(tmp_path):
    """The handler raises `Terminated`; where it runs inside a call back from C code (numpy writing a .npy
    file), that code may replace it with an error of its own (a TypeError about a file object was seen in a
    loaded run): the command then printed that error and exited 1 instead of ending by SIGTERM. Here the
    command's work turns whatever the signal raises into a TypeError, as in that race; a second main() in
    the same process is not taken for terminated by the first one's flag."""
    child = f"""
import os, signal, sys, time, importlib
import recckpt
m = importlib.import_module("recckpt.cli.main")
real = recckpt.open
def converting(*a, **k):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except BaseException:
        raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter")
recckpt.open = converting
code = m.main(["inspect", {str(tmp_path / 'missing')!r}])
print("returned", code, flush=True)
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGTERM and "terminated (SIGTERM)" in p.stderr, (p.returncode, p.stdout, p.stderr)
    stale = ("import importlib; m = importlib.import_module('recckpt.cli.main'); m._sigterm_seen.set(); "
             f"print('returned', m.main(['inspect', {str(tmp_path / 'missing')!r}]))")
    p = subprocess.run([sys.executable, "-c", stale], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "returned 1" in p.stdout, (p.returncode, p.stdout, p.stderr)
