"""Test-only: run a function on W real processes (gloo on 127.0.0.1) and collect each rank's JSON-able
result or error. The processes are forked from multiprocessing's forkserver, which imports torch,
recckpt and these helpers once per test session (helpers/forks.py); a spawned
process imported torch again for every rank, ~3 s of CPU each on the 2-core CI machine.

Also the small model and table contents the multi-process tests share: row values are a function of the
id, so any rank can check what it loaded."""
from __future__ import annotations

import json
import os
import socket
import time
import traceback

import numpy as np
import torch

from helpers.forks import forkserver_context
from helpers.tables import DictTable
from recckpt.state.protocol import SlotSpec

DIM = 32
SPEC = {"embedding": SlotSpec(torch.float32, (DIM,), "sparse"),
        "adagrad.acc": SlotSpec(torch.float32, (DIM,), "sparse_opt")}
ROW_BYTES = 8 + 2 * 4 * DIM     # id + both slots


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, args, init_pg, environ):
    os.environ.clear()   # the caller's environment now, as a spawned process would have it (not the server's)
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    res = {"rank": rank}
    try:
        if init_pg:
            from datetime import timedelta

            import torch.distributed as dist
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        res["result"] = fn(rank, world, *args)
    except BaseException as e:  # reported to the test, which decides whether it was expected
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)
    if init_pg:
        try:
            import torch.distributed as dist
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(world: int, fn, *args, out_dir: str, init_pg: bool = True, timeout: float = 150.0) -> list[dict]:
    """Start `world` processes running fn(rank, world, *args); returns each rank's report."""
    ctx = forkserver_context()
    os.makedirs(out_dir, exist_ok=True)
    for r in range(world):
        p = os.path.join(out_dir, f"rank-{r}.json")
        if os.path.exists(p):
            os.remove(p)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, out_dir, fn, args, init_pg, dict(os.environ)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} did not finish within {timeout}s"
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank-{r}.json")) as f:
            out.append(json.load(f))
    return out


def ok(reports: list[dict]) -> list:
    bad = [r for r in reports if "error" in r]
    assert not bad, "\n".join(f"rank {r['rank']}: {r['traceback']}" for r in bad)
    return [r["result"] for r in reports]


# ------------------------------------------------------------------------------- shared contents
def all_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64))
    return ids


def rows_for(ids: torch.Tensor, salt: float = 0.0) -> dict[str, torch.Tensor]:
    base = (ids % 1_000_003).double().reshape(-1, 1) + torch.arange(DIM, dtype=torch.float64)
    return {"embedding": (base + salt).float(), "adagrad.acc": (-base).float()}


def check_rows(t: DictTable, salt: float = 0.0) -> None:
    want = rows_for(t.ids, salt)
    for k, v in want.items():
        assert torch.equal(t.cols[k], v), f"slot {k}: loaded values differ from what was saved"


class Holder(torch.nn.Module):
    def __init__(self, table: DictTable, dense_value: float = 0.5):
        super().__init__()
        self.emb = table
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.fill_(dense_value)
            self.lin.bias.fill_(dense_value)


class Reader:
    """IO state: a reader position."""
    def __init__(self, pos=0):
        self.pos = pos

    def dump_io_state(self):
        return {"pos": self.pos}

    def load_io_state(self, s):
        self.pos = s["pos"]


class FaultyTable(DictTable):
    """Exports its first chunk, then raises or sleeps: a worker failing in the middle of writing."""

    def __init__(self, *a, fault=None, sleep_s=0.0, **kw):
        super().__init__(*a, **kw)
        self.fault, self.sleep_s = fault, sleep_s

    def export_chunks(self, slots, max_rows):
        rows = max(1, self.ids.numel() // 4) if self.fault else max_rows
        for i, chunk in enumerate(super().export_chunks(slots, rows)):
            if i == 1 and self.fault == "raise":
                raise RuntimeError("injected failure while writing shard")
            if i == 1 and self.fault == "sleep":
                time.sleep(self.sleep_s)
            yield chunk


def owned_table(rank: int, world: int, ids: torch.Tensor, cls=DictTable, salt: float = 0.0, **kw) -> DictTable:
    from recckpt import partition
    mine = ids[partition(ids, world) == rank]
    t = cls("emb", SPEC, **kw)
    t.set_rows(mine, rows_for(mine, salt))
    return t


def save_npy(path: str, arr: torch.Tensor) -> None:
    np.save(path, arr.numpy())
