"""The commit protocol belongs to the store: claims that protect a live writer's save target from
recovery, retention that rewrites the version file before deleting, and no store-kind branches outside
recckpt/storage."""
from __future__ import annotations

import os
import pathlib
import re
import uuid

import fsspec
import torch

from helpers.shared_dir_child import Model
from recckpt import SaveOptions, Saver
from recckpt.format import catalog, names, recovery
from recckpt.storage import FsspecStorage, LocalStorage, open_storage

OPTS = SaveOptions(num_buckets=16, chunk_bytes=1024, segment_bytes=1 << 14, fsync=False)


def dead_process_claim(target: str) -> bytes:
    """The claim body a process on this machine wrote for `target` before it exited."""
    import subprocess
    import sys
    code = f"from recckpt.storage import claims; print(claims.encode(claims.body({target!r})).decode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[2]))).stdout
    return out.strip().encode()


def _model(k):
    m = Model()
    ids = torch.arange(10 * k, 10 * k + 30)
    m.t.set_rows(ids, {"embedding": torch.full((30, 8), float(k))})
    return m


def test_recovery_leaves_a_claimed_staging_dir_and_removes_an_unclaimed_one(tmp_path):
    st = LocalStorage(str(tmp_path))
    live, dead = ".staging-c1-aaaa", ".staging-c2-bbbb"
    claim = st.claim(live, names.owner_file(live, 0))
    for d in (live, dead):
        st.makedirs(f"{d}/sparse")
        st.write_bytes(f"{d}/sparse/shard-00000-000.bin", b"x")
    # a crashed writer's claim: nobody holds its lock, and its process (on this machine) has exited
    st.write_bytes(names.owner_file(dead, 0), dead_process_claim(dead))
    removed = recovery.recover(st).removed
    assert dead in removed and live not in removed
    assert st.isdir(live) and not st.isdir(dead) and not st.exists(names.owner_file(dead, 0))
    claim.release()
    assert not st.exists(names.owner_file(live, 0))
    assert live in recovery.recover(st).removed


def test_a_claim_removed_by_recovery_between_open_and_lock_is_taken_again(tmp_path):
    st = LocalStorage(str(tmp_path))
    owner = names.owner_file(".staging-x-1", 0)
    c1 = st.claim(".staging-x-1", owner)
    os.remove(st.local_path(owner))       # as recovery would, had the lock been free
    c2 = st.claim(".staging-x-1", owner)  # a new inode, locked by us
    assert not st.remove_if_unowned([owner], [])
    c1.release()
    c2.release()


def test_retention_rewrites_the_version_file_before_it_deletes(tmp_path, monkeypatch):
    seen = []
    real = catalog.delete

    def spy(storage, ckpt_id):
        seen.append((ckpt_id, catalog.read_version_file(storage)))
        real(storage, ckpt_id)

    monkeypatch.setattr(catalog, "delete", spy)
    for k in range(3):
        Saver(_model(k), output_dir=tmp_path, max_keep=1, options=OPTS).save(f"c{k}")
    assert seen and all(cid not in (listed or []) for cid, listed in seen), seen
    assert catalog.read_version_file(open_storage(str(tmp_path))) == ["c2"]


def test_memory_store_commits_in_place_with_the_manifest_last():
    url = f"memory://commit-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    order = []
    real = FsspecStorage.put_bytes

    def spy(self, path, data, exclusive=False):
        order.append(path)
        real(self, path, data, exclusive)

    FsspecStorage.put_bytes = spy
    try:
        Saver(_model(1), output_dir=url, options=OPTS).save("c1")
    finally:
        FsspecStorage.put_bytes = real
    data = [p for p in order if p.startswith("c1/")]
    assert data[-1] == "c1/manifest.json", order
    assert not [p for p in fs.find(url[len("memory://"):]) if "staging" in p]


def test_no_store_kind_branches_outside_storage():
    root = pathlib.Path(__file__).resolve().parents[2] / "recckpt"
    bad = [str(p.relative_to(root)) for p in root.rglob("*.py") if "storage" not in p.parts
           and re.search(r"\bis_local\b|\batomic_rename\b", p.read_text())]
    assert not bad, bad
