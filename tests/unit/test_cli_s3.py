"""The command line on an object store (a moto S3 server on 127.0.0.1): the endpoint and credentials
come from --storage-options, or from fsspec's own configuration (FSSPEC_S3), as an s3fs user expects;
every verb takes them, and a malformed value is a usage error naming the option."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from recckpt import HashTable, SaveOptions, Saver
from recckpt.cli import main as cli_main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _saved(s3_server, bucket: str) -> str:
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    m.t(torch.arange(50))
    s = Saver(m, output_dir=f"s3://{bucket}/run", options=SaveOptions(fsync=False), max_keep=None,
              storage_options=s3_server.options())
    s.save("a")
    s.save("b", incremental=True)
    return f"s3://{bucket}/run"


def test_every_verb_reaches_the_store_with_storage_options(s3_server, s3_bucket, capsys, tmp_path):
    run = _saved(s3_server, s3_bucket)
    so = ["--storage-options", json.dumps(s3_server.options())]
    assert cli_main(["ls", run, "--json", *so]) == 0
    assert [c["ckpt_id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == ["a", "b"]
    assert cli_main(["inspect", f"{run}/b", *so]) == 0 and "incremental" in capsys.readouterr().out
    assert cli_main(["verify", f"{run}/a", f"{run}/b", *so]) == 0
    capsys.readouterr()
    assert cli_main(["diff", f"{run}/a", f"{run}/a", *so]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no differences"
    assert cli_main(["compact", f"{run}/b", f"{run}/c", *so]) == 0
    assert cli_main(["export", f"{run}/c", "--out", str(tmp_path / "x"), "--format", "npy", *so]) == 0
    assert cli_main(["prune", run, "--keep", "1", *so]) == 0
    assert cli_main(["gc", run, *so]) == 0
    capsys.readouterr()
    assert cli_main(["ls", run, "--json", *so]) == 0
    assert [c["ckpt_id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == ["c"]


@pytest.mark.parametrize("bad", ["{", "[1, 2]"])
def test_a_malformed_storage_options_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["ls", "s3://nowhere/run", "--storage-options", bad])
    assert e.value.code == 2 and "--storage-options" in capsys.readouterr().err


def test_fsspec_configuration_from_the_environment(s3_server, s3_bucket):
    """No --storage-options: FSSPEC_S3 (fsspec's documented variable) supplies endpoint and credentials, and
    a configured config_kwargs is kept beside recckpt's request bounds, not replaced by them."""
    run = _saved(s3_server, s3_bucket)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env["FSSPEC_S3"] = json.dumps({**s3_server.options(), "config_kwargs": {"read_timeout": 7}})
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "recckpt", "ls", run, "--json"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [c["ckpt_id"] for c in json.loads(p.stdout)["checkpoints"]] == ["a", "b"]
    probe = ("from recckpt.storage import open_storage; import json, sys; "
             f"fs = open_storage({run!r}).fs; print(json.dumps(fs.config_kwargs if hasattr(fs, 'config_kwargs') "
             "else fs.kwargs.get('config_kwargs')))")
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["read_timeout"] == 7 and got["connect_timeout"] == 10, got   # configured, and recckpt's bound


def test_fsspec_configuration_under_s3a_is_kept_too(monkeypatch):
    """s3fs answers to s3 and s3a, and fsspec applies the configuration of both; recckpt's defaults
    replaced an s3a-configured config_kwargs whole."""
    from fsspec.config import conf

    from recckpt.storage.fsspec_store import _merged_options
    monkeypatch.setitem(conf, "s3a", {"config_kwargs": {"read_timeout": 300, "s3": {"addressing_style": "path"}}})
    got = _merged_options("s3", {})["config_kwargs"]
    assert got["read_timeout"] == 300 and got["s3"] == {"addressing_style": "path"}, got
    assert got["connect_timeout"] == 10   # recckpt's bound fills in what the configuration leaves out
    got = _merged_options("s3", {"config_kwargs": {"read_timeout": 5}})["config_kwargs"]
    assert got["read_timeout"] == 5   # explicit storage_options win


def test_ls_check_finds_a_manifest_deleted_by_hand_on_an_object_store(s3_server, s3_bucket, capsys):
    """On an object store `ls` trusts the catalog for all but the newest checkpoint (a request a checkpoint
    saved); a manifest deleted by hand from an older one went unseen, while docs/CLI.md promised `unfound`.
    `--check` reads every manifest: the checkpoint is a leftover and its increment broken."""
    run = _saved(s3_server, s3_bucket)      # a, then b (an increment on a)
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    Saver(m, output_dir=run, options=SaveOptions(fsync=False), max_keep=None,
          storage_options=s3_server.options()).save("c")
    s3_server.fs().rm(f"{run}/a/manifest.json")
    so = ["--storage-options", json.dumps(s3_server.options())]
    assert cli_main(["ls", run, "--json", "--check", *so]) == 1   # a health check: b cannot be loaded
    got = json.loads(capsys.readouterr().out)
    assert [c["ckpt_id"] for c in got["checkpoints"]] == ["b", "c"], got
    # (an object store cannot tell a prefix without its manifest from an interrupted save)
    assert [x[0] for x in got["leftovers"]] == ["a"] and [b[0] for b in got["broken"]] == ["b"], got
    assert cli_main(["ls", run, "--json", *so]) == 0   # without --check: the catalog's word (documented)
    assert [c["ckpt_id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == ["a", "b", "c"]


def test_storage_timeout_bounds_a_command_on_a_frozen_endpoint(s3_server, s3_bucket, capsys):
    """The tools' stores had a fixed 300 s bound per operation, which storage_options cannot lower (s3fs
    retries inside it): `ls` on a frozen endpoint ran for minutes. --storage-timeout sets the bound."""
    import time

    from helpers.s3_server import LoopbackProxy, storage_options
    run = _saved(s3_server, s3_bucket)
    proxy = LoopbackProxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    try:
        so = ["--storage-options", json.dumps(storage_options(proxy.endpoint))]
        assert cli_main(["ls", run, "--storage-timeout", "2", *so]) == 0   # a live endpoint: unchanged
        capsys.readouterr()
        proxy.pause()
        t0 = time.monotonic()
        code = cli_main(["ls", run, "--storage-timeout", "2", *so])
        took = time.monotonic() - t0
        assert code == 1 and "within 2 s" in capsys.readouterr().err
        assert took < 15, took
    finally:
        proxy.resume()
        proxy.stop()
    with pytest.raises(SystemExit):
        cli_main(["ls", run, "--storage-timeout", "0"])


def test_an_empty_prefix_lists_as_a_run_that_has_not_saved_yet(s3_server, s3_bucket, capsys):
    """An object store has no empty directories: ls, gc and prune of a prefix with nothing under it (in a
    bucket that exists) said "is not a directory", while restore() takes it as a first start. A bucket
    that does not exist is still an error."""
    so = ["--storage-options", json.dumps(s3_server.options())]
    empty = f"s3://{s3_bucket}/nothing-yet"
    assert cli_main(["ls", empty, "--json", *so]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == []
    assert cli_main(["gc", empty, *so]) == 0
    assert cli_main(["prune", empty, "--keep", "1", *so]) == 0
    capsys.readouterr()
    for verb in (["ls"], ["gc"], ["prune", "--keep", "1"]):
        assert cli_main([verb[0], "s3://no-such-bucket-recckpt/run", *verb[1:], *so]) == 1, verb
        assert "no-such-bucket-recckpt" in capsys.readouterr().err


def test_compact_from_a_missing_bucket_names_the_bucket(s3_server, s3_bucket, capsys):
    """compact said the source "is not a committed checkpoint" where every other verb says the bucket does
    not exist (a helper's attack on S3)."""
    so = ["--storage-options", json.dumps(s3_server.options())]
    code = cli_main(["compact", "s3://no-such-bucket-recckpt/run/c", f"s3://{s3_bucket}/run/zz", *so])
    err = capsys.readouterr().err
    assert code == 1 and "bucket 'no-such-bucket-recckpt'" in err and "does not exist" in err, err
