"""Restore never goes backwards silently (issue 30 item 2): the newest restore point is the one of the
highest global step, not the one committed last; a compaction records its step and its source; after
`recckpt compact` of an older link into the training directory (which warns) a restarted manager resumes
from the newest step, `Saver.load()` loads it, and the following saves succeed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from helpers.tables import table_contents
from recckpt import CheckpointManager, HashTable, IncrementPolicy, SaveOptions, Saver, SparseAdam
from recckpt.format import catalog
from recckpt.format.retention import META_COMPACTED_FROM, META_STEP, restore_order
from recckpt.storage import open_storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.emb = HashTable("emb", dim)
        self.lin = torch.nn.Linear(dim, 1)


def train_step(model, opt, ids):
    model.emb.train()
    model.lin(model.emb(ids)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.lin.zero_grad()


def _managed(out):
    model = Model()
    opt = SparseAdam([model.emb], lr=0.05)
    saver = Saver(model, opt, output_dir=out, options=OPTS, max_keep=None)
    mgr = CheckpointManager(saver, save_interval=1, keep=None, save_rng=False,
                            increments=IncrementPolicy(full_every=10, max_chain_fraction=None))
    return model, opt, saver, mgr


def test_restore_order_rule():
    assert restore_order([("a", 1), ("b", 2)]) == ["b", "a"]
    assert restore_order([("c4", 4), ("c2_full", 2)]) == ["c4", "c2_full"]          # compacted older link
    assert restore_order([("c4", 4), ("c4_full", 4)]) == ["c4_full", "c4"]          # tie: committed last
    assert restore_order([("c4", 4), ("final", None)]) == ["final", "c4"]           # no step: newest so far
    assert restore_order([("c4", 4), ("final", None), ("c5", 5)]) == ["c5", "final", "c4"]
    assert restore_order([("c4", 4), ("final", None), ("c2_full", 2)]) == ["final", "c4", "c2_full"]
    assert restore_order([("x", None), ("y", None)]) == ["y", "x"]
    assert restore_order([]) == []


def test_restore_after_compacting_an_older_link_into_the_training_directory(tmp_path):
    out = tmp_path / "out"
    model, opt, saver, mgr = _managed(str(out))
    for step in range(4):
        train_step(model, opt, torch.arange(step * 5, step * 5 + 30))
        mgr.step()
    assert [saver.last_save.parent] == ["ckpt_3"] and saver.checkpoints() == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"]
    at_4 = table_contents(model.emb)

    # the user compacts an older link into the live directory, as the docs allow: it warns
    p = subprocess.run([sys.executable, "-m", "recckpt", "compact", str(out / "ckpt_2"), str(out / "ckpt_2_full")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    assert "ckpt_2_full" in p.stderr and "'ckpt_4' (step 4)" in p.stderr and "restore()" in p.stderr, p.stderr
    m = catalog.read_manifest(open_storage(str(out)), "ckpt_2_full")
    assert m.metadata[META_STEP] == "2" and m.metadata[META_COMPACTED_FROM] == "ckpt_2" and m.parent is None
    assert "compacted_from" not in m.metadata
    assert Saver(Model(), output_dir=str(out)).checkpoints()[-1] == "ckpt_2_full"   # listed last

    # a restarted run resumes from step 4, not 2 ...
    m2, opt2, saver2, mgr2 = _managed(str(out))
    assert mgr2.restore() == 4 and mgr2.restored_from == "ckpt_4"
    assert table_contents(m2.emb).keys() == at_4.keys()
    for k in at_4:
        assert set(table_contents(m2.emb)[k]) == set(at_4[k])
    # ... a plain Saver.load() too ...
    m3 = Model()
    s3 = Saver(m3, SparseAdam([m3.emb], lr=0.05), output_dir=str(out), options=OPTS)
    assert s3.latest_checkpoint() == "ckpt_4" and s3.load().ckpt_id == "ckpt_4"
    # ... and the next saves succeed, on the chain of step 4
    for step in range(2):
        train_step(m2, opt2, torch.arange(100 + step, 130 + step))
        mgr2.step()
    assert saver2.checkpoints()[-2:] == ["ckpt_5", "ckpt_6"] and saver2.last_save.parent == "ckpt_5"
    m4, _, _, mgr4 = _managed(str(out))
    assert mgr4.restore() == 6


def test_compacting_the_newest_link_elsewhere_does_not_warn_about_steps(tmp_path, caplog):
    import logging

    import recckpt
    out = tmp_path / "out"
    model, opt, saver, mgr = _managed(str(out))
    for step in range(2):
        train_step(model, opt, torch.arange(step * 5, step * 5 + 30))
        mgr.step()
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        recckpt.compact(str(out / "ckpt_2"), str(tmp_path / "bank" / "c2"))
    assert not [r for r in caplog.records if "output directory of its source" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        recckpt.compact(str(out / "ckpt_2"), str(out / "ckpt_2_full"))
    msgs = [r.getMessage() for r in caplog.records if "output directory of its source" in r.getMessage()]
    assert msgs and "older than" not in msgs[0]       # the newest link: nothing rewinds
    # a tie of steps: the compacted copy, committed last, is the restore point; the run goes on from it
    m2, _, saver2, mgr2 = _managed(str(out))
    assert mgr2.restore() == 2 and mgr2.restored_from == "ckpt_2_full"
    mgr2.step()
    assert saver2.checkpoints()[-1] == "ckpt_3"


def _chain_then_compaction(out, steps: int) -> None:
    """A managed chain of `steps` checkpoints in `out`, then its ckpt_2 compacted into ckpt_2_full beside it."""
    import recckpt
    model, opt, saver, mgr = _managed(str(out))
    for step in range(steps):
        train_step(model, opt, torch.arange(step * 5, step * 5 + 30))
        mgr.step()
    recckpt.compact(str(out / "ckpt_2"), str(out / "ckpt_2_full"))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recckpt", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def test_ls_json_shows_the_compacted_step(tmp_path):
    out = tmp_path / "out"
    _chain_then_compaction(out, 3)
    p = _cli("ls", out, "--json")
    doc = json.loads(p.stdout)
    steps = {c["ckpt_id"]: c["step"] for c in doc["checkpoints"]}
    assert steps == {"ckpt_1": 1, "ckpt_2": 2, "ckpt_3": 3, "ckpt_2_full": 2}


def test_retention_after_compacting_an_older_link_keeps_the_restore_point(tmp_path):
    """`recckpt prune --keep 1` (and a job's own retention) counted "newest" in committed order: after a
    compaction of an older link, listed last, it kept the compaction alone and deleted the checkpoint of
    the highest step, so the next restart rewound from step 4 to step 2. Now retention's newest is
    restore()'s, and the one committed last is kept beside it."""
    from recckpt.format.retention import CkptEntry, KeepPolicy

    entries = [CkptEntry(f"ckpt_{s}", s, False) for s in (1, 2, 3, 4)] + [CkptEntry("ckpt_2_full", 2, False)]
    assert KeepPolicy(max_keep=1).doomed(entries) == ["ckpt_1", "ckpt_2", "ckpt_3"]
    assert KeepPolicy(max_keep=2).doomed(entries) == ["ckpt_1", "ckpt_2"]

    out = tmp_path / "out"
    _chain_then_compaction(out, 4)
    p = _cli("prune", out, "--keep", "1")
    assert p.returncode == 0, p.stderr
    # ckpt_4 is an increment: its chain (ckpt_1 .. ckpt_3) stays with it
    assert Saver(Model(), output_dir=str(out)).checkpoints() == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4", "ckpt_2_full"]
    _, _, _, mgr2 = _managed(str(out))
    assert mgr2.restore() == 4 and mgr2.restored_from == "ckpt_4"


def test_restore_checks_the_catalog_entry_of_the_step_it_picks(tmp_path):
    """The catalog is checked against the manifest of the checkpoint committed last; restore picks the
    highest step, here an older commit. With that checkpoint replaced by hand (another run's, of a lower
    step), restore loaded the replacement and returned the step the stale catalog recorded (9). Now it
    reads the manifests instead and restores the true highest step."""
    import shutil

    import pytest

    from recckpt.errors import CheckpointNotFoundError

    def save(out, cid, step):
        m = Model()
        m.emb(torch.arange(5))
        with torch.no_grad():
            m.lin.bias.fill_(float(step))
        Saver(m, output_dir=str(out), options=OPTS, max_keep=None).save(cid, step=step)

    run = tmp_path / "run"
    LENIENT = {"strict": False}   # saved by a bare Saver: no IO state of the manager's worker
    for cid, step in (("c0", 0), ("c1", 1), ("c2", 9), ("c3", 3)):
        save(run, cid, step)
    save(tmp_path / "other", "c2", 2)
    shutil.rmtree(run / "c2")
    shutil.copytree(tmp_path / "other" / "c2", run / "c2")
    m = Model()
    mgr = CheckpointManager(Saver(m, output_dir=str(run), options=OPTS), save_interval=100)
    assert mgr.restore(load_conf=LENIENT) == 3 and mgr.global_step == 3
    assert float(m.lin.bias) == 3.0
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint of global step 9"):
        CheckpointManager(Saver(Model(), output_dir=str(run), options=OPTS), save_interval=100).restore(global_step=9, load_conf=LENIENT)
    assert CheckpointManager(Saver(Model(), output_dir=str(run), options=OPTS), save_interval=100).restore(
        global_step=2, load_conf=LENIENT) == 2
