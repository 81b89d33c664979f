"""Saves checkpoints into an S3 prefix in a loop until killed (the parent SIGKILLs it at a random
moment). Usage: s3_save_child.py URL STORAGE_OPTIONS_JSON READY_FILE"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from helpers.shared_dir_child import Model  # noqa: E402
from recckpt import SaveOptions, Saver  # noqa: E402


def main():
    url, opts, ready = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    m = Model()
    s = Saver(m, output_dir=url, max_keep=2, concurrency=3, storage_options=opts,
              options=SaveOptions(num_buckets=32, chunk_bytes=4096, segment_bytes=1 << 16, fsync=False))
    start = len(s.checkpoints()) and int(s.checkpoints()[-1].split("_")[1]) + 1
    k = start
    while True:
        ids = torch.arange(3000 + k)
        m.t.clear_rows()
        m.t.set_rows(ids, {"embedding": torch.full((ids.numel(), 8), float(k))})
        m.tag.copy_(torch.tensor([k, k]))
        s.save(f"ckpt_{k:05d}")
        if k == start:
            open(ready, "w").close()
        k += 1


if __name__ == "__main__":
    main()
