"""Concurrent recoveries are safe (issue 30 item 6): a process removes only what it can prove abandoned.

Two real processes share one output directory: one keeps rewriting the version file (or saving), the
other keeps running start-up recovery; none of the first one's temporary files may vanish under it.
Claims record host, boot id, pid namespace, process, heartbeat and expiry (recckpt/storage/claims.py):
a claim written elsewhere (another host, another boot, another container) lives until it expires,
whatever its pid looks like here, and one of an exited process on this machine goes at once. Each
verdict is reached by `gc` in a process of its own, on a local directory and on S3 (moto)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from recckpt.format import names
from recckpt.storage import claims

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "helpers", "recovery_rival_child.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))


def run_pair(url, tmp_path, modes, seconds):
    start = tmp_path / "go"
    kids = [subprocess.Popen([sys.executable, CHILD, mode, url, str(seconds), str(start)], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mode in modes]
    time.sleep(0.5)
    start.write_text("go")
    out = []
    for k in kids:
        so, se = k.communicate(timeout=seconds + 300)
        assert k.returncode == 0, se[-3000:]
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


# CI runs the version-file rival; the slow flag adds the saving rival (the same recovery path, other writes).
@pytest.mark.parametrize("modes", [("versions", "recover"), pytest.param(("saves", "recover"), marks=pytest.mark.slow)])
def test_a_rivals_recovery_never_removes_live_temporary_files(tmp_path, modes, slow_mode):
    out = tmp_path / "out"
    out.mkdir()
    seconds = 20 if slow_mode else 4
    writer, recoverer = run_pair(str(out), tmp_path, modes, seconds)
    assert writer["errors"] == [], writer
    assert recoverer["errors"] == [], recoverer
    assert writer["done"] >= 5 and recoverer["done"] >= 5, (writer, recoverer)
    # Once both are gone, what they left is provably abandoned: a last recovery removes all of it (the
    # catalog, rebuilt by gc, is the one dot-file an output directory keeps).
    subprocess.run([sys.executable, "-m", "recckpt", "gc", str(out)], env=ENV, check=True, capture_output=True)
    assert [n for n in os.listdir(out) if n.startswith(".") and n != names.CATALOG] == []


# ------------------------------------------------------------------------- crafted claims, judged by gc
def exited_process_body(target: str) -> dict:
    """The claim a process of this machine wrote for `target` before it exited."""
    code = f"from recckpt.storage import claims; print(claims.encode(claims.body({target!r})).decode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=ENV).stdout
    return claims.decode(out.strip().encode())


def variants(target: str) -> dict[str, tuple[dict, bool]]:
    """name -> (claim body, whether recovery must keep the target)."""
    dead = exited_process_body(target)
    now = time.time()
    return {
        # a process on another host: its pid means nothing here; its lease is fresh
        "other_host_fresh": ({**dead, "host": "another-host.example"}, True),
        # the same host name after a reboot, or a second machine of that name: a dead pid here proves nothing
        "other_boot_dead_pid": ({**dead, "boot_id": "00000000-0000-0000-0000-000000000000"}, True),
        # another container of this kernel (its own pid namespace)
        "other_pid_namespace": ({**dead, "pid_ns": "pid:[1]"}, True),
        # a long lease of its own (a writer with lease_s = 600), last beat 100 s ago
        "own_long_lease": ({**dead, "host": "another-host.example", "beat": now - 100, "expires": now + 500}, True),
        # another host, lease expired
        "other_host_expired": ({**dead, "host": "another-host.example", "beat": now - 200, "expires": now - 140},
                               False),
        # this machine, its process has exited: no need to wait for the lease
        "this_machine_exited": (dead, False),
    }


VARIANTS = ["other_host_fresh", "other_boot_dead_pid", "other_pid_namespace", "own_long_lease",
            "other_host_expired", "this_machine_exited"]


def gc_in_a_process(url, storage_options=None):
    code = ("import json, sys, recckpt; print(json.dumps(recckpt.gc(sys.argv[1], storage_options="
            "json.loads(sys.argv[2]))))")
    p = subprocess.run([sys.executable, "-c", code, url, json.dumps(storage_options)], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return [n for n, _ in json.loads(p.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_local_claims_are_removed_only_when_provably_abandoned(tmp_path, variant):
    out = tmp_path / "out"
    target = ".staging-c1-0123abcd"
    (out / target / "sparse").mkdir(parents=True)
    (out / target / "sparse" / "shard-00000-000.bin").write_bytes(b"x" * 100)
    body, keep = variants(target)[variant]
    owner = out / names.owner_file(target, 0)
    owner.write_bytes(claims.encode(body))   # no process holds its lock: as seen from another host
    removed = gc_in_a_process(str(out))
    assert (target in removed) is not keep, (variant, removed)
    assert (out / target).is_dir() is keep and owner.exists() is keep


@pytest.mark.parametrize("variant", VARIANTS)
def test_s3_leases_are_removed_only_when_provably_abandoned(variant, s3_server, s3_bucket):
    fs = s3_server.fs()
    prefix = f"{s3_bucket}/claims-{variant}"
    target = "c1"   # object stores write in place: a manifest-less <ckpt_id>/ is a save target
    fs.pipe_file(f"{prefix}/{target}/sparse/shard-00000-000.bin", b"x" * 100)
    body, keep = variants(target)[variant]
    fs.pipe_file(f"{prefix}/{names.owner_file(target, 0)}", claims.encode(body))
    removed = gc_in_a_process(f"s3://{prefix}", s3_server.options())
    assert (target in removed) is not keep, (variant, removed)
    fs.invalidate_cache()
    assert fs.exists(f"{prefix}/{target}/sparse/shard-00000-000.bin") is keep
    assert fs.exists(f"{prefix}/{names.owner_file(target, 0)}") is keep


def test_a_claim_records_who_holds_it_and_until_when(tmp_path):
    from recckpt.storage import LocalStorage
    st = LocalStorage(str(tmp_path), lease_s=30)
    c = st.claim(".staging-x-1", names.owner_file(".staging-x-1", 0))
    try:
        b = claims.decode((tmp_path / names.owner_file(".staging-x-1", 0)).read_bytes())
        assert b["pid"] == os.getpid() and b["host"] and b["boot_id"] and b["pid_ns"] and b["start"] is not None
        assert b["target"] == ".staging-x-1" and 29 < b["expires"] - b["beat"] <= 30
        assert abs(b["beat"] - time.time()) < 5
        assert claims.abandoned(b) is None
    finally:
        c.release()


def test_a_claim_is_renewed_while_held(tmp_path):
    from recckpt.storage import LocalStorage
    st = LocalStorage(str(tmp_path), lease_s=0.3)
    owner = tmp_path / names.owner_file(".staging-x-1", 0)
    c = st.claim(".staging-x-1", owner.name)
    try:
        first = claims.decode(owner.read_bytes())["beat"]
        time.sleep(0.5)
        assert claims.decode(owner.read_bytes())["beat"] > first
    finally:
        c.release()
    assert not owner.exists()
