"""benchmarks/bench_long_chain.py (issue 26 item 5) runs end to end at a tiny size, saving its chain into
--dir once and loading it again from there (the A/B mode), its rows checked either way."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_long_chain.py"), *args],
                          env=env, capture_output=True, text=True, check=True, timeout=300).stdout


def test_bench_long_chain_smoke(tmp_path):
    args = ("--rows", "3000", "--links", "6", "--frac", "0.05", "--rounds", "1", "--dir", str(tmp_path))
    first = _run(*args)
    assert "6 increments saved in" in first and "| base + 6 increments |" in first, first
    again = _run(*args)
    assert "6 increments loaded from --dir" in again and "| base + 6 increments |" in again, again
