"""ruff runs clean over the code (configuration: [tool.ruff] in pyproject.toml)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = ["recckpt", "tests", "benchmarks", "examples", "setup.py"]


def test_ruff_finds_nothing():
    try:
        import ruff  # noqa: F401  (only to say clearly when the test extra is not installed)
    except ImportError:
        pytest.fail("ruff is not installed: run `bash scripts/setup.sh` (it is in the test extra)")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff findings (fix them, or `ruff check --fix`):\n{proc.stdout}{proc.stderr}"


def test_ruff_with_this_configuration_reports_a_finding(tmp_path):
    """The check above can fail: the same configuration flags an unused import and unsorted imports."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           os.path.join(ROOT, "pyproject.toml"), str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "F401" in proc.stdout and "I001" in proc.stdout, proc.stdout + proc.stderr
