"""Warm starts between kinds (issue 27 item 3, HashTable -> TorchRec MCH): a recckpt HashTable checkpoint,
written in the pytest process (no torchrec), warm-starts a managed-collision table through a load with
`rename`: its raw ids are admitted with their embeddings. Run in one worker process (unsharded MCH).

Not covered (not done): an admission rule by the HashTable's `freq` when it holds more ids than the MCH
table's zch_size (the MCH adapter's `overflow='evict'` ranks by the module's own `mch.counts`, which a
HashTable checkpoint does not have), and reporting ids MCH cannot hold (negative, INT64_MAX, outside
input_hash_size) instead of routing them."""
from __future__ import annotations

import os

import numpy as np
import torch

from .harness import needs_torchrec, run_jobs

pytestmark = needs_torchrec

MCH_TABLE = "coll._embedding_module.embedding_bags.u"


def test_hashtable_checkpoint_warm_starts_an_mch_table_by_raw_id(tmp_path):
    import recckpt

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = recckpt.HashTable("user", dim=8, counters=True)

    model = Model()
    raw = torch.tensor([3, 17, 250, 999, 42, 7], dtype=torch.int64)
    model.user.train()
    model.user(raw)
    src = str(tmp_path / "ht")
    recckpt.Saver(model, output_dir=src).save("c")
    job = {"name": "mch", "kind": "mch", "plan": "unsharded", "opt": "adagrad", "tables": [["u", 16, 8, "fp32"]],
           "mch_input": 1000, "train_steps": 0, "save": None, "load": src,
           "load_conf": {"load": ["sparse"], "tables": ["user"], "rename": {"user": MCH_TABLE},
                         "slots": ["embedding"]},
           "dump": os.path.join(str(tmp_path), "d_mch")}
    res = run_jobs(str(tmp_path), 1, [job])
    assert res[0][0]["loaded_tables"] == [MCH_TABLE] and res[0][0]["rows"] == len(raw)
    got = torch.load(os.path.join(job["dump"], "rank0.pt"), weights_only=True)[f"mch:{MCH_TABLE}"]
    ids = got["ids"].numpy()
    assert np.array_equal(np.sort(ids), np.sort(raw.numpy())), "every raw id is admitted"
    want = {int(i): c["embedding"] for i, c in zip(*_rows(src))}
    for k, i in enumerate(ids):
        assert np.array_equal(got["weight"][k].numpy(), want[int(i)]), f"raw id {i}: its row"


def _rows(src):
    import recckpt
    view = recckpt.open(os.path.join(src, "c"))
    ids, cols = [], []
    for i, c in view.iter_rows("user", ["embedding"]):
        for k in range(len(i)):
            ids.append(int(i[k]))
            cols.append({"embedding": c["embedding"][k]})
    return ids, cols

