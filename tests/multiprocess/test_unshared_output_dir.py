"""A save never reports success for a checkpoint that cannot be loaded (issue 29 item 3).

Two real ranks (gloo on 127.0.0.1), each in its own mount namespace with a private tmpfs mounted at the
same output_dir path, as the nodes of a multi-node job given a node-local path: the save must fail on
both ranks, naming the ranks and a missing file, and commit nothing. Then the same ranks with rank 1's
files appearing on rank 0's disk only seconds later (a shared filesystem that shows another node's
files late): the save waits for them and commits a checkpoint that verifies."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from helpers.ranks import free_port
from recckpt.format import names

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers",
                     "private_disk_child.py")
MOUNT_THEN_RUN = 'mount -t tmpfs -o size=256m tmpfs "$0" && exec "$@"'


def _why_no_private_mounts(tmp_path) -> str | None:
    if os.geteuid() != 0:
        return "needs root: each rank mounts a private tmpfs in its own mount namespace (unshare -m)"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    d = tmp_path / "probe"
    d.mkdir()
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", MOUNT_THEN_RUN, str(d),
                        "touch", str(d / "inside")], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"this machine does not allow a private mount namespace with a tmpfs: {r.stderr.strip()[:200]}"
    if (d / "inside").exists():
        return "unshare -m did not give the child a private mount (the file it wrote is visible here)"
    return None


@pytest.fixture
def private_mounts(tmp_path):
    why = _why_no_private_mounts(tmp_path)
    if why:
        pytest.skip(why)


def start_ranks(tmp_path, out, visibility_s):
    port = str(free_port())
    procs = []
    for r in range(2):
        err = open(tmp_path / f"stderr{r}.txt", "w")
        procs.append(subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", MOUNT_THEN_RUN, str(out),
             sys.executable, CHILD, str(out), str(r), "2", port, str(tmp_path / f"result{r}.json"),
             str(visibility_s)], stderr=err))
        err.close()
    return procs


def results(tmp_path, procs):
    for p in procs:
        assert p.wait(timeout=240) == 0
    out = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    for r in out:
        assert "crash" not in r, r["crash"]
    return out


def test_a_node_local_output_dir_fails_the_save_on_every_rank(tmp_path, private_mounts):
    out = tmp_path / "out"
    out.mkdir()
    res = results(tmp_path, start_ranks(tmp_path, out, visibility_s=1.0))
    for r in res:
        assert r["outcome"] == "error", f"rank {r['rank']} reported success for a checkpoint it cannot load: {r}"
        e = r["error"]
        assert "not shared between the ranks" in e and "rank(s) 1" in e, e
        assert "sparse/worker-00001" in e, e          # a missing file, by name
        assert "shared filesystem" in e and "object store" in e, e
        assert "Nothing was committed" in e, e
        assert r["committed"] == [] and not r["listed"], r
        assert "c" not in r["entries"], r["entries"]


def _mirror_rank1_late(pid0, pid1, out, delay_s, done):
    """Copy what rank 1 writes into rank 0's private disk, `delay_s` after rank 1 finished writing it:
    a shared filesystem on which rank 0 sees rank 1's files late. Reaches each rank's disk through
    /proc/PID/root (its view of the mounts)."""
    src_root, dst_root = f"/proc/{pid1}/root{out}", f"/proc/{pid0}/root{out}"
    index = names.worker_index(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            stages = [d for d in os.listdir(src_root) if d.startswith(names.STAGING_PREFIX)]
        except OSError:
            stages = []
        ready = [d for d in stages if os.path.exists(os.path.join(src_root, d, index))]
        if ready:
            time.sleep(delay_s)
            stage = ready[0]
            for dirpath, _, files in os.walk(os.path.join(src_root, stage)):
                rel_dir = os.path.relpath(dirpath, src_root)
                os.makedirs(os.path.join(dst_root, rel_dir), exist_ok=True)
                for f in files:
                    shutil.copyfile(os.path.join(dirpath, f), os.path.join(dst_root, rel_dir, f))
            done.append(time.monotonic())
            return
        time.sleep(0.02)


def test_files_another_node_shows_late_are_waited_for(tmp_path, private_mounts):
    out = tmp_path / "out"
    out.mkdir()
    procs = start_ranks(tmp_path, out, visibility_s=60.0)
    done = []
    t = threading.Thread(target=_mirror_rank1_late, args=(procs[0].pid, procs[1].pid, str(out), 2.0, done))
    t.start()
    res = results(tmp_path, procs)
    t.join()
    assert done, "rank 1's files were never copied over"
    for r in res:
        assert r["outcome"] == "ok", r
    assert res[0]["committed"] == ["c"] and res[0]["verify_ok"]
    assert res[0]["seconds"] >= 1.5, "rank 0 committed before rank 1's files could be seen"
    log = (tmp_path / "stderr0.txt").read_text()
    assert "not visible yet" in log and "rank(s) [1]" in log, log[-2000:]
