"""One of several processes saving into one output directory at the same time, as a job restarted
while its old instance still writes: saves ids ckpt_0..ckpt_{n-1} (the same ids as its rival, so they
collide), each holding a dense tensor and a table tagged with this process, and records which saves
reported success. Each save uses a fresh Saver, so each runs start-up recovery.

Usage: shared_dir_child.py URL TAG N START_FILE RESULT_FILE [STORAGE_OPTIONS_JSON]"""
from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from helpers.tables import DictTable  # noqa: E402
from recckpt import SaveOptions, Saver  # noqa: E402
from recckpt.errors import CheckpointExistsError, RecckptError  # noqa: E402
from recckpt.state.protocol import SlotSpec  # noqa: E402

SPEC = {"embedding": SlotSpec(torch.float32, (8,), "sparse")}


class SlowTable(DictTable):
    """Exports one row at a time, sleeping between rows: its save stays in flight for a while."""

    def __init__(self, name, slots, pause_s):
        super().__init__(name, slots)
        self.pause_s = pause_s

    def export_chunks(self, slots, max_rows):
        for chunk in super().export_chunks(slots, 1):
            time.sleep(self.pause_s)
            yield chunk


class Model(torch.nn.Module):
    def __init__(self, pause_s: float = 0.0):
        super().__init__()
        self.t = SlowTable("t", SPEC, pause_s) if pause_s else DictTable("t", SPEC)
        self.register_buffer("tag", torch.zeros(2, dtype=torch.int64))


def value(tag: int, k: int) -> list[int]:
    return [tag, k]


def main():
    url, tag, n, start_file, result_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    rng = random.Random(tag)
    m = Model(float(os.environ.get("SHARED_DIR_CHILD_PAUSE_S", "0")))
    while not os.path.exists(start_file):
        time.sleep(0.01)
    results = []
    for k in range(n):
        ids = torch.arange(tag * 100000 + k * 100, tag * 100000 + k * 100 + 50 + rng.randrange(200))
        m.t.clear_rows()
        m.t.set_rows(ids, {"embedding": torch.full((ids.numel(), 8), float(tag * 1000 + k))})
        m.tag.copy_(torch.tensor(value(tag, k)))
        time.sleep(rng.random() * 0.02)
        ckpt_id = f"ckpt_{k}"
        # A fresh Saver per save, as after a restart: each runs start-up recovery while the rival writes.
        s = Saver(m, output_dir=url, max_keep=None, concurrency=2, storage_options=opts,
                  options=SaveOptions(num_buckets=16, chunk_bytes=1024, segment_bytes=1 << 14, fsync=False))
        try:
            s.save(ckpt_id)
            results.append([ckpt_id, "ok", int(ids.numel())])
        except CheckpointExistsError as e:
            results.append([ckpt_id, "exists", str(e)])
        except RecckptError as e:
            results.append([ckpt_id, "error", f"{type(e).__name__}: {e}"])
    with open(result_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
