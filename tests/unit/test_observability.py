"""Observability (issue 29 item 6): every save and load logs one INFO line through the `recckpt`
logger, and `CheckpointManager(on_save=..., on_load=...)` gives the same figures as frozen dataclasses
(async saves: once durable)."""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

import recckpt
from recckpt import CheckpointManager, HashTable, LoadEvent, SaveEvent, SaveOptions, Saver
from recckpt.errors import InvalidArgumentError

OPTS = SaveOptions(num_buckets=16, fsync=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 8)
        self.emb(torch.arange(1000))
        self.lin = torch.nn.Linear(8, 2)


def lines(caplog, word):
    return [r.getMessage() for r in caplog.records if r.name == "recckpt" and r.levelno == logging.INFO
            and r.getMessage().startswith(f"recckpt: {word}")]


def test_one_info_line_per_save_and_load(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="recckpt")
    s = Saver(Model(), output_dir=tmp_path, options=OPTS)
    s.save("a", step=7)
    (line,) = lines(caplog, "saved")
    assert re.search(r"saved a \(step 7, full\): [\d.]+ MB, 1000 rows in [\d.]+ s \([\d.]+ MB/s\)$", line), line
    Saver(Model(), output_dir=tmp_path).load()
    (line,) = lines(caplog, "loaded")
    assert re.search(r"loaded .*/a \(step 7\) on rank 0 of 1: [\d.]+ MB read, 1000 rows in [\d.]+ s", line), line


def test_async_save_line_says_the_stall(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="recckpt")
    mgr = CheckpointManager(Saver(Model(), output_dir=tmp_path, options=OPTS), save_interval=1, async_save=True)
    mgr.step()
    mgr.wait()
    (line,) = lines(caplog, "saved")
    assert "saved ckpt_1 (step 1, full)" in line and re.search(r"training stalled [\d.]+ s \(async save\)", line)


@pytest.mark.parametrize("async_save", [False, True])
def test_on_save_and_on_load_get_the_figures(tmp_path, async_save):
    got = []

    def on_save(e):
        assert isinstance(e, SaveEvent)
        got.append((e, recckpt.list_checkpoints(str(tmp_path)).checkpoints[-1].ckpt_id))  # durable: listed

    mgr = CheckpointManager(Saver(Model(), output_dir=tmp_path, max_keep=None, options=OPTS), save_interval=2,
                            async_save=async_save, on_save=on_save)
    for _ in range(4):
        mgr.step()
    mgr.wait()
    assert [(e.ckpt_id, e.step, listed) for e, listed in got] == [("ckpt_2", 2, "ckpt_2"), ("ckpt_4", 4, "ckpt_4")]
    e = got[0][0]
    assert e.bytes > 1000 * 8 * 4 and e.rows == 1000 and e.seconds > 0 and e.kind == "full"
    assert e.async_save is async_save and e.rank == 0 and e.throughput == pytest.approx(e.bytes / e.seconds)
    assert e.stall_seconds <= e.seconds + 1e-3 if not async_save else e.stall_seconds > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.bytes = 0
    loads = []
    m2 = CheckpointManager(Saver(Model(), output_dir=tmp_path, options=OPTS), on_load=loads.append)
    assert m2.restore() == 4
    (le,) = loads
    assert isinstance(le, LoadEvent) and (le.ckpt_id, le.step, le.rows, le.source) == ("ckpt_4", 4, 1000, "restore")
    assert le.bytes >= 1000 * 8 * 4 and le.seconds > 0
    bank = []
    m3 = CheckpointManager(Saver(Model(), output_dir=tmp_path / "fresh", options=OPTS), on_load=bank.append)
    m3.load_model_bank([{"path": str(tmp_path / "ckpt_2")}])
    assert [(b.ckpt_id, b.step, b.source) for b in bank] == [(None, 2, "model_bank")]


def test_a_failing_callback_is_logged_not_raised(tmp_path, caplog):
    def boom(e):
        raise RuntimeError("metrics server down")

    for async_save in (False, True):
        out = tmp_path / str(async_save)
        mgr = CheckpointManager(Saver(Model(), output_dir=out, options=OPTS), save_interval=1,
                                async_save=async_save, on_save=boom)
        h = mgr.step()
        mgr.wait()
        assert h.durable
    assert sum("on_save callback" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR) == 2
    with pytest.raises(InvalidArgumentError, match="on_save"):
        CheckpointManager(Saver(Model(), output_dir=tmp_path / "x"), on_save="tensorboard")
