"""The `recckpt` command on real checkpoints: every verb in-process (local and memory://, one and three
workers), exit codes and one-line errors for bad input, and the command run as a user runs it
(`python -m recckpt`, and the installed console script when the dist is installed)."""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

from helpers.checkpoints import make_checkpoint, table_rows
from recckpt.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERBS = ["ls", "inspect", "verify", "diff", "export", "lookup", "prune", "gc", "compact"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out), err


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else f"memory://h17cli-{uuid.uuid4().hex}"


@pytest.mark.parametrize("workers", [1, 3])
def test_lookup_prints_the_rows_of_given_ids_and_says_which_are_absent(capsys, root, workers, tmp_path):
    rows = table_rows(400)
    make_checkpoint(root, "ckpt_1", rows, workers=workers)
    ids = rows["ids"]
    absent = int(ids.max()) + 1
    code, doc, _ = run_json(capsys, "lookup", f"{root}/ckpt_1", "user", str(ids[3]), str(absent), str(ids[0]),
                            "--slots", "embedding,freq")
    assert code == 1, "an absent id: exit 1"
    assert [r["id"] for r in doc["rows"]] == [int(ids[3]), absent, int(ids[0])]
    assert [r["found"] for r in doc["rows"]] == [True, False, True] and doc["rows"][1]["slots"] is None   # (one shape for every row)
    for r, k in ((doc["rows"][0], 3), (doc["rows"][2], 0)):
        assert np.array_equal(np.array(r["slots"]["embedding"], dtype=np.float32), rows["embedding"][k])
        assert r["slots"]["freq"] == int(rows["freq"][k])
    negative = next(int(i) for i in ids if i < 0)
    f = tmp_path / "ids.txt"
    f.write_text(f"{ids[5]}\n{ids[6]}")
    code, out, _ = run(capsys, "lookup", f"{root}/ckpt_1", "user", str(negative), "--ids-file", str(f))
    lines = out.splitlines()
    assert code == 0 and [x.split(":")[0] for x in lines] == [str(negative), str(ids[5]), str(ids[6])], out
    assert lines[1].startswith(f"{ids[5]}: embedding=[") and lines[1].endswith(f"freq={rows['freq'][5]}  "
                                                                                f"last_step={rows['last_step'][5]}")
    f.write_text("12 twelve")
    code, _, err = run(capsys, "lookup", f"{root}/ckpt_1", "user", "--ids-file", str(f))
    assert code == 2 and "word 2 ('twelve') is not an integer id" in err
    # a file that is not there, or holds no ids: usage errors naming the file (was exit 1, "give ids")
    code, _, err = run(capsys, "lookup", f"{root}/ckpt_1", "user", "--ids-file", str(tmp_path / "absent.txt"))
    assert code == 2 and "absent.txt: cannot read it" in err and "FileNotFoundError" in err, err
    f.write_text(" \n")
    code, _, err = run(capsys, "lookup", f"{root}/ckpt_1", "user", "--ids-file", str(f))
    assert code == 2 and "holds no ids" in err, err
    code, _, err = run(capsys, "lookup", f"{root}/ckpt_1", "nope", "1")
    assert code == 2 and "no table 'nope'" in err


def test_lookup_refuses_ids_outside_int64_instead_of_wrapping_them(capsys, tmp_path):
    """2**63 (or a uint64 hash) cast to int64 becomes another id: the rows of that id came back as found."""
    import recckpt
    rows = table_rows(50)
    rows["ids"][:2] = [-(1 << 63), -1]   # where 2**63 and 2**64 - 1 would wrap to
    make_checkpoint(str(tmp_path), "c", rows)
    view = recckpt.open(str(tmp_path / "c"))
    for ids in ([1 << 63], np.array([(1 << 64) - 1], dtype=np.uint64), [-1, 1 << 63], [1 << 64, 5]):
        with pytest.raises(recckpt.errors.InvalidArgumentError, match="outside int64"):
            view.lookup("user", ids)
    found, _ = view.lookup("user", np.array([1, (1 << 63) - 1], dtype=np.uint64))   # in range: looked up as int64
    assert found.tolist() == [bool((rows["ids"] == 1).any()), bool((rows["ids"] == (1 << 63) - 1).any())]
    f = tmp_path / "ids.txt"
    for argv in (["9223372036854775808"], ["--", "-9223372036854775809"], ["--ids-file", str(f)]):
        f.write_text("5 18446744073709551615")
        code, _, err = run(capsys, "lookup", str(tmp_path / "c"), "user", *argv)
        assert code == 2 and "outside int64" in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("workers", [1, 3])
def test_ls_inspect_verify(capsys, root, workers):
    rows = table_rows(400)
    make_checkpoint(root, "ckpt_1", rows, workers=workers, extras={"lr": 0.1})
    make_checkpoint(root, "ckpt_2", rows, workers=workers)
    code, doc, _ = run_json(capsys, "ls", root)
    assert code == 0 and [c["ckpt_id"] for c in doc["checkpoints"]] == ["ckpt_1", "ckpt_2"]
    assert all(c["kind"] == "full" and c["size_bytes"] > 400 * 8 for c in doc["checkpoints"]) and doc["leftovers"] == []
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "ckpt_2" in out and "KIND" in out
    code, doc, _ = run_json(capsys, "inspect", f"{root}/ckpt_1")
    assert code == 0 and doc["workers"] == workers and doc["tables"]["user"]["rows"] == len(rows["ids"])
    assert doc["tables"]["user"]["slots"]["embedding"] == {"dtype": "F32", "shape": [8], "category": "sparse"}
    assert doc["dense"]["lin.weight"] == {"dtype": "F32", "shape": [3, 4]}
    assert doc["objects"]["lr"] == {"kind": "value", "state": 0.1}
    assert sorted(doc["io_state"]) == [str(w) for w in range(workers)]
    code, out, _ = run(capsys, "inspect", f"{root}/ckpt_1")
    assert code == 0 and "adagrad.acc" in out and "lr (value): 0.1" in out
    keys = set(doc)
    code, doc, _ = run_json(capsys, "inspect", f"{root}/ckpt_1", "--no-objects")   # one JSON shape, objects null
    assert code == 0 and set(doc) == keys and doc["objects"] is doc["io_state"] is doc["sparse_optimizer"] is None
    code, out, _ = run(capsys, "verify", f"{root}/ckpt_1", f"{root}/ckpt_2")
    assert code == 0 and out.count(": OK:") == 2


def _changed(rows):
    b = {k: v.copy() for k, v in rows.items()}
    b["embedding"][10:15] += np.float32(0.5)
    keep = np.ones(len(b["ids"]), bool)
    keep[[3, 4]] = False
    b = {k: v[keep] for k, v in b.items()}
    new = np.array([7, 8, 9], np.int64) * 1_000_003
    for k, v in b.items():
        extra = new if k == "ids" else np.zeros((3, *v.shape[1:]), v.dtype)
        b[k] = np.concatenate([v, extra])
    order = np.argsort(b["ids"])
    return {k: v[order] for k, v in b.items()}


def test_diff_against_itself_and_a_known_change(capsys, root):
    rows = table_rows(600)
    make_checkpoint(root, "a", rows, workers=2)
    make_checkpoint(root, "b", _changed(rows), workers=2, dense_value=0.25)
    code, doc, _ = run_json(capsys, "diff", f"{root}/a", f"{root}/a", "--values")
    assert code == 0 and doc["same"] and doc["values"]["user"]["changed_rows"] == 0
    code, doc, _ = run_json(capsys, "diff", f"{root}/a", f"{root}/b", "--values")
    assert code == 1 and not doc["same"]
    v = doc["values"]["user"]
    assert (v["only_a"], v["only_b"], v["changed_rows"]) == (2, 3, 5)
    assert v["slots"]["embedding"]["changed_rows"] == 5
    assert v["slots"]["embedding"]["max_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    assert v["slots"]["freq"]["changed_rows"] == 0
    assert doc["dense"]["changed"] == ["lin.bias", "lin.weight"]
    code, out, _ = run(capsys, "diff", f"{root}/a", f"{root}/b")
    # without --values the rows are compared by the digests the manifests record: no row is read
    assert code == 1 and "~ dense key lin.weight" in out and "~ rows of user: the ids differ (600 -> 601 rows)" in out
    assert "~ slot user.embedding: rows differ" in out and "largest absolute difference" not in out


def test_export_verb(capsys, root, tmp_path):
    rows = table_rows(500)
    make_checkpoint(root, "c", rows, workers=3)
    out = tmp_path / "exp"
    code, doc, _ = run_json(capsys, "export", f"{root}/c", "--out", str(out), "--format", "npy", "--dtype",
                            "fp16", "--tables", "user", "--slots", "embedding,freq", "--shard-rows", "100",
                            "--min-freq", "5")
    keep = rows["freq"] >= 5
    assert code == 0 and doc["tables"]["user"]["rows"] == keep.sum()
    ids = np.concatenate([np.load(f) for f in sorted(glob.glob(str(out / "user" / "*.id.npy")))])
    emb = np.concatenate([np.load(f) for f in sorted(glob.glob(str(out / "user" / "*.embedding.npy")))])
    assert emb.dtype == np.float16 and all(len(np.load(f)) <= 100 for f in glob.glob(str(out / "user" / "*.id.npy")))
    o = np.argsort(ids)
    assert np.array_equal(ids[o], rows["ids"][keep])
    assert np.allclose(emb[o], rows["embedding"][keep], rtol=2 ** -11, atol=2 ** -24)


def test_prune_and_gc(capsys, root):
    rows = table_rows(50)
    for i in range(4):
        make_checkpoint(root, f"ckpt_{i}", rows)
    code, doc, _ = run_json(capsys, "prune", root, "--keep", "2", "--dry-run")
    assert code == 0 and doc["would_delete"] == ["ckpt_0", "ckpt_1"]
    code, doc, _ = run_json(capsys, "prune", root, "--keep", "2")
    assert code == 0 and doc["deleted"] == ["ckpt_0", "ckpt_1"]
    code, doc, _ = run_json(capsys, "ls", root)
    assert [c["ckpt_id"] for c in doc["checkpoints"]] == ["ckpt_2", "ckpt_3"]

    # what a crashed save and a crashed version-file update leave behind
    import fsspec
    fs, base = fsspec.core.url_to_fs(root)
    fs.makedirs(f"{base}/.staging-ckpt_9-abc123/sparse", exist_ok=True)
    fs.pipe(f"{base}/.staging-ckpt_9-abc123/sparse/shard-00000-000.bin", b"x" * 10)
    fs.pipe(f"{base}/.checkpoint.tmp-1234abcd", b"ckpt_2\n")
    code, doc, _ = run_json(capsys, "ls", root)
    assert sorted(n for n, _ in doc["leftovers"]) == [".checkpoint.tmp-1234abcd", ".staging-ckpt_9-abc123"]
    code, out, _ = run(capsys, "ls", root)
    assert "leftover: .staging-ckpt_9-abc123" in out
    code, doc, _ = run_json(capsys, "gc", root, "--dry-run")
    assert len(doc["would_remove"]) == 2 and fs.exists(f"{base}/.staging-ckpt_9-abc123")
    code, doc, _ = run_json(capsys, "gc", root)
    assert code == 0 and len(doc["removed"]) == 2 and not fs.exists(f"{base}/.staging-ckpt_9-abc123")
    code, doc, _ = run_json(capsys, "ls", root)
    assert [c["ckpt_id"] for c in doc["checkpoints"]] == ["ckpt_2", "ckpt_3"] and doc["leftovers"] == []
    code, out, _ = run(capsys, "verify", f"{root}/ckpt_3")
    assert code == 0


def test_bad_input_gives_one_line_and_the_right_exit_code(capsys, tmp_path):
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(300))
    ck = str(tmp_path / "run" / "c")
    # not a checkpoint
    code, out, err = run(capsys, "inspect", str(tmp_path / "nowhere"))
    assert code == 1 and err.count("\n") == 1 and "nowhere does not exist" in err
    code, out, err = run(capsys, "inspect", str(tmp_path / "run"))
    assert code == 1 and "output directory" in err and "run/c" in err
    code, out, err = run(capsys, "ls", str(tmp_path / "nowhere"))
    assert code == 1 and "not a directory" in err
    code, out, err = run(capsys, "ls", ck)
    assert code == 2 and "one checkpoint, not an output directory" in err
    # wrong options
    for argv, what in [(["export", ck, "--out", str(tmp_path / "o"), "--format", "csv"], "--format"),
                       (["export", ck], "--out"), (["prune", str(tmp_path / "run"), "--keep", "x"], "--keep"),
                       (["frobnicate"], "frobnicate"), ([], "VERB"),
                       (["export", ck, "--out", str(tmp_path / "o"), "--tables", "item"], "--tables"),
                       (["export", ck, "--out", str(tmp_path / "o"), "--slots", ","], "--slots")]:
        code, out, err = run_capsys_exit(capsys, argv)
        assert code == 2 and what in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    # a corrupt shard: verify and export name the file
    shard = tmp_path / "run" / "c" / "sparse" / "shard-00000-000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", ck)
    assert code == 1 and "CORRUPT" in out and "shard-00000-000.bin" in out
    code, out, err = run(capsys, "export", ck, "--out", str(tmp_path / "o2"))
    assert code == 1 and "shard-00000-000.bin" in err and err.count("\n") == 1 and "Traceback" not in err
    code, out, err = run(capsys, "diff", ck, ck, "--values")
    assert code == 1 and "shard-00000-000.bin" in err
    # a garbled manifest
    (tmp_path / "run" / "c" / "manifest.json").write_text("{")
    code, out, err = run(capsys, "inspect", ck)
    assert code == 1 and "manifest.json" in err and err.count("\n") == 1
    # --debug: the traceback instead of the line
    from recckpt.errors import CorruptCheckpointError
    with pytest.raises(CorruptCheckpointError):
        main(["inspect", ck, "--debug"])


def run_capsys_exit(capsys, argv):
    """argparse exits (SystemExit) on usage errors; the API ones return the code."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def test_every_verb_has_help_with_json(capsys):
    for verb in VERBS:
        code, out, err = run_capsys_exit(capsys, [verb, "--help"])
        assert code == 0 and "--json" in out and "--debug" in out, verb


def test_python_dash_m_recckpt_as_a_user_runs_it(tmp_path):
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(100))
    p = subprocess.run([sys.executable, "-m", "recckpt", "export", "--help"], capture_output=True, text=True,
                       env=_subprocess_env(), timeout=120)
    assert p.returncode == 0 and "--shard-rows" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, "-m", "recckpt", "verify", str(tmp_path / "run" / "c"), "--json"],
                       capture_output=True, text=True, env=_subprocess_env(), timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)[0]["problems"] == []
    p = subprocess.run([sys.executable, "-m", "recckpt", "inspect", str(tmp_path / "missing")],
                       capture_output=True, text=True, env=_subprocess_env(), timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_installed_console_script(tmp_path):
    try:
        eps = importlib.metadata.entry_points(group="console_scripts")
    except Exception as e:  # pragma: no cover - metadata machinery broken
        pytest.skip(f"entry points unreadable: {e}")
    ours = [ep for ep in eps if ep.name == "recckpt"]
    script = shutil.which("recckpt") or os.path.join(os.path.dirname(sys.executable), "recckpt")
    if not ours or not os.path.exists(script):
        pytest.skip("the recckpt dist is not installed with its console script here (pip install -e . adds it); "
                    "python -m recckpt is tested above")
    assert ours[0].value == "recckpt.cli:main" and ours[0].load() is main
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(100))
    p = subprocess.run([script, "ls", str(tmp_path / "run"), "--json"], capture_output=True, text=True,
                       env=_subprocess_env(), timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["checkpoints"][0]["ckpt_id"] == "c"


def test_progress_bar_on_a_terminal_only(capsys, monkeypatch, tmp_path):
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(300))
    code, out, err = run(capsys, "export", str(tmp_path / "run" / "c"), "--out", str(tmp_path / "a"))
    assert code == 0 and "rows/s" not in err and "export:" not in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "export", str(tmp_path / "run" / "c"), "--out", str(tmp_path / "b"),
                         "--chunk-rows", "50")
    assert code == 0 and "export:" in err and "rows" in err


def test_compact_verb_folds_a_chain_into_one_full_checkpoint(capsys, tmp_path):
    import recckpt
    from unit.test_incremental import assert_contents, run_chain
    model, saver, snaps = run_chain(tmp_path / "run", n_incr=3)
    code, doc, _ = run_json(capsys, "compact", str(tmp_path / "run" / "c3"), str(tmp_path / "run" / "full3"))
    assert code == 0 and doc["links"] == 4 and doc["rows"] == len(snaps["c3"]["embedding"])
    view = recckpt.open(str(tmp_path / "run" / "full3"))
    assert view.parent is None                       # a full checkpoint: no chain behind it
    fresh = type(model)()
    opt = recckpt.SparseAdam([fresh.emb], lr=0.05)       # the optimizer slots the chain holds
    recckpt.Saver(fresh, opt, output_dir=tmp_path / "run").load(ckpt_id="full3")
    assert_contents(fresh.emb, snaps["c3"])
    code, _, err = run(capsys, "compact", str(tmp_path / "run" / "c3"), str(tmp_path / "run" / "full3"))
    assert code != 0 and "full3" in err and "Traceback" not in err   # exists already: one line, no overwrite


def test_ls_of_a_folder_above_output_dirs_names_them(capsys, root):
    """Issue 29 item 5: `recckpt ls demo_output/uninterrupted` (a run folder holding `ckpts/`) said only
    '0 committed checkpoint(s)'."""
    rows = table_rows(50)
    make_checkpoint(f"{root}/uninterrupted/ckpts", "ckpt_1", rows)
    make_checkpoint(f"{root}/other/deep/out", "ckpt_2", rows)
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "0 committed checkpoint(s)" in out
    assert "uninterrupted/ckpts" in out and "other/deep/out" in out, out
    code, doc, _ = run_json(capsys, "ls", f"{root}/uninterrupted")
    assert code == 0 and doc["output_dirs_below"] == ["ckpts"]
    code, doc, _ = run_json(capsys, "ls", f"{root}/uninterrupted/ckpts")   # an output dir: nothing searched
    assert [c["ckpt_id"] for c in doc["checkpoints"]] == ["ckpt_1"] and doc["output_dirs_below"] == []
