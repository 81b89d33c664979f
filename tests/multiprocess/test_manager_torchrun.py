"""CheckpointManager under torchrun, as users run it: real worker processes (gloo on CPU), the manager's
default arguments (its world comes from the process group), and a guard in every worker that fails
the run if recckpt issues a collective on the default process group (tests/helpers/dist_training_child.py).

Covered: N->M restores with every id exactly once (2->3 async, 3->2 sync), SIGTERM to one rank, SIGKILL
of the whole job and a bit-identical restart, and a rank that raises inside an async save."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import recckpt

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "dist_training_child.py")


def launch(world, out, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={world}", CHILD, "--out", str(out), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def run(world, out, *args, timeout=240):
    p = launch(world, out, *args)
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
        pytest.fail(f"torchrun on {world} workers did not finish in {timeout} s:\n{text[-4000:]}")
    assert p.returncode == 0, text[-6000:]
    return text


def kill_job(p, out, world):
    """SIGKILL every worker and torchrun at once (torchrun starts its workers in sessions of their own,
    so killing its process group alone would leave them running)."""
    pids = []
    for r in range(world):
        with open(os.path.join(out, "report", f"pid-{world}-{r}")) as f:
            pids.append(int(f.read()))
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()


def losses(out, world, rank=0):
    got = {}
    with open(os.path.join(out, "report", f"losses-{world}-{rank}.txt")) as f:
        for line in f:
            step, value = line.split()
            got[int(step)] = float.fromhex(value)   # a step run again after a restart: the last one wins
    return got


def end_state(out, world):
    return [dict(np.load(os.path.join(out, "report", f"end-{world}-{r}.npz"))) for r in range(world)]


def rows_by_id(states):
    rows = {}
    for s in states:
        for i, e, a in zip(s["ids"].tolist(), s["embedding"], s["acc"]):
            assert i not in rows, f"id {i} is on two ranks"
            rows[i] = (e, a)
    return rows


def committed(out):
    with open(os.path.join(out, "ckpt", "checkpoint")) as f:
        return [line.strip() for line in f if line.strip()]


def verified(out, ckpt_id):
    report = recckpt.verify(os.path.join(out, "ckpt", ckpt_id))
    assert report.ok, report.problems
    return report


# The uninterrupted 2-worker run (24 steps, an async save every 4) is saved once per module: it is the
# reference of the kill-and-restart test and the saved job of the 2 -> 3 restore (one torchrun job fewer).
STEPS, EVERY = 24, 4
ASYNC = ["--steps", STEPS, "--interval", EVERY, "--async"]


@pytest.fixture(scope="module")
def whole2(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole2")
    run(2, out, *ASYNC)
    return out


@pytest.mark.parametrize("before,after,mode", [(2, 3, "--async"), pytest.param(3, 2, "--sync", marks=pytest.mark.slow)])
def test_restore_on_another_world_size_gives_every_id_exactly_once(tmp_path, request, before, after, mode):
    flags = ["--steps", STEPS, "--interval", EVERY] + (["--async"] if mode == "--async" else [])
    if (before, mode) == (2, "--async"):
        shutil.copytree(request.getfixturevalue("whole2"), tmp_path, dirs_exist_ok=True)   # that very run
    else:
        run(before, tmp_path, *flags)
    last = f"ckpt_{STEPS}"
    assert committed(tmp_path) == [f"ckpt_{s}" for s in range(EVERY, STEPS + 1, EVERY)]
    with open(os.path.join(tmp_path, "ckpt", last, "manifest.json")) as f:
        assert f'"shard_num":{before}' in f.read().replace(" ", ""), "every rank's rows, not one rank's"
    verified(tmp_path, last)
    saved = end_state(tmp_path, before)
    run(after, tmp_path, *flags)      # restore only: the loop has nothing left to do
    loaded = end_state(tmp_path, after)
    want, got = rows_by_id(saved), rows_by_id(loaded)
    assert set(got) == set(want) and len(got) > 1000
    for i, (e, a) in want.items():
        assert np.array_equal(got[i][0], e) and np.array_equal(got[i][1], a)
    for r, s in enumerate(loaded):   # each rank holds exactly the ids it owns under the new world size
        assert (recckpt.partition(__import__("torch").from_numpy(s["ids"]), after).numpy() == r).all()
        assert int(s["step"]) == STEPS and str(s["restored_from"]) == last
        for k in (k for k in s if k.startswith("dense.")):
            assert np.array_equal(s[k], saved[0][k]), k


def test_a_job_killed_mid_save_restarts_bit_identically(tmp_path, whole2):
    whole, killed = whole2, tmp_path / "killed"
    p = launch(2, killed, *ASYNC, "--sleep", 0.05)
    deadline = time.monotonic() + 120
    path = os.path.join(killed, "report", "losses-2-0.txt")
    while time.monotonic() < deadline and not (os.path.exists(path) and max(losses(killed, 2), default=0) >= 14):
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.02)
    kill_job(p, killed, 2)
    cut = max(losses(killed, 2))
    assert cut < STEPS
    run(2, killed, *ASYNC)
    a, b = losses(whole, 2), losses(killed, 2)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert a == b, "a resumed run must reproduce the uninterrupted one bit for bit"
    for x, y in zip(end_state(whole, 2), end_state(killed, 2)):   # row order differs after a load: by id
        ox, oy = np.argsort(x["ids"]), np.argsort(y["ids"])
        assert np.array_equal(x["ids"][ox], y["ids"][oy])
        assert np.array_equal(x["embedding"][ox], y["embedding"][oy]) and np.array_equal(x["acc"][ox], y["acc"][oy])
    for cid in committed(killed):
        verified(killed, cid)


def test_sigterm_to_one_rank_makes_every_rank_save_the_same_step_and_exit(tmp_path):
    p = launch(2, tmp_path, "--steps", 100000, "--interval", 100000, "--preemption", "--sleep", 0.05,
               "--seconds", 3600)
    pid_file = os.path.join(tmp_path, "report", "pid-2-1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (os.path.exists(pid_file) and os.path.exists(
            os.path.join(tmp_path, "report", "losses-2-1.txt")) and max(losses(tmp_path, 2, 1), default=0) >= 6):
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.02)
    with open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGTERM)      # only rank 1 is told
    text, _ = p.communicate(timeout=120)
    ids = committed(tmp_path)
    assert len(ids) == 1, text[-3000:]
    step = int(ids[0].split("_")[1])
    assert max(losses(tmp_path, 2, 0)) == max(losses(tmp_path, 2, 1)) == step, "both ranks stop at the saved step"
    assert verified(tmp_path, ids[0])
    assert "DefaultGroupUsed" not in text
    run(2, tmp_path, "--steps", step + 2, "--interval", 100000)
    assert [int(s["step"]) for s in end_state(tmp_path, 2)] == [step + 2] * 2


def test_a_rank_that_raises_inside_an_async_save_fails_it_everywhere_and_the_next_save_works(tmp_path):
    text = run(2, tmp_path, "--steps", 20, "--interval", 5, "--async", "--fail-rank", 1, "--fail-save", 1)
    reports = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(tmp_path, "report", "errors-*"))))
    assert committed(tmp_path) == ["ckpt_5", "ckpt_15", "ckpt_20"], reports + text[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "ckpt", "ckpt_10"))
    assert not glob.glob(os.path.join(tmp_path, "ckpt", ".staging*"))
    for rank in (0, 1):
        with open(os.path.join(tmp_path, "report", f"errors-2-{rank}.txt")) as f:
            errors = f.read()
        assert "ckpt_10" in errors and "AsyncSaveError" in errors, errors
        assert "injected failure on rank 1" in errors, f"rank {rank} must learn why: {errors}"
    for cid in committed(tmp_path):
        verified(tmp_path, cid)


def test_a_rank_whose_async_snapshot_fails_fails_that_save_everywhere_and_the_next_save_works(tmp_path):
    """Rank 1's reader raises in dump_io_state when the async save of ckpt_10 takes its snapshot (on the
    training thread, before the commit protocol). That rank used to skip the save while rank 0's writer
    waited in it: the ranks then paired ckpt_10 with ckpt_15, and so on, and nothing committed again."""
    text = run(2, tmp_path, "--steps", 20, "--interval", 5, "--async", "--fail-rank", 1, "--fail-save", 1,
               "--fail-in", "capture")
    reports = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(tmp_path, "report", "errors-*"))))
    assert committed(tmp_path) == ["ckpt_5", "ckpt_15", "ckpt_20"], reports + text[-3000:]
    for rank in (0, 1):
        with open(os.path.join(tmp_path, "report", f"errors-2-{rank}.txt")) as f:
            errors = f.read()
        assert "ckpt_10" in errors and "rank 1's snapshot" in errors and "injected failure" in errors, errors
    for cid in committed(tmp_path):
        verified(tmp_path, cid)


def test_manager_world_comes_from_the_group_and_restore_agrees_across_ranks(tmp_path):
    from helpers import rank_scenarios as sc
    from helpers.ranks import ok, run_ranks
    got = ok(run_ranks(2, sc.manager_world, str(tmp_path / "out"), out_dir=str(tmp_path / "reports")))
    for rank, g in enumerate(got):
        assert g["default"] == [rank, 2]
        assert "disagree with the initialised torch.distributed process group (rank" in g["explicit_single"]
        assert "Saver.save: shard_id=0, shard_num=1 disagree" in g["saver_explicit_single"]
        # rank 1 finds ckpt_2 corrupt: both ranks fall back to ckpt_1 together, never to different steps
        assert g["restored"] == 1, g
        assert any("ckpt_2" in w and "corrupt" in w for w in g["warnings"]), g["warnings"]
    # the rank that did not find it corrupt is told which rank did
    assert any("ckpt_2" in w and "rank 1 found it so" in w for w in got[0]["warnings"]), got[0]["warnings"]


def test_a_rank_that_stalls_inside_an_async_save_fails_it_within_the_timeout(tmp_path):
    """Rank 1 stops responding for 3x the coordination timeout inside the save of ckpt_10: every rank
    fails that save (none waits for ever), nothing of it commits, and later saves work again."""
    t0 = time.monotonic()
    run(2, tmp_path, "--steps", 20, "--interval", 5, "--async", "--fail-rank", 1, "--fail-save", 1,
        "--stall", 9, "--timeout", 3, timeout=300)
    assert "ckpt_10" not in committed(tmp_path)
    assert committed(tmp_path)[0] == "ckpt_5" and committed(tmp_path)[-1] == "ckpt_20"
    for rank in (0, 1):
        with open(os.path.join(tmp_path, "report", f"errors-2-{rank}.txt")) as f:
            errors = f.read()
        assert "ckpt_10" in errors, f"rank {rank} must report the failed save: {errors}"
    for cid in committed(tmp_path):
        verified(tmp_path, cid)
    assert time.monotonic() - t0 < 240
