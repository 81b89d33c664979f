"""The catalog (.catalog.json): listings read it instead of every manifest, it carries each checkpoint's
step, parent, size and compaction source, and it is advisory: checked against the directory listing and
the newest manifest, and rebuilt from the manifests when missing, garbled or stale."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import recckpt
from recckpt import _C, CheckpointManager, HashTable, SaveOptions, Saver, SparseAdam
from recckpt.format import catalog, catalog_file
from recckpt.storage import open_storage

OPTS = SaveOptions(num_buckets=16, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4)
        self.lin = torch.nn.Linear(4, 1)


def _manager(out, interval=1):
    m = Model()
    opt = SparseAdam([m.emb], lr=0.1)
    s = Saver(m, opt, output_dir=str(out), max_keep=None, options=OPTS)
    return m, CheckpointManager(s, save_interval=interval)


def _run(out, steps):
    m, mgr = _manager(out)
    for _ in range(steps):
        m.emb(torch.randint(0, 1000, (20,)))
        mgr.step()
    mgr.wait()
    return m, mgr


def _catalog(out) -> dict:
    return json.loads((out / ".catalog.json").read_bytes().split(b"\n", 1)[1])["checkpoints"]


def _count_manifest_reads(monkeypatch):
    reads = []
    real = catalog.read_manifest
    monkeypatch.setattr(catalog, "read_manifest", lambda st, d: reads.append(d) or real(st, d))
    return reads


def test_saves_keep_the_catalog_and_listings_read_no_old_manifest(tmp_path, monkeypatch):
    _run(tmp_path, 12)
    cat = _catalog(tmp_path)
    ids = [f"ckpt_{k}" for k in range(1, 13)]
    assert sorted(cat) == sorted(ids)
    assert [cat[i]["step"] for i in ids] == list(range(1, 13))
    for i in ids:
        m = json.loads((tmp_path / i / "manifest.json").read_text())
        size = sum(f["size"] for f in m["files"].values()) + m["shard_bytes"]
        assert cat[i]["size_bytes"] == size and cat[i]["compacted_from"] is None
    reads = _count_manifest_reads(monkeypatch)
    listing = recckpt.list_checkpoints(str(tmp_path))
    assert [c.ckpt_id for c in listing.checkpoints] == ids
    assert [c.step for c in listing.checkpoints] == list(range(1, 13))
    assert reads == ["ckpt_12"]        # only the newest, checked against its catalog entry
    # restore lists the same way, then loads the newest
    reads.clear()
    m, mgr = _manager(tmp_path)
    assert mgr.restore() == 12
    assert reads.count("ckpt_1") == 0


def test_without_the_catalog_the_manifests_give_the_same_listing(tmp_path):
    _run(tmp_path, 5)
    st = open_storage(str(tmp_path))
    with_cat = catalog.committed(st)
    (tmp_path / ".catalog.json").unlink()
    without = catalog.committed(st)
    assert with_cat == without
    catalog.sync_version_file(st, fsync=False)      # what a save's start-up recovery does
    assert sorted(_catalog(tmp_path)) == [i for i, _ in without]


def test_a_garbled_catalog_is_rebuilt(tmp_path, caplog):
    _run(tmp_path, 4)
    path = tmp_path / ".catalog.json"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        ids = [i for i, _ in catalog.committed(open_storage(str(tmp_path)))]
    assert ids == [f"ckpt_{k}" for k in range(1, 5)]
    assert any("catalog" in r.getMessage() and "garbled" in r.getMessage() for r in caplog.records)
    m, mgr = _manager(tmp_path)
    assert mgr.restore() == 4
    mgr.step()                       # the next save rewrites it from its listing
    mgr.wait()
    assert len(_catalog(tmp_path)) == 5


def _resign(path, edit, head_edit=None):
    """Edit the catalog's body (and header) and write it with a matching length and CRC, as a writer would."""
    head, body = path.read_bytes().split(b"\n", 1)
    obj = json.loads(body)
    head = json.loads(head)
    edit(obj)
    body = json.dumps(obj).encode()
    head.update(bytes=len(body), crc32c=_C.crc32c(body))
    if head_edit is not None:
        head_edit(head)
    path.write_bytes(json.dumps(head).encode() + b"\n" + body)


def test_stale_entries_follow_the_directories(tmp_path):
    """A checkpoint deleted by hand leaves the listing; one committed by a writer that does not know the
    catalog (an older recckpt) joins it, read from its manifest."""
    import shutil
    _run(tmp_path, 4)
    shutil.rmtree(tmp_path / "ckpt_2")
    assert "ckpt_2" in _catalog(tmp_path)
    st = open_storage(str(tmp_path))
    assert [i for i, _ in catalog.committed(st)] == ["ckpt_1", "ckpt_3", "ckpt_4"]
    m, mgr = _manager(tmp_path)
    assert mgr.restore() == 4
    mgr.step()                       # step 5
    mgr.wait()
    assert "ckpt_2" not in _catalog(tmp_path)
    _resign(tmp_path / ".catalog.json", lambda o: o["checkpoints"].pop("ckpt_5"))   # as an older writer
    assert [(i, e.step) for i, e in catalog.committed(st)] == [("ckpt_1", 1), ("ckpt_3", 3), ("ckpt_4", 4),
                                                               ("ckpt_5", 5)]


def test_a_folder_without_its_manifest_is_not_listed(tmp_path, capsys):
    """An interrupted `rm -rf ckpt_2` that took the manifest and left the folder: ckpt_2 is not committed,
    so neither a listing, nor retention's count, nor a restore's fallback may count it (before, the
    catalog's entry kept it listed: `ls` showed it, `load` refused it as never committed while listing it,
    and `prune --keep 2` would have left one loadable checkpoint)."""
    _run(tmp_path, 3)
    (tmp_path / "ckpt_2" / "manifest.json").unlink()
    assert "ckpt_2" in _catalog(tmp_path)
    st = open_storage(str(tmp_path))
    assert [i for i, _ in catalog.committed(st)] == ["ckpt_1", "ckpt_3"]
    assert [c.ckpt_id for c in recckpt.list_checkpoints(str(tmp_path)).checkpoints] == ["ckpt_1", "ckpt_3"]
    # the newest damaged too: the restore falls back to the one intact checkpoint
    shard = sorted((tmp_path / "ckpt_3" / "sparse").glob("*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    m, mgr = _manager(tmp_path)
    with pytest.warns(UserWarning, match="corrupt"):
        assert mgr.restore() == 1


def test_a_newest_entry_that_does_not_match_its_manifest_makes_a_rebuild(tmp_path, caplog):
    _run(tmp_path, 3)
    _resign(tmp_path / ".catalog.json",
            lambda o: o["checkpoints"]["ckpt_3"].update(manifest_sha256="0" * 64, metadata={}))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        found = catalog.committed(open_storage(str(tmp_path)))
    assert [e.step for _, e in found] == [1, 2, 3]
    assert any("does not match checkpoint" in r.getMessage() for r in caplog.records)


def test_gc_rebuilds_what_listings_trust(tmp_path):
    """An older entry is trusted by listings (they do not open every manifest); gc reads them all."""
    _run(tmp_path, 3)
    _resign(tmp_path / ".catalog.json",
            lambda o: o["checkpoints"]["ckpt_1"]["metadata"].update({"recckpt.global_step": "77"}))
    assert [c.step for c in recckpt.list_checkpoints(str(tmp_path)).checkpoints] == [77, 2, 3]
    recckpt.gc(str(tmp_path))
    assert [c.step for c in recckpt.list_checkpoints(str(tmp_path)).checkpoints] == [1, 2, 3]
    assert _catalog(tmp_path)["ckpt_1"]["step"] == 1


def test_compaction_is_listed_with_its_source(tmp_path, capsys):
    m = Model()
    opt = SparseAdam([m.emb], lr=0.1)
    s = Saver(m, opt, output_dir=str(tmp_path), max_keep=None, options=OPTS)
    m.emb(torch.arange(50))
    s.save("c0", incremental=True)
    m.emb(torch.arange(50, 60))
    s.save("c1", incremental=True)
    recckpt.compact(str(tmp_path / "c1"), str(tmp_path / "folded"))
    e = dict(catalog.committed(open_storage(str(tmp_path))))["folded"]
    assert e.compacted_from == "c1" and e.parent is None
    assert _catalog(tmp_path)["folded"]["compacted_from"]["ckpt_id"] == "c1"
    assert _catalog(tmp_path)["c1"]["parent"]["ckpt_id"] == "c0"
    from recckpt.cli import main as cli_main
    assert cli_main(["ls", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["compacted_from"] for c in doc["checkpoints"]] == [None, None, "c1"]


def test_a_catalog_of_another_version_is_not_read(tmp_path):
    _run(tmp_path, 2)
    _resign(tmp_path / ".catalog.json", lambda o: None, lambda h: h.update(catalog_version=2))
    assert catalog_file.read_catalog(open_storage(str(tmp_path))) is None


@pytest.mark.parametrize("bad", [
    lambda o: o.update(checkpoints=[]),
    lambda o: o["checkpoints"]["ckpt_1"].update(created_ns="soon"),
    lambda o: o["checkpoints"].update({"../x": o["checkpoints"]["ckpt_1"]}),
    lambda o: o["checkpoints"]["ckpt_1"].update(parent={"ckpt_id": "a/b", "manifest_sha256": "0" * 64}),
])
def test_entries_are_checked_field_by_field(tmp_path, bad):
    _run(tmp_path, 2)
    _resign(tmp_path / ".catalog.json", bad)
    assert catalog_file.read_catalog(open_storage(str(tmp_path))) is None
    assert [i for i, _ in catalog.committed(open_storage(str(tmp_path)))] == ["ckpt_1", "ckpt_2"]


def test_an_entry_that_keeps_the_hash_and_changes_the_step_is_not_trusted_for_the_newest(tmp_path):
    """A catalog edited by hand, every manifest hash kept, an older entry given a higher step: load()
    loaded that older checkpoint and restore() returned the forged step, since the checks compared only
    the hash (a helper's hostile-input attack). The entry picked as the newest is now compared field by
    field with its manifest, and the listing read from the manifests where it differs."""
    _run(tmp_path, 3)
    _resign(tmp_path / ".catalog.json", lambda o: o["checkpoints"]["ckpt_1"].update(
        metadata={**o["checkpoints"]["ckpt_1"]["metadata"], "recckpt.global_step": "1000"}, step=1000))
    assert Saver(Model(), output_dir=str(tmp_path)).latest_checkpoint() == "ckpt_3"
    m = Model()
    assert Saver(m, SparseAdam([m.emb], lr=0.1), output_dir=str(tmp_path)).load().ckpt_id == "ckpt_3"
    _, mgr = _manager(tmp_path)
    assert mgr.restore() == 3
    # the newest committed entry with its step changed is caught by the listing itself
    _resign(tmp_path / ".catalog.json", lambda o: o["checkpoints"]["ckpt_3"].update(
        metadata={**o["checkpoints"]["ckpt_3"]["metadata"], "recckpt.global_step": "99"}, step=99))
    assert [e.step for _, e in catalog.committed(open_storage(str(tmp_path)))] == [1, 2, 3]
