"""Listing an output directory on S3 (moto on 127.0.0.1) as restore() and `ls` do (issue 26): one
listing of the top level, no isdir (on a prefix of 10 000 checkpoints an isdir costs more than the
listing), no manifest read but the newest's, and the catalog still advisory: a checkpoint deleted by hand,
one committed without a catalog entry, and a garbled catalog all give the listing of the objects."""
from __future__ import annotations

import json
import logging
import uuid

import pytest
import torch

import recckpt
from helpers.tables import assert_tables_equal
from recckpt import _C, CheckpointManager, HashTable, SaveOptions, Saver
from recckpt.format import catalog
from recckpt.storage import fsspec_store, open_storage

logging.getLogger("werkzeug").setLevel(logging.ERROR)
OPTS = SaveOptions(num_buckets=16, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4)


def manager(url, server):
    m = Model()
    return m, CheckpointManager(Saver(m, output_dir=url, max_keep=None, options=OPTS,
                                      storage_options=server.options()), save_interval=1)


def run(url, server, steps):
    m, mgr = manager(url, server)
    for _ in range(steps):
        m.emb(torch.randint(0, 1000, (20,)))
        mgr.step()
    mgr.wait()
    return m


@pytest.fixture
def counted(monkeypatch):
    """Calls of the object store's isdir / listdir and of manifest reads, by path."""
    calls = {"isdir": [], "listdir": [], "manifest": []}
    for name in ("isdir", "listdir"):
        real = getattr(fsspec_store.FsspecStorage, name)

        def spy(self, path, _real=real, _name=name):
            calls[_name].append(path)
            return _real(self, path)
        monkeypatch.setattr(fsspec_store.FsspecStorage, name, spy)
    real_manifest = catalog.read_manifest
    monkeypatch.setattr(catalog, "read_manifest", lambda st, d: calls["manifest"].append(d) or real_manifest(st, d))
    return calls


def test_restore_and_ls_on_s3_list_once_without_isdir(s3_server, s3_bucket, counted):
    url = f"s3://{s3_bucket}/run"
    m = run(url, s3_server, 6)
    for v in counted.values():
        v.clear()
    m2, mgr = manager(url, s3_server)
    assert mgr.restore() == 6
    assert_tables_equal(m.emb, m2.emb)
    assert counted["isdir"] == []
    assert counted["listdir"].count("") == 1, counted["listdir"]
    assert [d for d in counted["manifest"] if d != "ckpt_6"] == []
    for v in counted.values():
        v.clear()
    listing = recckpt.list_checkpoints(url, s3_server.options())
    assert [c.step for c in listing.checkpoints] == [1, 2, 3, 4, 5, 6]
    # (one isdir of the version file's name: the stray check's, a request whatever the checkpoints)
    assert counted["isdir"] in ([], ["checkpoint"]) and counted["listdir"].count("") == 1, counted
    assert [d for d in counted["manifest"] if d != "ckpt_6"] == []


def test_a_missing_output_dir_on_s3_is_still_told_apart(s3_server, s3_bucket):
    _, mgr = manager(f"s3://{s3_bucket}/nothing-here", s3_server)
    assert mgr.restore() is None
    with pytest.raises(recckpt.errors.CheckpointNotFoundError, match="does not exist"):
        Saver(Model(), output_dir=f"s3://{s3_bucket}/nothing-here",
              storage_options=s3_server.options()).load()


def _resign(fs, key, edit):
    head, body = fs.cat(key).split(b"\n", 1)
    obj, head = json.loads(body), json.loads(head)
    edit(obj)
    body = json.dumps(obj).encode()
    head.update(bytes=len(body), crc32c=_C.crc32c(body))
    fs.pipe(key, json.dumps(head).encode() + b"\n" + body)


def test_a_stale_or_garbled_catalog_on_s3_still_lists_what_is_committed(s3_server, s3_bucket, caplog):
    url = f"s3://{s3_bucket}/run"
    run(url, s3_server, 4)
    fs = s3_server.fs()
    st = open_storage(url, s3_server.options())
    # deleted by hand (objects removed, catalog untouched): gone from the listing
    fs.rm(f"{s3_bucket}/run/ckpt_2", recursive=True)
    assert [i for i, _ in catalog.committed(st)] == ["ckpt_1", "ckpt_3", "ckpt_4"]
    # the newest committed by a writer that does not know the catalog: listed, and restore picks it
    m, mgr = manager(url, s3_server)
    assert mgr.restore() == 4
    mgr.step()                 # ckpt_5
    mgr.wait()
    ids = ["ckpt_1", "ckpt_3", "ckpt_4", "ckpt_5"]
    _resign(fs, f"{s3_bucket}/run/.catalog.json", lambda o: o["checkpoints"].pop("ckpt_5"))
    assert [(i, e.step) for i, e in catalog.committed(st)] == [("ckpt_1", 1), ("ckpt_3", 3), ("ckpt_4", 4),
                                                               ("ckpt_5", 5)]
    assert manager(url, s3_server)[1].restore() == 5
    # a newest entry that does not match its manifest, then a garbled catalog: rebuilt, same answer
    catalog.sync_version_file(st, fsync=False)     # what a save's start-up recovery does: all entries back
    assert "ckpt_5" in json.loads(fs.cat(f"{s3_bucket}/run/.catalog.json").split(b"\n", 1)[1])["checkpoints"]
    _resign(fs, f"{s3_bucket}/run/.catalog.json",
            lambda o: o["checkpoints"]["ckpt_5"].update(manifest_sha256="0" * 64,
                                                        metadata={"recckpt.global_step": "999"}))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        assert [(i, e.step) for i, e in catalog.committed(st)][-1] == ("ckpt_5", 5)
    assert any("does not match checkpoint" in r.getMessage() for r in caplog.records)
    raw = bytearray(fs.cat(f"{s3_bucket}/run/.catalog.json"))
    raw[len(raw) // 2] ^= 1
    fs.pipe(f"{s3_bucket}/run/.catalog.json", bytes(raw))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        assert [i for i, _ in catalog.committed(st)] == ids
    assert any("garbled" in r.getMessage() for r in caplog.records)


def test_loading_a_checkpoint_whose_manifest_went_after_its_commit_says_so_and_names_gc(s3_server, s3_bucket):
    """An older checkpoint's manifest removed by hand on S3 (the catalog, trusted there without a request per
    checkpoint, still lists it). The load by id said "does not exist or was never committed; committed:
    ['ckpt_1', ...]", naming the very checkpoint it said was not committed, and not what to do."""
    url = f"s3://{s3_bucket}/run"
    run(url, s3_server, 2)
    s3_server.fs().rm(f"{s3_bucket}/run/ckpt_1/manifest.json")
    with pytest.raises(recckpt.errors.CheckpointNotFoundError) as e:
        Saver(Model(), output_dir=url, storage_options=s3_server.options()).load(ckpt_id="ckpt_1")
    msg = str(e.value)
    assert "has no manifest.json, though the output directory's catalog still lists it" in msg, msg
    assert "recckpt gc" in msg and "committed now: ['ckpt_2']" in msg, msg


def test_a_checkpoint_in_a_missing_bucket_is_told_apart_from_a_missing_manifest(s3_server):
    """verify, open and a direct-path load of s3://<missing bucket>/run/c1 said "not a committed checkpoint
    (no manifest.json); pass a checkpoint directory", which the user did; ls, gc and prune already named the
    missing bucket."""
    url = f"s3://nosuchbucket-{uuid.uuid4().hex[:8]}/run/c1"
    opts = s3_server.options()
    for call in (lambda: recckpt.verify(url, storage_options=opts), lambda: recckpt.open(url, opts),
                 lambda: Saver(Model(), output_dir=url, storage_options=opts).load(ckpt_path=url, direct_path=True)):
        with pytest.raises(recckpt.errors.StorageError, match=r"bucket 'nosuchbucket-\w+' of .* does not exist"):
            call()
