"""The README's quick start is code users paste: it must run as written."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_start_runs(tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    quick = next((b for b in blocks if "saver.save(" in b and "class Model" in b), None)
    if quick is None:
        pytest.fail("README.md has no quick-start block (a python block defining a Model and saving)")
    monkeypatch.chdir(tmp_path)
    exec(compile(quick, "README.md quick start", "exec"), {"__name__": "readme"})
    assert (tmp_path / "ckpts" / "ckpt_10" / "manifest.json").is_file()
    assert (tmp_path / "ckpts" / "checkpoint").read_text().split() == ["ckpt_10"]
