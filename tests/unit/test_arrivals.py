"""recckpt.coordination.arrivals: the per-rank marks that let a failed collective name the ranks that never
reached it. A review found that a client was connected on every save (a request burst at scale), and that
connecting to a store whose host is frozen (it accepts the connection, never answers) never returned,
before the save's first collective, so the coordination timeout never fired. One client a process now,
connected on a thread bounded by STORE_TIMEOUT_S."""
from __future__ import annotations

import socket
import time

from recckpt.coordination import arrivals


def test_a_store_that_accepts_and_never_answers_costs_at_most_the_timeout(monkeypatch):
    monkeypatch.setattr(arrivals, "STORE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(arrivals, "_clients", {})
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)   # the kernel accepts connections; nothing ever reads or answers them
        where = ("127.0.0.1", srv.getsockname()[1])
        monkeypatch.setattr(arrivals, "_tcp_store_of_default_group", lambda: where)
        a = arrivals.Arrivals("save", 0, 2)
        t0 = time.monotonic()
        a.mark("begin of checkpoint 'c'")
        assert a.missing("begin of checkpoint 'c'") == ""   # cannot tell: says nothing
        took = time.monotonic() - t0
        assert took < 4.0, took
        t0 = time.monotonic()
        for _ in range(20):   # the failed connection is remembered: no new attempt a save
            a.mark("begin of checkpoint 'd'")
        assert time.monotonic() - t0 < 0.5


def test_one_client_a_process_and_names_of_ranks_behind(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(arrivals, "_clients", {})
    monkeypatch.setattr(arrivals, "_marked", {})
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    where = ("127.0.0.1", server.port)
    monkeypatch.setattr(arrivals, "_tcp_store_of_default_group", lambda: where)
    made = []
    real = dist.TCPStore
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: made.append(1) or real(*a, **k))
    ranks = [arrivals.Arrivals("save", r, 3) for r in range(3)]
    for _ in range(5):   # five saves
        for a in ranks:
            a.mark("begin of checkpoint 'c'")
    ranks[0].mark("gathering worker parts of checkpoint 'c'")
    ranks[2].mark("gathering worker parts of checkpoint 'c'")
    said = ranks[0].missing("gathering worker parts of checkpoint 'c'")
    assert said == ("; ranks that did not reach gathering worker parts of checkpoint 'c': rank 1 (last reached: "
                    "begin of checkpoint 'c')"), said
    assert len(made) == 1, made


def test_a_rank_that_went_through_the_step_and_on_is_not_named_as_behind(monkeypatch):
    """Ranks 1 and 3 finished ckpt_1's gathering and went on to ckpt_2 while rank 2 died in ckpt_1's begin:
    rank 0's timeout names rank 2 only. Before, it named ranks 1 and 3 too (their last mark was not the
    step waited on), pointing whoever debugs a hung job at the wrong ranks."""
    import torch.distributed as dist
    monkeypatch.setattr(arrivals, "_clients", {})
    monkeypatch.setattr(arrivals, "_marked", {})
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(arrivals, "_tcp_store_of_default_group", lambda: ("127.0.0.1", server.port))
    ranks = [arrivals.Arrivals("save", r, 4) for r in range(4)]
    for a in ranks:
        a.mark("begin of checkpoint 'ckpt_1'")
    for r in (0, 1, 3):
        ranks[r].mark("gathering worker parts of checkpoint 'ckpt_1'")
    for r in (1, 3):
        ranks[r].mark("sharing the outcome of checkpoint 'ckpt_1'")
        ranks[r].mark("begin of checkpoint 'ckpt_2'")
    said = ranks[0].missing("gathering worker parts of checkpoint 'ckpt_1'")
    assert said == ("; ranks that did not reach gathering worker parts of checkpoint 'ckpt_1': rank 2 (last "
                    "reached: begin of checkpoint 'ckpt_1')"), said
