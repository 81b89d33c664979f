"""Every command-line error is one line naming the path, never a raw exception (issue 30 item 8): each
verb is given paths that do not exist, files where directories belong, FIFOs and symbolic-link loops."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.checkpoints import make_checkpoint, table_rows
from recckpt.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW = re.compile(r"^recckpt \w+: error: [A-Za-z]*(Error|Exception)\b")   # a Python exception's name first


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_errors")
    make_checkpoint(str(d / "out"), "c1", table_rows(50))
    os.symlink("loop", d / "loop")          # loop -> loop: every use is ELOOP or EEXIST
    os.mkfifo(d / "fifo")
    (d / "afile").write_text("x")
    return d


CASES = [
    # (argv, the path the line must name)
    (["ls", "{d}/nope"], "nope"), (["ls", "{d}/loop/x"], "loop/x"), (["ls", "{d}/fifo"], "fifo"),
    (["gc", "{d}/afile"], "afile"), (["prune", "{d}/loop", "--keep", "1"], "loop"),
    (["inspect", "{d}/loop"], "loop"), (["inspect", "{d}/fifo"], "fifo"), (["inspect", "{d}/nope"], "nope"),
    (["diff", "{d}/out/c1", "{d}/loop/x"], "loop/x"),
    (["export", "{d}/out/c1", "--out", "{d}/loop"], "loop"),
    (["export", "{d}/out/c1", "--out", "{d}/loop/x"], "loop/x"),
    (["export", "{d}/out/c1", "--out", "{d}/afile/x"], "afile"),
    (["export", "{d}/loop", "--out", "{d}/e1"], "loop"),
    (["compact", "{d}/out/c1", "{d}/loop/c3"], "loop"),
    (["compact", "{d}/out/c1", "{d}/loop/sub/c3"], "loop/sub"),
    (["compact", "{d}/out/c1", "{d}/afile/c3"], "afile"),
    (["compact", "{d}/out/c1", "{d}/fifo/c3"], "fifo"),
    (["compact", "{d}/nope/c1", "{d}/out/c3"], "nope"),
    (["compact", "nope", "{d}/out/c3"], "nope"),                 # no <output_dir>/ part
    (["compact", "{d}/out/c1", "c3"], "c3"),
]


@pytest.mark.parametrize("argv,names", CASES, ids=[" ".join(a).replace("{d}/", "") for a, _ in CASES])
def test_one_line_naming_the_path(work, argv, names, capsys):
    rc = main([a.format(d=work) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc in (1, 2), (rc, err)
    assert len(lines) == 1, err
    assert names in lines[0] and not RAW.match(lines[0]) and "--debug" not in lines[0], lines[0]


@pytest.mark.parametrize("dst", ["bad id", ".hidden", "x..y"])
def test_compact_into_an_id_no_checkpoint_can_have_is_a_usage_error(work, dst, capsys):
    """A DST id the checkpoint-id rule refuses is an option value that cannot be valid: exit 2, as
    docs/CLI.md says (it was 1, a failed operation)."""
    assert main(["compact", f"{work}/out/c1", f"{work}/out/{dst}"]) == 2
    err = capsys.readouterr().err
    assert dst in err and not os.path.exists(f"{work}/out/{dst}"), err


def test_compact_into_a_link_loop_as_a_user_runs_it(work):
    """The issue's case, through the installed entry point: exit 1, one line, no traceback."""
    p = subprocess.run([sys.executable, "-m", "recckpt", "compact", str(work / "out" / "c1"), str(work / "loop" / "c2")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and str(work / "loop") in lines[0], p.stderr
    assert not RAW.match(lines[0]) and "Traceback" not in p.stderr
