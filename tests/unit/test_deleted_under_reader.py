"""A checkpoint deleted under a reader (another process's retention, `recckpt prune`, `recckpt.delete`):
`recckpt.open`'s view and `recckpt.verify` said CorruptCheckpointError ("file is missing", "open error")
or raised a bare FileNotFoundError, where `Saver.load` already said CheckpointDeletedError. A checkpoint
that is deleted is not corrupt, and the caller's remedy differs: read the newest checkpoint again."""
from __future__ import annotations

import pytest

import recckpt

from .test_parent_races import _job, _train


def _saved(tmp_path, n=2):
    out = str(tmp_path / "out")
    model, opt, mgr = _job(out)
    for step in range(1, n + 1):
        _train(model, opt, mgr, step)
    return out


@pytest.mark.parametrize("what", ["tables", "iter_rows", "dense_tensors", "objects", "open_chain"])
def test_a_view_of_a_checkpoint_deleted_under_it_says_deleted_not_corrupt(tmp_path, what):
    """recckpt.open's view of a checkpoint that another process's retention deletes: reading it raised
    CorruptCheckpointError ("file is missing", "open error") or a bare FileNotFoundError; Saver.load
    already said CheckpointDeletedError."""
    from recckpt.errors import CheckpointDeletedError
    out = _saved(tmp_path)
    if what == "open_chain":   # ckpt_2's base goes while ckpt_2 is opened (after its own manifest is read)
        import recckpt.tools.reader as reader_mod
        real = reader_mod.chain_of

        def hooked(reader):
            recckpt.delete(out, ["ckpt_2", "ckpt_1"])
            return real(reader)
        reader_mod.chain_of, restore = hooked, real
        try:
            with pytest.raises(CheckpointDeletedError, match="ckpt_2 was deleted while it was being opened"):
                recckpt.open(out + "/ckpt_2")
        finally:
            reader_mod.chain_of = restore
        return
    view = recckpt.open(out + "/ckpt_2")
    recckpt.delete(out, ["ckpt_2", "ckpt_1"])
    with pytest.raises(CheckpointDeletedError, match="was deleted while it was being read") as e:
        if what == "tables":
            view.tables
        elif what == "iter_rows":
            list(view.iter_rows("emb"))
        elif what == "dense_tensors":
            view.dense_tensors()
        else:
            view.objects()
    assert "Open the newest checkpoint again" in str(e.value)


def test_verify_of_a_checkpoint_deleted_under_it_says_deleted_not_corrupt(tmp_path, monkeypatch):
    from recckpt.errors import CheckpointDeletedError
    from recckpt.format import verifier
    out = _saved(tmp_path, 1)
    real = verifier._Checker.run

    def deleted_first(self):
        recckpt.delete(out, ["ckpt_1"])
        return real(self)
    monkeypatch.setattr(verifier._Checker, "run", deleted_first)
    with pytest.raises(CheckpointDeletedError, match="ckpt_1 was deleted while it was being verified"):
        recckpt.verify(out + "/ckpt_1")
    monkeypatch.undo()
    # a checkpoint that is still there and damaged is reported as such
    out2 = _saved(tmp_path / "b", 1)
    import glob
    import os
    os.remove(glob.glob(out2 + "/ckpt_1/sparse/*.bin")[0])
    report = recckpt.verify(out2 + "/ckpt_1")
    assert not report.ok and "missing" in report.problems[0]


def test_a_load_cut_off_from_its_store_says_what_it_applied(tmp_path, monkeypatch):
    """Whether a failed load's checkpoint was deleted is asked of the store: when the store no longer answers
    (an endpoint gone mid-load, a helper's attack on S3) that check's StorageError replaced the load's own
    error, which says which table it stopped in and what was applied before."""
    import glob
    import inspect
    import os

    from recckpt.errors import CorruptCheckpointError, StorageError
    from recckpt.storage.local import LocalStorage
    out = _saved(tmp_path, 1)
    for path in glob.glob(out + "/ckpt_1/sparse/*.bin"):   # a read that fails once rows are being applied
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    model, opt, mgr = _job(str(tmp_path / "other"))
    real_exists = LocalStorage.exists

    def gone(self, path):   # (resolving the path asks too: from the load's failure on, the store is gone)
        if path.endswith("manifest.json") and inspect.stack()[1].function == "_load_checkpoint":
            raise StorageError(5, "the store does not answer")
        return real_exists(self, path)
    monkeypatch.setattr(LocalStorage, "exists", gone)
    with pytest.raises(CorruptCheckpointError, match="Loading stopped in table"):
        mgr.saver.load(ckpt_path=out + "/ckpt_1", direct_path=True)
