"""Errors: every public error class lives in recckpt/errors.py, carries structured fields, and
docs/SAFETY.md's table lists exactly the classes of the module."""
import importlib
import inspect
import os
import pickle
import pkgutil
import re

import recckpt
from recckpt import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error_classes():
    return {name: obj for name, obj in vars(errors).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}


def _safety_table_names():
    text = open(os.path.join(ROOT, "docs", "SAFETY.md"), encoding="utf-8").read()
    section = text.split("## Errors (`recckpt.errors`)", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `(\w+)`", row).group(1) for row in rows]


def test_safety_table_lists_exactly_the_error_classes():
    documented = _safety_table_names()
    assert len(documented) == len(set(documented)), f"listed twice: {documented}"
    defined = set(_error_classes())
    assert set(documented) - defined == set(), "docs/SAFETY.md lists classes recckpt.errors lacks"
    assert defined - set(documented) == set(), "recckpt.errors has classes docs/SAFETY.md does not list"


def test_every_recckpt_error_is_defined_in_errors_module():
    for mod in pkgutil.walk_packages(recckpt.__path__, "recckpt."):
        if not mod.name.endswith(".__main__"):   # running it would start the command-line tool
            importlib.import_module(mod.name)
    seen, todo = set(), [errors.RecckptError]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in seen if c.__module__ != errors.__name__
                     and c.__module__.startswith("recckpt"))
    assert outside == []


def test_old_import_paths_still_work():
    from recckpt.load.row_filter import DuplicateIdsError
    from recckpt.train.async_save import AsyncCommitOutcomeUnknownError, AsyncSaveError
    assert DuplicateIdsError is errors.DuplicateIdsError
    assert AsyncSaveError is errors.AsyncSaveError is recckpt.AsyncSaveError
    assert AsyncCommitOutcomeUnknownError is errors.AsyncCommitOutcomeUnknownError


def test_structured_fields_default_to_none_and_survive_pickling():
    for name, cls in _error_classes().items():
        e = cls("boom")
        assert (str(e), e.path, e.table, e.rank) == ("boom", None, None, None), name
        e = cls("boom", path="/x/f.bin", table="t", rank=3)
        assert e.fields() == {"path": "/x/f.bin", "table": "t", "rank": 3}, name
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and str(back) == "boom" and back.fields() == e.fields(), name


def test_corrupt_checkpoint_error_takes_path_positionally():
    e = errors.CorruptCheckpointError("bad", "/c/manifest.json")
    assert e.path == "/c/manifest.json" and e.table is None


def test_builtin_bases_still_catch():
    assert isinstance(errors.CheckpointNotFoundError("x", path="/p"), FileNotFoundError)
    assert isinstance(errors.DuplicateIdsError("x", table="t"), ValueError)
    assert isinstance(errors.AsyncCommitOutcomeUnknownError("x"), errors.CommitOutcomeUnknownError)


def test_checkpoint_not_found_names_its_path(tmp_path):
    """Each way a load, restore or listing can find no checkpoint sets `path` to where it looked."""
    import pytest
    import torch

    from recckpt import CheckpointManager, Saver
    from recckpt.tools import outdir

    model = torch.nn.Linear(2, 2)
    saver = Saver(model, output_dir=str(tmp_path / "run"))
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        saver.load()                                      # no directory yet
    assert e.value.path and e.value.path.endswith("run")
    saver.save("a")
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        saver.load(ckpt_id="b")                           # an id never committed
    assert e.value.path and e.value.path.endswith("b")
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        saver.load(ckpt_path=str(tmp_path / "run"), direct_path=True)   # not a checkpoint directory
    assert e.value.path and e.value.path.endswith("run")
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        outdir.list_checkpoints(str(tmp_path / "nowhere"))
    assert e.value.path and e.value.path.endswith("nowhere")
    mgr = CheckpointManager(Saver(model, output_dir=str(tmp_path / "m")))
    mgr.step()
    mgr.save()
    mgr.wait()
    with pytest.raises(errors.CheckpointNotFoundError) as e:
        mgr.restore(global_step=99)
    assert e.value.path and e.value.path.endswith("m")
    mgr.close()


def test_a_corrupt_shard_names_the_same_file_in_its_message_and_its_path_field(tmp_path):
    """e.path is the file as the message names it (absolute, or the URL), so that code acting on it (moving
    the file aside) does not depend on its working directory. A CRC mismatch in a shard gave a path relative
    to the output directory."""
    import glob

    import pytest
    import torch

    from recckpt import HashTable, Saver
    m = torch.nn.Module()
    m.t = HashTable("t", dim=8)
    m.t(torch.arange(5000))
    Saver(m, output_dir=str(tmp_path)).save("c")
    shard = sorted(p for p in glob.glob(str(tmp_path / "c" / "sparse" / "*")) if not p.endswith(".json"))[0]
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    m2 = torch.nn.Module()
    m2.t = HashTable("t", dim=8)
    with pytest.raises(errors.CorruptCheckpointError) as ei:
        Saver(m2, output_dir=str(tmp_path)).load(ckpt_id="c")
    assert ei.value.path == shard and str(ei.value).startswith(shard), (ei.value.path, str(ei.value))
    assert ei.value.table == "t"
