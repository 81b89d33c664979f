"""Where a user points recckpt, as fsspec and shell users spell it (a helper's attack as an fsspec user):
URLs an object store would take apart wrongly are refused before anything is written, "file://~" means the
home directory, an output_dir that is a file is an error and not an empty run, and the tools say what
failed on a directory they cannot write."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import recckpt
from recckpt.errors import StorageError, StorageURLError
from recckpt.storage import open_storage

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("url,says", [
    ("s3://", "names no bucket"), ("s3:///run", "names no bucket"), ("gs://", "names no bucket"),
    ("s3://bucket//run", "empty path segment"), ("s3://bucket/a//b/", "empty path segment"),
    ("simplecache::s3://bucket//run", "empty path segment"), ("s3://bucket//run?versionId=1", "empty path segment"),
])
def test_object_store_urls_that_name_no_bucket_or_hold_an_empty_segment_are_refused(url, says):
    # "s3://b//run" saved its files under keys s3fs's listings do not return: every save failed, blaming
    # another process, and told the user to save again
    with pytest.raises(StorageURLError, match=says):
        open_storage(url)


@pytest.mark.parametrize("url", ["memory://x//y", "memory://a?b=http://c", "zip://c::file:///tmp/x/arch.zip",
                                 "memory://a//b/c", "s3://bucket", "memory://"])
def test_urls_of_other_filesystems_keep_their_own_rules(url):
    # the first version of the check refused these ("//" anywhere after the scheme)
    try:
        open_storage(url, {"anon": True, "endpoint_url": "http://127.0.0.1:9"} if url.startswith("s3") else None)
    except StorageURLError as e:
        raise AssertionError(f"{url} refused: {e}") from e
    except Exception:   # noqa: BLE001 - the filesystem's own answer (no zip file there) is not ours
        pass


def test_a_filesystem_object_is_refused_saying_to_pass_its_url():
    import fsspec
    with pytest.raises(StorageURLError, match="pass the filesystem's URL.*storage_options"):
        recckpt.Saver(torch.nn.Linear(1, 1), output_dir=fsspec.filesystem("memory"))


def test_file_url_with_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 1)
    recckpt.Saver(model, output_dir="file://~/ckpts").save("c")
    assert (tmp_path / "home" / "ckpts" / "c" / "manifest.json").exists() and not (tmp_path / "~").exists()
    assert recckpt.Saver(torch.nn.Linear(2, 1), output_dir="~/ckpts").load().ckpt_id == "c"


@pytest.mark.parametrize("kind,said", [("file", "it is a file, not a directory"),
                                       ("dangling link", "a link to .*gone.*which does not exist"),
                                       ("link to a file", "a link to .*afile.*which is not a directory"),
                                       ("below a file", "afile, on its path.*afile is a file")])
def test_an_output_dir_that_cannot_be_a_directory_is_an_error_everywhere(tmp_path, kind, said):
    """restore() returned None (a first start, training over beside it), load() said the directory did not
    exist, and save() failed with 'File exists'."""
    (tmp_path / "afile").write_text("not a directory\n")
    out = tmp_path / "run"
    if kind == "file":
        out.write_text("not a directory\n")
    elif kind == "dangling link":
        os.symlink(tmp_path / "gone", out)
    elif kind == "link to a file":
        os.symlink(tmp_path / "afile", out)
    else:
        out = tmp_path / "afile" / "run"
    mgr = recckpt.CheckpointManager(recckpt.Saver(torch.nn.Linear(1, 1), output_dir=out), save_interval=1)
    for call in (mgr.restore, lambda: mgr.saver.load(), lambda: mgr.saver.save("c")):
        with pytest.raises(StorageError, match=said):
            call()
    assert (tmp_path / "afile").read_text() == "not a directory\n"


@pytest.mark.skipif(os.geteuid() == 0 and not os.path.exists("/usr/bin/setpriv"),
                    reason="as root, a read-only directory needs setpriv (util-linux) to drop the permission override")
def test_tools_on_a_directory_they_cannot_write_raise_recckpt_errors_naming_it(tmp_path):
    """prune, compact and export raised a bare PermissionError (the version file's temporary name, no hint);
    the tools keep their signatures (a first wrapper broke prune(output_dir=...))."""
    out = tmp_path / "ro"
    mgr = recckpt.CheckpointManager(recckpt.Saver(torch.nn.Linear(2, 1), output_dir=out), save_interval=1, keep=None)
    mgr.step()
    mgr.step()
    mgr.close()
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(out, 0o555)
    os.chmod(locked, 0o555)
    try:
        drop = (["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        run = subprocess.run([*drop, sys.executable, os.path.join(HERE, "..", "helpers", "readonly_tools.py"), str(out),
                              str(locked / "export")],
                             capture_output=True, text=True, timeout=120, env=env)
    finally:
        os.chmod(out, 0o755)
        os.chmod(locked, 0o755)
    lines = {ln.split(" ", 1)[0]: ln for ln in run.stdout.splitlines()}
    assert run.returncode == 0 and set(lines) == {"prune", "delete", "compact", "export"}, run.stdout + run.stderr
    for tool, line in lines.items():
        assert "recckpt.errors.StorageError" in line or "recckpt.errors.CheckpointSaveError" in line, line
        assert "not writable" in line, line
    assert "prune failed at " + str(out) in lines["prune"] and "export failed at " + str(locked) in lines["export"]
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["checkpoint", "ckpt_1", "ckpt_2"]
