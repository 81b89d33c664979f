"""Kill anywhere, lose nothing: a child process saves step after step and is SIGKILLed at random
moments; after every kill the newest fully committed step restores with exactly its contents, every
listed checkpoint verifies, and the next save succeeds (tests/helpers/stress_harness.py has the harness)."""
from __future__ import annotations

import pytest

from helpers import stress_harness as h


def test_kill_sample(tmp_path):
    rec = h.run_kill(12, str(tmp_path), seed=1)
    assert rec.trials == 12
    assert not rec.failures, str(rec)


@pytest.mark.slow
def test_kill_200(tmp_path):
    rec = h.run_kill(200, str(tmp_path), seed=2)
    assert rec.trials == 200
    assert not rec.failures, str(rec)
