"""scripts/torchrec_example.sh as a user runs it (issue 27 item 1): a TorchRec DLRM under torchrun on 2
workers with CheckpointManager(async_save=True) is SIGKILLed and resumed with every loss equal to an
uninterrupted run's, then resumed on 3 workers under a row-wise plan. The script checks itself; this test
checks again from the files the ranks wrote (losses, each rank's restored shards read from TorchRec's own
state, the committed checkpoints), so a script that stopped checking would still be caught."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from .harness import ROOT, needs_torchrec

pytestmark = needs_torchrec

STEPS, MORE = 10, 20   # killed after step 7, resumed from ckpt_5; 20 more steps on 3 workers from ckpt_10


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torchrec_example") / "demo")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "torchrec_example.sh"), out, str(STEPS), str(MORE)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return out, proc


def _losses(path):
    out = {}
    for line in open(path):
        step, value = line.split()
        out[int(step)] = value
    return out


def test_script_passes(example):
    out, proc = example
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "torchrec example: OK" in proc.stdout


def test_killed_and_resumed_on_two_workers_bit_for_bit(example):
    out, _ = example
    killed = _losses(os.path.join(out, "run", "losses-2.txt"))
    whole = _losses(os.path.join(out, "whole", "losses-2.txt"))
    assert sorted(whole) == list(range(1, STEPS + 1))
    assert whole == killed, {s: (whole[s], killed.get(s)) for s in whole if whole[s] != killed.get(s)}
    assert len(set(whole.values())) > STEPS // 2, "losses do not change: the model is not training"
    for r in range(2):
        assert open(os.path.join(out, "run", f"done-2-rank{r}")).read().strip() == str(STEPS)


def test_resumed_on_three_workers_rows_and_state_equal_the_checkpoint(example):
    import recckpt
    out, _ = example
    dump = os.path.join(out, "restored3")
    restored = open(os.path.join(dump, "restored_from")).read()
    assert restored == f"ckpt_{STEPS}", restored
    view = recckpt.open(os.path.join(out, "run", "ckpt", restored))
    assert json.loads(view.metadata["recckpt.torchrec.plan"])[
        "sparse_arch.embedding_bag_collection.embedding_bags.user"]["sharding"] == "table_wise"
    parts = [torch.load(os.path.join(dump, f"rank{r}.pt"), weights_only=True) for r in range(3)]
    assert len(view.tables) == 4
    for table in view.tables:
        ids, emb, acc = [], [], []
        for i, cols in view.iter_rows(table, ["embedding", "rowwise_adagrad.acc"]):
            ids.append(i)
            emb.append(cols["embedding"])
            acc.append(cols["rowwise_adagrad.acc"])
        ids = np.concatenate(ids)
        assert np.array_equal(np.sort(ids), np.arange(len(ids))), f"{table}: the checkpoint's row ids"
        order = np.argsort(ids)
        emb, acc = np.concatenate(emb)[order], np.concatenate(acc)[order]
        holders = [p[table] for p in parts if p[table]["weight"]]
        assert len(holders) == 3, f"{table}: a row-wise plan on 3 workers puts a shard on every rank"
        got_w = torch.cat([w for h in holders for _, w in sorted(h["weight"], key=lambda x: x[0])]).numpy()
        got_m = torch.cat([m for h in holders for _, m in sorted(h["momentum1"], key=lambda x: x[0])]).numpy()
        starts = sorted(off[0] for h in holders for off, _ in h["weight"])
        assert starts[0] == 0 and len(starts) == 3
        assert np.array_equal(got_w, emb), f"{table}: restored embeddings differ from the checkpoint"
        assert np.array_equal(got_m, acc), f"{table}: restored RowWiseAdagrad state differs from the checkpoint"
        assert (acc != 0).any(), f"{table}: no optimizer state was trained, the comparison proves nothing"


def test_three_workers_train_on_with_finite_losses_and_save_row_wise(example):
    import recckpt
    out, _ = example
    lines = [line.split() for line in open(os.path.join(out, "run", "losses-3.txt"))]
    assert [int(s) for s, _ in lines] == list(range(STEPS + 1, STEPS + MORE + 1))
    assert all(math.isfinite(float.fromhex(v)) for _, v in lines)
    last = os.path.join(out, "run", "ckpt", f"ckpt_{STEPS + MORE}")
    plan = json.loads(recckpt.open(last).metadata["recckpt.torchrec.plan"])
    assert {p["sharding"] for p in plan.values()} == {"row_wise"}
    assert recckpt.verify(last).ok
