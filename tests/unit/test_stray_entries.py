"""One bad entry does not stop a directory (issue 30 item 4): entries named like recckpt's leftovers but
of another kind (a file or a link where recckpt leaves a directory, a directory where it leaves a file)
are left alone and reported, links are never followed, and a save and `recckpt gc` succeed next to
them. A version file that is a directory is an error naming it and saying what to do, never a failed
save."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from helpers.shared_dir_child import Model
from recckpt import SaveOptions, Saver
from recckpt.errors import StorageError
from recckpt.format import catalog, names
from recckpt.storage import LocalStorage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def _save(out, ckpt_id, k=1.0):
    m = Model()
    m.t.set_rows(torch.arange(10), {"embedding": torch.full((10, 8), k)})
    Saver(m, output_dir=str(out), max_keep=None, options=SaveOptions(fsync=False)).save(ckpt_id)


def _elsewhere(tmp_path):
    """A directory outside the output directory with a file that must survive."""
    d = tmp_path / "elsewhere"
    d.mkdir(exist_ok=True)
    (d / "precious").write_text("keep me")
    return d


def _make(kind, out, tmp_path):
    """Create the bad entry; returns its name."""
    e = _elsewhere(tmp_path)
    if kind == "trash_file":
        (out / ".deleting-x").write_text("not a directory")
        return ".deleting-x"
    if kind == "trash_link_to_dir":
        os.symlink(e, out / ".deleting-x")
        return ".deleting-x"
    if kind == "staging_link_to_dir":
        os.symlink(e, out / ".staging-c9-abcd")
        return ".staging-c9-abcd"
    if kind == "staging_file":
        (out / ".staging-c9-abcd").write_text("x")
        return ".staging-c9-abcd"
    if kind == "version_tmp_dir":
        (out / ".checkpoint.tmp-1234").mkdir()
        (out / ".checkpoint.tmp-1234" / "inner").write_text("x")
        return ".checkpoint.tmp-1234"
    if kind == "version_tmp_link":
        os.symlink(e / "precious", out / ".checkpoint.tmp-1234")
        return ".checkpoint.tmp-1234"
    if kind == "owner_dir":
        (out / ".owner-staging-c9-abcd.w00000").mkdir()
        return ".owner-staging-c9-abcd.w00000"
    raise ValueError(kind)


KINDS = ["trash_file", "trash_link_to_dir", "staging_link_to_dir", "staging_file", "version_tmp_dir",
         "version_tmp_link", "owner_dir"]


def _snapshot(path):
    return os.lstat(path).st_mode, (sorted(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path)
                                    else None)


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_and_gc_go_on_next_to_a_stray_entry(tmp_path, kind, caplog):
    out = tmp_path / "out"
    _save(out, "c1")
    name = _make(kind, out, tmp_path)
    before = _snapshot(out / name)
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        _save(out, "c2", 2.0)          # a fresh Saver: its start-up recovery meets the entry
    assert any(name in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert Saver(Model(), output_dir=str(out)).checkpoints() == ["c1", "c2"]
    assert _snapshot(out / name) == before
    assert (tmp_path / "elsewhere" / "precious").read_text() == "keep me"
    p = subprocess.run([sys.executable, "-m", "recckpt", "gc", str(out)], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert name in p.stderr and len([ln for ln in p.stderr.splitlines() if name in ln]) == 1, p.stderr
    assert _snapshot(out / name) == before
    assert (tmp_path / "elsewhere" / "precious").read_text() == "keep me"
    ls = subprocess.run([sys.executable, "-m", "recckpt", "ls", str(out)], env=ENV, capture_output=True, text=True)
    assert ls.returncode == 0 and f"stray: {name}" in ls.stdout, ls.stdout + ls.stderr


def test_a_version_file_that_is_a_directory(tmp_path, caplog):
    out = tmp_path / "out"
    _save(out, "c1")
    os.remove(out / names.VERSION_FILE)
    (out / names.VERSION_FILE).mkdir()
    (out / names.VERSION_FILE / "inner").write_text("x")
    st = LocalStorage(str(out))
    with pytest.raises(StorageError) as ei:
        catalog.write_version_file(st, ["c1"])
    msg = str(ei.value)
    assert str(out / names.VERSION_FILE) in msg and "move it away" in msg and ei.value.path == str(out / "checkpoint")
    with caplog.at_level(logging.WARNING, logger="recckpt"):
        _save(out, "c2", 2.0)   # committed: the version file is advisory; the warning names it
    assert any(str(out / names.VERSION_FILE) in r.getMessage() for r in caplog.records)
    assert Saver(Model(), output_dir=str(out)).checkpoints() == ["c1", "c2"]
    assert (out / names.VERSION_FILE / "inner").read_text() == "x"
    p = subprocess.run([sys.executable, "-m", "recckpt", "gc", str(out)], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0 and "move it away" in p.stderr, p.stderr
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] and "Traceback" not in p.stderr
    assert not [n for n in os.listdir(out) if n.startswith(names.VERSION_TMP_PREFIX)]


def test_a_version_file_that_is_a_link_is_replaced_not_written_through(tmp_path):
    out = tmp_path / "out"
    _save(out, "c1")
    e = _elsewhere(tmp_path)
    os.remove(out / names.VERSION_FILE)
    os.symlink(e / "precious", out / names.VERSION_FILE)
    _save(out, "c2", 2.0)
    assert (e / "precious").read_text() == "keep me"
    assert not os.path.islink(out / names.VERSION_FILE)
    assert (out / names.VERSION_FILE).read_text() == "c1\nc2\n"


def test_gc_removes_real_leftovers_next_to_strays(tmp_path):
    out = tmp_path / "out"
    _save(out, "c1")
    _make("trash_file", out, tmp_path)
    (out / ".deleting-c0-1234" / "sparse").mkdir(parents=True)   # a real interrupted delete
    p = subprocess.run([sys.executable, "-m", "recckpt", "gc", str(out)], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "removed .deleting-c0-1234" in p.stdout
    assert not (out / ".deleting-c0-1234").exists() and (out / ".deleting-x").is_file()
