"""The writers' staging buffers are kept between saves (csrc/buffer_pool.h): the next save of the process
stages its rows in them instead of faulting in fresh memory; what is kept is bounded; a reused buffer never
leaks one save's bytes into another's files; and a fork while a writer runs does not deadlock the child."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from recckpt import _C, HashTable, SaveOptions, Saver

DIM = 128
ROWS = 40000   # rows of 8 + 4 * DIM bytes: 21 MB, more than the two 8 MiB buffers of one file hold


def _model(seed: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.add_module("t", HashTable("t", dim=DIM))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.t(torch.randperm(10 * ROWS, generator=g)[:ROWS].to(torch.int64))
        m.t.write_rows("embedding", m.t.lookup(m.t.ids()), torch.randn(ROWS, DIM, generator=g))
    return m


def _rows(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = m.t.ids().sort().values
    return ids, m.t.read_rows("embedding", m.t.lookup(ids))


def _loaded(out: str) -> torch.nn.Module:
    dst = torch.nn.Module()
    dst.add_module("t", HashTable("t", dim=DIM))
    Saver(dst, output_dir=out).load()
    return dst


def test_a_second_save_reuses_the_first_saves_buffers_and_writes_its_own_rows(tmp_path):
    _C.release_staging_pool()
    a, b = _model(1), _model(2)
    before = _C.staging_pool()
    # one file (concurrency=1) of more than 16 MiB: both of its buffers are filled
    Saver(a, output_dir=str(tmp_path / "a"), concurrency=1, options=SaveOptions(fsync=False)).save("c")
    first = _C.staging_pool()
    assert first["fresh"] - before["fresh"] + first["reused"] - before["reused"] == 2
    assert first["idle_bytes"] == 2 * (8 << 20)   # both kept
    Saver(b, output_dir=str(tmp_path / "b"), concurrency=1, options=SaveOptions(fsync=False)).save("c")
    second = _C.staging_pool()
    assert second["fresh"] == first["fresh"]   # no new buffer: both handed out again
    assert second["reused"] == first["reused"] + 2
    # b's files hold b's rows, not bytes left in the buffers by a's save
    for src, out in ((a, "a"), (b, "b")):
        ids, rows = _rows(_loaded(str(tmp_path / out)))
        want_ids, want = _rows(src)
        assert torch.equal(ids, want_ids) and torch.equal(rows, want)


def test_what_is_kept_is_bounded_and_can_be_released(tmp_path):
    _C.release_staging_pool()
    assert _C.staging_pool()["idle_bytes"] == 0
    # eight files of two buffers each: more than the pool keeps
    big = torch.nn.Module()
    for k in range(8):
        big.add_module(f"t{k}", HashTable(f"t{k}", dim=DIM))
        with torch.no_grad():
            getattr(big, f"t{k}")(torch.arange(ROWS, dtype=torch.int64) + k * ROWS)
    Saver(big, output_dir=str(tmp_path / "o"), concurrency=8, options=SaveOptions(fsync=False)).save("c")
    stats = _C.staging_pool()
    assert stats["fresh"] > _C.STAGING_POOL_BYTES // (8 << 20)   # it did use more than it keeps
    assert 0 < stats["idle_bytes"] <= _C.STAGING_POOL_BYTES
    _C.release_staging_pool()
    assert _C.staging_pool()["idle_bytes"] == 0


def test_two_writers_at_once_never_share_a_buffer(tmp_path):
    models = [_model(10 + k) for k in range(2)]
    errors: list[BaseException] = []

    def save(k: int) -> None:
        try:
            s = Saver(models[k], output_dir=str(tmp_path / f"o{k}"), max_keep=None,
                      options=SaveOptions(fsync=False))
            for i in range(4):
                s.save(f"c{i}")
        except BaseException as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    threads = [threading.Thread(target=save, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, src in enumerate(models):
        want_ids, want = _rows(src)
        for i in range(4):
            dst = torch.nn.Module()
            dst.add_module("t", HashTable("t", dim=DIM))
            Saver(dst, output_dir=str(tmp_path / f"o{k}")).load(ckpt_id=f"c{i}")
            ids, rows = _rows(dst)
            assert torch.equal(ids, want_ids) and torch.equal(rows, want), (k, i)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_writers_run_leaves_the_child_a_usable_pool(tmp_path):
    """Children forked while a writer saves in the parent can save too. The lock is held only briefly, so
    this rarely forks inside it; the test below holds it on purpose."""
    src = _model(3)
    stop = threading.Event()

    def saving() -> None:
        s = Saver(src, output_dir=str(tmp_path / "bg"), options=SaveOptions(fsync=False))
        i = 0
        while not stop.is_set():
            s.save(f"c{i}")
            i += 1

    bg = threading.Thread(target=saving)
    bg.start()
    try:
        for k in range(30):
            pid = os.fork()
            if pid == 0:   # child: take and give back a buffer, through a whole save
                code = 1
                try:
                    signal.alarm(20)
                    _C.staging_pool()
                    Saver(src, output_dir=str(tmp_path / f"child{k}"), options=SaveOptions(fsync=False)).save("c")
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, f"child {k}: {status}"
    finally:
        stop.set()
        bg.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_pool_lock_waits_for_it():
    """Deterministic form of the test above: a C++ thread holds the pool's lock for 300 ms and the process
    forks meanwhile. The fork handler makes fork wait for the lock, so the child's copy is unlocked and its
    pool call returns; without the handler the child would inherit a locked mutex and hang."""
    _C._hold_staging_pool_lock(300)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(10)
            _C.staging_pool()
            _C.release_staging_pool()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
