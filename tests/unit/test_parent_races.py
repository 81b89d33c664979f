"""An increment and its parent in an output directory another process also deletes from (a second job's
retention, `recckpt prune`, `recckpt.delete`). The parent was checked only when the save started: deleted
while the increment was written, the increment still committed and the save reported success, and the
newest checkpoint could not be loaded (restore fell back with a "corrupt" warning). Now the parent is
checked again just before the commit and just after it (a committed increment whose parent vanished is
withdrawn), and retention keeps a link that a checkpoint committed since its listing builds on."""
from __future__ import annotations

import pytest
import torch

import recckpt
from recckpt import CheckpointManager, HashTable, IncrementPolicy, SaveOptions, Saver, SparseAdam
from recckpt.errors import AsyncSaveError, CheckpointSaveError
from recckpt.format import catalog
from recckpt.storage import open_storage

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4)
        self.lin = torch.nn.Linear(4, 1)


def _job(out, async_save=False):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    mgr = CheckpointManager(Saver(model, opt, output_dir=out, options=OPTS, max_keep=None), save_interval=1,
                            keep=None, save_rng=False, async_save=async_save,
                            increments=IncrementPolicy(full_every=10, max_chain_fraction=None))
    return model, opt, mgr


def _train(model, opt, mgr, step):
    model.emb.train()
    model.lin(model.emb(torch.arange(step * 3, step * 3 + 20))).sum().backward()
    opt.step()
    opt.zero_grad()
    return mgr.step()


@pytest.mark.parametrize("when", ["while_written", "right_after_commit"])
@pytest.mark.parametrize("async_save", [False, True])
def test_an_increment_whose_parent_is_deleted_meanwhile_is_not_committed(tmp_path, monkeypatch, when, async_save):
    out = str(tmp_path / "out")
    model, opt, mgr = _job(out, async_save)
    for step in (1, 2):
        _train(model, opt, mgr, step)
    mgr.wait()
    assert mgr.saver.last_save.parent == "ckpt_1"
    if when == "while_written":
        import recckpt.train.saver as saver_mod
        real = saver_mod.write_worker_part

        def hooked(*a, **kw):   # another process deletes the parent while this save writes its files
            recckpt.delete(out, ["ckpt_2"])
            return real(*a, **kw)
        monkeypatch.setattr(saver_mod, "write_worker_part", hooked)
    else:
        real = catalog.commit

        def hooked(storage, target, ckpt_id, *a, **kw):   # ... just after the commit
            real(storage, target, ckpt_id, *a, **kw)
            if ckpt_id == "ckpt_3":
                catalog.delete(storage, "ckpt_2")
        monkeypatch.setattr(catalog, "commit", hooked)
    expect = "was not committed" if when == "while_written" else "was withdrawn right after its commit"
    with pytest.raises(AsyncSaveError if async_save else CheckpointSaveError,
                       match="its parent 'ckpt_2' was deleted while it was written") as e:
        _train(model, opt, mgr, 3)
        mgr.wait()
    assert expect in str(e.value)
    monkeypatch.undo()
    assert Saver(Model(), output_dir=out).checkpoints() == ["ckpt_1"]
    assert recckpt.verify(out + "/ckpt_1").ok
    _train(model, opt, mgr, 4)            # the next save is full, and commits
    mgr.wait()
    assert mgr.saver.last_save.parent is None and Saver(Model(), output_dir=out).checkpoints() == ["ckpt_1", "ckpt_4"]
    _, _, fresh = _job(out)
    assert fresh.restore() == 4


def test_retention_keeps_a_link_an_increment_committed_since_its_listing_builds_on(tmp_path):
    out = str(tmp_path / "out")
    model, opt, mgr = _job(out)
    _train(model, opt, mgr, 1)            # ckpt_1, full
    storage = open_storage(out)
    listed = catalog.committed(storage)   # what another process's retention listed ...
    _train(model, opt, mgr, 2)            # ... before this increment on ckpt_1 committed
    assert mgr.saver.last_save.parent == "ckpt_1"
    assert catalog.without_needed_links(listed, ["ckpt_1"]) == ["ckpt_1"]   # the old listing would delete it
    assert catalog.unneeded_now(storage, listed, ["ckpt_1"]) == []
    assert catalog.unneeded_now(storage, catalog.committed(storage), []) == []



def test_a_directory_that_cannot_be_locked_still_saves_increments_and_retires(tmp_path, monkeypatch, caplog):
    """Some network file systems emulate flock with record locks, which a directory opened read-only cannot
    take (EBADF). The links lock then holds nothing, as on an object store, with one warning: saves and
    retention must go on (the checks around the lock still apply)."""
    import errno
    import logging
    import os
    import stat

    import recckpt.storage.local as local
    real = local.fcntl.flock

    def nfs_like(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)
    monkeypatch.setattr(local.fcntl, "flock", nfs_like)
    monkeypatch.setattr(local, "_no_lock_warned", set())
    out = str(tmp_path / "out")
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    mgr = CheckpointManager(Saver(model, opt, output_dir=out, options=OPTS), save_interval=1, keep=1,
                            save_rng=False, increments=IncrementPolicy(full_every=2, max_chain_fraction=None))
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        for step in range(1, 6):
            _train(model, opt, mgr, step)
    warned = [r for r in caplog.records if "cannot be locked" in r.getMessage()]
    assert len(warned) == 1 and "Bad file descriptor" in warned[0].getMessage()
    assert mgr.saver.last_save.parent == "ckpt_4"
    assert Saver(Model(), output_dir=out).checkpoints() == ["ckpt_4", "ckpt_5"]   # ckpt_5 and its base


def _chain_and_a_full(out):
    """c1 <- c2 <- c3 (increments) and c4 (full) in `out`, nothing deleted."""
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=out, options=OPTS, max_keep=None)
    for k, cid in enumerate(["c1", "c2", "c3", "c4"]):
        model.emb.train()
        model.lin(model.emb(torch.arange(k * 3, k * 3 + 20))).sum().backward()
        opt.step()
        opt.zero_grad()
        saver.save(cid, incremental=cid in ("c2", "c3"))
    assert saver.checkpoints() == ["c1", "c2", "c3", "c4"]
    return model, opt, saver


@pytest.mark.parametrize("who", ["prune", "retention"])
def test_a_delete_that_fails_part_way_keeps_the_links_of_what_stayed(tmp_path, monkeypatch, who):
    """The store refuses to delete c2 (an increment on c1). Retention and prune went on down the chain and
    deleted c1, leaving c2 listed as committed and unloadable; prune also reported success (exit 0)."""
    from recckpt.errors import StorageError
    out = str(tmp_path / "out")
    model, opt, saver = _chain_and_a_full(out)
    real = catalog.delete

    def refuse_c2(storage, cid):
        if cid == "c2":
            raise PermissionError(13, "Access Denied", storage.describe(cid))
        return real(storage, cid)
    monkeypatch.setattr(catalog, "delete", refuse_c2)
    if who == "prune":
        with pytest.raises(StorageError, match=r"prune: deleted \['c3'\], but could not delete \['c1', 'c2'\]"):
            recckpt.prune(out, 1)
    else:
        saver.keep = recckpt.KeepPolicy(max_keep=1)
        with pytest.warns(UserWarning, match=r"could not delete \['c1', 'c2'\]"):
            saver.save("c5")
    monkeypatch.undo()
    left = Saver(Model(), output_dir=out).checkpoints()
    assert left == (["c1", "c2", "c4"] if who == "prune" else ["c1", "c2", "c5"]), left
    for cid in left:
        assert recckpt.verify(f"{out}/{cid}").ok, cid
