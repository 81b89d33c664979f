"""benchmarks/bench_disk_patterns.py runs every pattern on a small file and refuses to call a read cold
when the page cache kept the file (tmpfs keeps its pages whatever DONTNEED says)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_disk_patterns
    finally:
        sys.path.pop(0)
    return bench_disk_patterns


def test_every_pattern_reports_a_time_and_the_file_is_removed(bench, tmp_path):
    res = bench.main(["--mb", "4", "--rounds", "2", "--block", str(256 << 10), "--dir", str(tmp_path)])
    assert set(res) == {"seq", "split", "interleaved", "direct", "streams", "warm"}
    for name, r in res.items():
        assert len(r["all_s"]) == 2 and all(t > 0 for t in r["all_s"]), name
        assert r["gb_per_s"] == pytest.approx((4 << 20) / r["median_s"] / 1e9), name
    assert os.listdir(tmp_path) == []


def test_resident_fraction_sees_a_read_file_cached_and_a_dropped_one_not(bench, tmp_path):
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())   # dirty pages would stay cached whatever DONTNEED says
    p.read_bytes()
    assert bench.resident_fraction(str(p)) >= 0.9
    bench.drop(str(p))
    assert bench.resident_fraction(str(p)) <= 0.01


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm to keep pages cached")
def test_a_file_that_stays_cached_is_refused(bench):
    import tempfile
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.write(os.urandom(1 << 16))
        f.flush()
        with pytest.raises(SystemExit, match="stayed in the page cache"):
            bench.drop(f.name)
