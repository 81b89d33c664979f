"""Issue 25 item 2: saving and loading a TorchRec model keeps memory within the rank's shards plus bounded
buffers. Real DMP on gloo in 2 processes: each rank's peak RSS growth during a save and during a load is
at most the configured buffers (segment, in-flight, staging, read batch) + 64 MB, while its shards
(weights and Adagrad state) are larger than that bound, so a whole copy of them would fail the test."""
from __future__ import annotations

import os

from .harness import needs_torchrec, run_jobs

pytestmark = needs_torchrec

MB = 1 << 20
TABLES = [[f"t{i}", 200_000, 64, "fp32"] for i in range(3)]   # 51 MB each, 307 MB with Adagrad state
BUFFERS = {"segment_bytes": 8 * MB, "inflight_bytes": 16 * MB, "staging_bytes": 8 * MB, "batch_bytes": 8 * MB}


def test_peak_rss_growth_of_save_and_load_is_bounded(tmp_path):
    tmp = str(tmp_path)
    job = {"name": "rss", "kind": "ebc", "dtensor": False, "plan": {t[0]: "rw" for t in TABLES}, "opt": "adagrad",
           "tables": TABLES, "train_steps": 1, "save": os.path.join(tmp, "ck"), "load": None, "load_conf": None,
           "dump": None, "rss": BUFFERS}
    results = run_jobs(tmp, 2, [job], timeout=400)
    for rank, (r,) in enumerate(results):
        bound = r["bound"] + 64 * MB
        assert r["shard_bytes"] > bound, f"rank {rank}: shards of {r['shard_bytes']} bytes cannot show a copy"
        for what in ("rss_save", "rss_load"):
            assert r[what] <= bound, (f"rank {rank}: peak RSS grew {r[what] / MB:.0f} MB during the "
                                      f"{what[4:]}, bound {bound / MB:.0f} MB (shards {r['shard_bytes'] / MB:.0f} MB)")
