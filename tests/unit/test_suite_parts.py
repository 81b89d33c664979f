"""scripts/test.sh runs the suite in two parts (one-process tests on two CPUs, then the real-process tests
alone). A test folder that neither part names would never run in CI: every folder holding tests is in
exactly one part."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parts() -> list:
    script = open(os.path.join(ROOT, "scripts", "test.sh")).read()
    runs = [line for line in script.splitlines() if line.startswith('"${PYTEST[@]}"') and "tests/" in line]
    return [set(re.findall(r"\btests/[\w/]+", line)) for line in runs]


def test_every_test_folder_runs_in_exactly_one_part():
    parts = _parts()
    assert len(parts) == 2, parts
    named = [p.rstrip("/") for part in parts for p in part]
    with_tests = {f"tests/{d}" for d in os.listdir(os.path.join(ROOT, "tests"))
                  if os.path.isdir(os.path.join(ROOT, "tests", d))
                  and any(f.startswith("test_") and f.endswith(".py") for f in os.listdir(os.path.join(ROOT, "tests", d)))}
    assert with_tests, "no test folder found: the check would pass vacuously"
    assert sorted(set(named)) == sorted(named), f"a folder is named twice: {named}"
    assert set(named) == with_tests, f"folders left out: {with_tests - set(named)}; named but absent: {set(named) - with_tests}"
