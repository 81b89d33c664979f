"""benchmarks/bench_tables.py (issue 26's many-tables targets) runs end to end at a tiny size, its
multi-process part on real torchrun worlds included, and reports every number it promises."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def test_bench_tables_smoke(tmp_path, monkeypatch):
    # the torchrun workers import this tree's recckpt
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.abspath(ROOT), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_tables
    finally:
        sys.path.pop(0)
    res = bench_tables.main(["--smoke", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert [(r["tables"], r["rows"], r["adam"]) for r in res["shapes"]] == [(20, 30, True), (20, 30, False)]
    for r in res["shapes"]:
        for k in ("save_s", "save_fsync_s", "load_s", "verify_s", "capture_s", "torch_save_s", "torch_save_fsync_s",
                  "torch_load_s", "load_inproc_s", "torch_load_inproc_s"):
            assert r[k] > 0, (r["tables"], k)
        row = 8 + r["dim"] * 4 * (3 if r["adam"] else 1)
        assert r["row_bytes"] == r["tables"] * r["rows"] * row
        assert r["bytes"] >= r["row_bytes"]   # every row is on disk
        assert r["ratios"]["save_vs_torch"] == pytest.approx(r["torch_save_s"] / r["save_s"])
        assert r["ratios"]["load_vs_torch"] == pytest.approx(r["torch_load_s"] / r["load_s"])
        assert r["ratios"]["load_inproc_vs_torch"] == pytest.approx(r["torch_load_inproc_s"] / r["load_inproc_s"])
        assert set(r["load_faults"]) == {"torch", "recckpt"}   # the fresh-process loads ran, one of each kind
        assert r["ratios"]["bytes_vs_rows"] == pytest.approx(r["bytes"] / r["row_bytes"])
    rk = res["ranks"]
    assert [s["world"] for s in rk["saves"]] == [1, 2]
    assert all(s["rank0_save_s"] > 0 and s["bytes"] > 0 for s in rk["saves"])
    ld = rk["load"]
    assert ld["world"] == 2 and ld["rows"] == rk["rows"]   # every row came back, split over the ranks
    assert sum(ld["share_bytes"]) == rk["rows"] * (8 + 3 * 16 * 4)
    assert all(b > 0 for b in ld["bytes_read"]) and all(ld["within_bound"])
    assert os.listdir(tmp_path) == ["r.json"]   # the scratch directory is gone
