"""The hostile-input corpus: checkpoints and output directories crafted as an attacker would
(tests/helpers/hostile.py, one generator per attack class). Every case runs in a child process and
must (a) end with exactly the expected error naming the file (or succeed where the attack must be
survived, e.g. listing past a bad checkpoint), (b) within its time bound, (c) with peak RSS growth of
at most 2x the bytes on disk + 256 MB. A sample runs by default; RECCKPT_SLOW=1 runs every class."""
from __future__ import annotations

import pytest

from helpers import hostile

SAMPLE = {"listing_worker_steps_superscript", "manifest_deep_nesting", "version_file_fifo", "overlapping_segments",
          "id_flood_200k", "row_runs_overlap"}
ALL = {g.__name__[len("gen_"):]: g for g in hostile.GENERATORS}


def _params():
    for name, gen in sorted(ALL.items()):
        marks = () if name in SAMPLE else (pytest.mark.slow,)
        yield pytest.param(gen, id=name, marks=marks)


@pytest.mark.parametrize("gen", list(_params()))
def test_hostile_case(tmp_path, gen):
    case = gen(str(tmp_path))
    hostile.check_case(case)


def test_every_generator_is_named_for_its_case(tmp_path):
    """The sample names real generators (a renamed generator must not silently drop out of CI)."""
    assert SAMPLE <= set(ALL), SAMPLE - set(ALL)
