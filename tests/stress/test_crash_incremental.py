"""SIGKILL during incremental saves, compaction and retention: the newest committed checkpoint always
loads, whole and resharded, to exactly the state of its step (tests/helpers/incremental_harness.py)."""
from __future__ import annotations

import pytest

from helpers import incremental_harness as h


def test_kill_incremental_sample(tmp_path):
    rec = h.run_kill_incremental(6, str(tmp_path), seed=1)
    assert rec.trials == 6
    assert not rec.failures, str(rec)


@pytest.mark.slow
def test_kill_incremental_100(tmp_path):
    rec = h.run_kill_incremental(100, str(tmp_path), seed=2)
    assert rec.trials == 100
    assert not rec.failures, str(rec)
