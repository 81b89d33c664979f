"""Real processes: a training job killed with SIGKILL resumes to the same losses as one never
interrupted; SIGTERM with the preemption handler leaves a durable checkpoint and then exits."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.training_child import run

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "helpers", "training_child.py")


def read_losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                out[int(parts[0])] = float.fromhex(parts[1])
    return out


def start(out, losses, steps, *extra):
    return subprocess.Popen([sys.executable, SCRIPT, "--out", str(out), "--steps", str(steps),
                             "--losses", str(losses), *extra])


def wait_for_step(losses, step, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(losses) and max(read_losses(losses), default=0) >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"training process exited early with {proc.returncode}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"training did not reach step {step} in {timeout} s")


@pytest.mark.parametrize("async_save", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_sigkill_then_resume_gives_identical_losses(tmp_path, async_save):
    steps = 40
    flags = ["--interval", "5", "--sleep", "0.02"] + (["--async"] if async_save else [])
    whole = run(tmp_path / "whole", steps, interval=5, async_save=async_save)
    out, losses = tmp_path / "killed", tmp_path / "losses.txt"
    proc = start(out, losses, steps, *flags)
    wait_for_step(losses, 23, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    before = read_losses(losses)
    assert max(before) < steps                       # it really was cut short
    resumed = start(out, tmp_path / "losses2.txt", steps, *flags)
    assert resumed.wait(120) == 0
    after = read_losses(tmp_path / "losses2.txt")
    first_resumed = min(after)
    assert first_resumed <= max(before) and (first_resumed - 1) % 5 == 0   # restarted from a checkpoint
    assert [whole[s - 1] for s in sorted(after)] == [after[s] for s in sorted(after)]
    assert sorted(after)[-1] == steps
    assert [whole[s - 1] for s in sorted(before)] == [before[s] for s in sorted(before)]


def test_sigterm_saves_durably_at_next_step_then_exits(tmp_path):
    out, losses = tmp_path / "run", tmp_path / "losses.txt"
    proc = start(out, losses, 10_000, "--interval", "1000", "--async", "--preemption", "--sleep", "0.02")
    wait_for_step(losses, 8, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM          # exits as SIGTERM would have, after the save
    last = max(read_losses(losses))
    with open(out / "checkpoint") as f:
        ids = [line.strip() for line in f if line.strip()]
    assert len(ids) == 1 and last - 1 <= int(ids[0].split("_")[1]) <= last
    assert os.path.exists(out / ids[0] / "manifest.json")
    assert not [n for n in os.listdir(out) if n.startswith(".staging")]
    # and it resumes from there
    resumed = start(out, tmp_path / "l2.txt", int(ids[0].split("_")[1]) + 2, "--interval", "1000")
    assert resumed.wait(60) == 0
    assert min(read_losses(tmp_path / "l2.txt")) == int(ids[0].split("_")[1]) + 1


def test_demo_small_run_ends_all_equal_under_its_out_dir(tmp_path):
    """The README's first command, at a small size: kill, resume, bit-equal losses, summary table."""
    out = tmp_path / "demo"
    root = os.path.dirname(os.path.dirname(HERE))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "demo.py"), "--out", str(out),
                        "--steps", "40", "--batch-size", "128", "--save-interval", "10", "--kill-at", "24"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ALL EQUAL" in r.stdout and "checkpoints written" in r.stdout
    import json
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["equal"] and summary["killed_at"] >= 24 and summary["resumed_from_step"] <= summary["killed_at"]
    assert sorted(os.listdir(tmp_path)) == ["demo"]       # nothing written outside --out
    assert sorted(os.listdir(out)) == ["killed_and_resumed", "summary.json", "uninterrupted"]
