"""Running TorchRec jobs in real processes and reading back what TorchRec holds (no torchrec import here:
the test process stays free of it; the workers import it)."""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(ROOT, "tests", "helpers", "torchrec_child.py")
ZYGOTE = os.path.join(ROOT, "tests", "helpers", "zygote.py")

needs_torchrec = pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None,
    reason="torchrec/fbgemm-gpu-cpu not installed: run `bash scripts/install_torchrec.sh` (scripts/test.sh does)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Finished:
    """What a script run by `run_script` left: as subprocess.run's result."""
    returncode: int
    stdout: str
    stderr: str


class _Zygote:
    """The session's zygote.py process (started at first use, ended with the session)."""

    def __init__(self):
        self.logs = tempfile.mkdtemp(prefix="recckpt-zygote-")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(os.path.join(self.logs, "zygote.err"), "w"), cwd=ROOT, env=env)
        self.runs = 0
        self._pending = b""   # reply bytes read but not yet taken: replies are read from the raw pipe, so that
        # select() never waits on a line already pulled into a buffer

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _log(self) -> str:
        return open(os.path.join(self.logs, "zygote.err")).read()[-3000:]

    def _reply(self, timeout: float) -> dict | None:
        """The next reply line; None when none came within `timeout`. Raises if the zygote is gone."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the TorchRec test zygote exited (rc {self.proc.wait()}):\n{self._log()}")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _send(self, req: dict) -> None:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def run(self, req: dict, timeout: float) -> Finished:
        self.runs += 1
        out, err = (os.path.join(self.logs, f"{self.runs}.{k}") for k in ("out", "err"))
        self._send(dict(req, stdout=out, stderr=err))
        started = self._reply(600)   # the first request waits for the imports
        assert started, f"the zygote did not start a child within 600 s:\n{self._log()}"
        done = self._reply(timeout)
        if done is None:   # a hung job: end it and its ranks, then fail as subprocess.run would
            try:
                os.killpg(started["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._reply(60) is None:
                self.close()   # out of step with its replies: the next run starts a new one
            raise subprocess.TimeoutExpired(req.get("script") or "-c", timeout)
        return Finished(done["rc"], open(out).read(), open(err).read())

    def close(self):
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.logs, ignore_errors=True)


_zygote: _Zygote | None = None


def run_script(script: str | None = None, *, code: str | None = None, argv=(), timeout: float = 240,
               env: dict | None = None) -> Finished:
    """Run a worker script (or `-c` code) that imports TorchRec, as `python script argv...` would, in a child
    forked from one process that has imported TorchRec already (tests/helpers/zygote.py says why). The child
    gets this process's environment plus `env` (variables read only at import, such as OMP_NUM_THREADS, keep
    the zygote's values); the working directory is the repository root."""
    global _zygote
    if _zygote is None or not _zygote.alive():
        _zygote = _Zygote()
        atexit.register(_zygote.close)
    # the test process's environment now (a test may have changed it), as subprocess.run would pass it
    return _zygote.run({"script": script, "code": code, "argv": [str(a) for a in argv], "cwd": ROOT,
                        "env": {**os.environ, **(env or {})}}, timeout)


def run_jobs(tmp, world: int, jobs: list, timeout: int = 240) -> list:
    """Run `jobs` on `world` processes; judged by the files each rank writes (a rank may abort at exit)."""
    out = os.path.join(tmp, f"run_{world}_{free_port()}")
    os.makedirs(out)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"world": world, "port": free_port(), "out": out, "jobs": jobs}, f)
    proc = run_script(CHILD, argv=[spec], timeout=timeout)
    errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error_")]
    assert not errors, "a worker failed:\n" + "\n".join(errors)
    done = [os.path.join(out, f"done_{r}.json") for r in range(world)]
    missing = [d for d in done if not os.path.exists(d)]
    assert not missing, f"workers did not finish ({missing}); rc {proc.returncode}\n{proc.stderr[-4000:]}"
    return [json.load(open(d)) for d in done]


def load_dump(path: str) -> dict:
    """Merge every rank's dump into {table: {"weight": [N, D], "states": {name: [(offsets, tensor)]}}}."""
    merged: dict = {}
    for f in sorted(os.listdir(path)):
        part = torch.load(os.path.join(path, f), weights_only=True)
        for table, t in part.items():
            if table.startswith("mch:"):
                continue   # managed-collision tables, by raw id: load_mch_dump
            m = merged.setdefault(table, {"shape": t["shape"], "weight": [], "states": {}})
            m["weight"] += t["weight"]
            for k, pieces in t["states"].items():
                m["states"].setdefault(k, []).extend(pieces)
    return merged


def full(pieces, shape, dtype=None) -> torch.Tensor:
    """Assemble local shards [(offsets, tensor)] into the whole tensor (every element covered once)."""
    dtype = dtype or pieces[0][1].dtype
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    seen = torch.zeros(shape, dtype=torch.int32)
    for off, t in pieces:
        idx = tuple(slice(o, o + s) for o, s in zip(off, t.shape))
        out[idx] = t.to(torch.float64)
        seen[idx] += 1
    assert bool((seen == 1).all()), f"shards cover {int((seen == 0).sum())} elements 0 times, {int((seen > 1).sum())} twice"
    return out.to(dtype)


def column_shards(table) -> list:
    """[(c0, c1, per-row momentum)] of a column-wise table's RowWiseAdagrad state (a `load_dump` entry), one
    per column shard (its momentum1 is [rows x shards]: shard k's rows at offset k * rows, in column order)."""
    rows = table["shape"][0]
    cols = sorted({(off[1], off[1] + t.shape[1]) for off, t in table["weight"]})
    mom = {off[0] // rows: t for off, t in table["states"]["momentum1"]}
    assert sorted(mom) == list(range(len(cols)))
    return [(c0, c1, mom[k]) for k, (c0, c1) in enumerate(cols)]


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Exactly equal, element by element (NaN equal to NaN: an fp16 table trained into NaN still round-trips)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    diff = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {a.numel()} elements differ"


def load_mch_dump(path: str) -> dict:
    """Every rank's managed-collision dump merged: {table: {raw id: (weight row, {state: row}, {meta: value},
    rank)}}, and {table: {rank: capacity}}; a raw id held by two ranks fails."""
    merged: dict = {}
    caps: dict = {}
    for f in sorted(os.listdir(path)):
        part = torch.load(os.path.join(path, f), weights_only=True)
        for table, t in part.items():
            if not table.startswith("mch:"):
                continue
            rank = int(f[len("rank"):-len(".pt")])
            m = merged.setdefault(table[4:], {})
            caps.setdefault(table[4:], {})[rank] = t["capacity"]
            for i, raw in enumerate(t["ids"].tolist()):
                assert raw not in m, f"table {table}: raw id {raw} held twice"
                m[raw] = (t["weight"][i], {k: v[i] for k, v in t["states"].items()},
                          {k: int(v[i]) for k, v in t["meta"].items()}, rank)
    return merged, caps
