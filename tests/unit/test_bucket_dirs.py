"""Version 4 bucket directories checked many at a time (BucketDir.all_from_bytes): each answer is the one
the rule gives that directory alone, whatever the directories around it."""
from __future__ import annotations

import numpy as np
import pytest

from recckpt.format.bucket_dirs import BucketDir
from recckpt.format.schema import Column, Segment

NB = 64


def _alone(raw: np.ndarray, seg: Segment):
    """The rule of docs/FORMAT.md for one directory, written out plainly."""
    k = seg.dir_entries
    if len(raw) != 8 * k:
        return None
    b = [int(x) for x in raw.view("<u4")[:k]]
    st = [int(x) for x in raw.view("<u4")[k:]]
    ok = (b[0] == seg.first and b[-1] == seg.last and b[-1] < NB and st[0] == 0 and st[-1] < seg.rows
          and all(x < y for x, y in zip(b, b[1:])) and all(x < y for x, y in zip(st, st[1:])))
    return (b, st) if ok else None


def _directory(rng, broken: str | None):
    k = int(rng.integers(4 if broken in ("middle", "middle_start") else 1, 12))
    b = np.sort(rng.choice(NB, k, replace=False)).astype("<u4")
    st = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 200), k - 1, replace=False))]).astype("<u4")
    rows, first, last = int(st[-1]) + int(rng.integers(1, 5)), int(b[0]), int(b[-1])
    if broken == "order" and k > 1:
        b[[0, -1]] = b[[-1, 0]]
    elif broken == "middle":         # first and last as recorded, not increasing in between
        b[[1, 2]] = b[[2, 1]]
    elif broken == "middle_start":
        st[[1, 2]] = st[[2, 1]]
    elif broken == "start":
        st[0] = 1
    elif broken == "rows":
        rows = int(st[-1])
    elif broken == "first":
        first += 1
    raw = np.concatenate([b, st]).view(np.uint8)
    if broken == "short":
        raw = raw[:-8]
    seg = Segment(0, rows, Column(0, 8 * k, (0,), 8 * k), (), k, first, last)
    return raw, seg


@pytest.mark.parametrize("seed", range(20))
def test_directories_checked_together_agree_with_each_alone(seed):
    rng = np.random.default_rng(seed)
    kinds = [None, "order", "middle", "middle_start", "start", "rows", "first", "short"]
    picks = kinds + [kinds[int(rng.integers(len(kinds)))] for _ in range(int(rng.integers(0, 30)))]
    dirs = [_directory(rng, picks[i]) for i in rng.permutation(len(picks))]
    got = BucketDir.all_from_bytes([r for r, _ in dirs], [s for _, s in dirs], NB)
    for (raw, seg), d in zip(dirs, got):
        want = _alone(raw, seg)
        assert (d is None) == (want is None)
        if d is not None:
            assert d.buckets.tolist() == want[0] and d.starts.tolist() == want[1] and d.rows == seg.rows
    assert any(d is None for d in got) and any(d is not None for d in got)
