"""recckpt vs torch.distributed.checkpoint (DCP) on one TorchRec model, side by side (issue 27 item 4).

    python benchmarks/bench_torchrec.py [--rows 1000000] [--tables 8] [--dim 64] [--opts adagrad,rowwise]
                                        [--rounds 3] [--dir /tmp/x] [--json out.json]
                                        [--dcp-threads 1] [--concurrency 4] [--timeout 600]

A DistributedModelParallel model (an EBC of `--tables` tables, `--rows` rows in all, dim `--dim`, and a
small dense layer trained with Adam) is built on 2 gloo ranks, table-wise, with a fused Adagrad or
RowWiseAdagrad, and trained one step. Then, in the same processes, each round alternates the two:
- save: `recckpt.Saver(dmp).save()` vs `dcp.save` of TorchRec's documented state (model state_dict +
  fused optimizer state_dict + the dense optimizer's) with a `FileSystemWriter`; bytes on disk;
- load at the same world size, warm (page cache as the save left it) and cold (every file of both
  checkpoints dropped from the page cache with posix_fadvise DONTNEED first): `Saver.load()` vs `dcp.load`
  with a `FileSystemReader` followed by the `load_state_dict` calls TorchRec documents. Beside the cold
  loads, the disk's pace: each rank reads its own shard files of the recckpt checkpoint front to back in
  1 MiB reads (cache dropped first), no checks, no copies into the model; a cold load cannot beat it by
  much, so the cold ratio against DCP says how far DCP's load is from the disk;
- the async stall: `Saver.capture_copy` into reused host buffers (what `CheckpointManager(async_save=True)`
  does on the step that saves), against the sync save.
Each side runs at its own default: DCP's `FileSystemWriter` with one writer thread (`thread_count=1`) and
`sync_files=True`, recckpt's `Saver` with `concurrency=4` and fsync; `--dcp-threads` / `--concurrency`
change them. Every operation runs between barriers; its time is the slowest rank's, reported as the median
of the rounds with their range. Peak memory: the largest RSS
growth over the operation seen by a sampler thread (every 2 ms), on the worse rank.
Then 3 ranks build the model row-wise (and, for RowWiseAdagrad, column-wise: where DCP fails) and load the
2-rank checkpoints. After every load the table shards of the recckpt-loaded and the DCP-loaded model are
compared (they must be equal), so a fast wrong load cannot win.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ------------------------------------------------------------------------------------------ helpers
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """RSS growth peak over a block, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _drop_cache(*paths: str) -> None:
    for path in paths:
        for d, _, fs in os.walk(path):
            for f in fs:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _read_plain(paths: list) -> int:
    """Bytes of `paths` read front to back in 1 MiB reads (the disk's pace for a rank's share)."""
    buf, n = bytearray(1 << 20), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ model
def _build(a, world: int, rank: int, opt: str, plan_kind: str):
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    rows = a.rows // a.tables
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=a.dim, num_embeddings=rows,
                                                            feature_names=[f"f{i}"]) for i in range(a.tables)],
                                 device=torch.device("meta"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = ebc
            self.dense = torch.nn.Linear(a.dim * a.tables, 1)

        def forward(self, kjt):
            return self.dense(self.ebc(kjt).values()).sum()

    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward({"adagrad": torch.optim.Adagrad, "rowwise": RowWiseAdagrad}[opt],
                                model.ebc.parameters(), {"lr": 0.05})
    gens = {"tw": lambda i: table_wise(rank=i % world), "rw": lambda i: row_wise(),
            # two column shards a table, on ranks i, i+1 (a dim of 64 does not split in 3)
            "cw": lambda i: column_wise(ranks=[i % world, (i + 1) % world])}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {f"t{i}": gens[plan_kind](i) for i in range(a.tables)}, world_size=world, local_size=world,
        device_type="cpu")})
    torch.manual_seed(1 + rank)
    dmp = DistributedModelParallel(model, env=ShardingEnv(world, rank, dist.GroupMember.WORLD), plan=plan,
                                   device=torch.device("cpu"))
    # TorchRec's dense optimizer, keyed by parameter name (DCP cannot save torch's own optimizer state_dict,
    # whose param_groups hold parameter indices)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=0.01))
    return dmp, dense_opt


def _train_step(a, dmp, dense_opt, rank: int) -> None:
    import torch
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(7 + rank)
    batch = 256
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(a.tables)],
        values=torch.randint(0, a.rows // a.tables, (batch * a.tables,), generator=g),
        lengths=torch.ones(batch * a.tables, dtype=torch.int32))
    dense_opt.zero_grad()
    dmp(kjt).backward()
    dense_opt.step()


def _kjt(a, ids_per_table: list, batch: int):
    import torch
    from torchrec import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(a.tables)], values=torch.cat(ids_per_table),
                                               lengths=torch.ones(batch * a.tables, dtype=torch.int32))


def _phase_track(a, rank: int, world: int, res: dict) -> None:
    """Change tracking: the training step's cost with recckpt's lookup-path stamps, with TorchRec's
    ModelDeltaTrackerTrec (ID_ONLY), and with neither (three identical models, rounds interleaved); then
    an increment after steps that touch 5% of the rows, against a full save (bytes and time)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    import recckpt
    r = res.setdefault("tracking", {})
    rows = a.rows // a.tables
    models = {}
    for name in ("none", "recckpt", "delta_tracker"):
        models[name] = _build(a, world, rank, "adagrad", "tw")
    saver = recckpt.Saver(models["recckpt"][0], output_dir=os.path.join(a.dir, "track"), max_keep=None)
    saver.save("f0")     # its first mark installs the lookup hooks
    from recckpt.integrations.torchrec import tracking
    hook0 = tracking.hook_seconds(models["recckpt"][0])
    models["delta_tracker"][0].init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
    batch = 2048
    g = torch.Generator().manual_seed(11 + rank)
    for rnd in range(a.rounds * 3):
        names = list(models)
        names = names[rnd % 3:] + names[:rnd % 3]
        for name in names:
            dmp, dense_opt = models[name]
            kjts = [_kjt(a, [torch.randint(0, rows, (batch,), generator=g) for _ in range(a.tables)], batch)
                    for _ in range(5)]
            dist.barrier()
            t0 = time.perf_counter()
            for kjt in kjts:
                dense_opt.zero_grad()
                dmp(kjt).backward()
                dense_opt.step()
            dt = torch.tensor([(time.perf_counter() - t0) / len(kjts)], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            r.setdefault(f"step_{name}", []).append(float(dt))
            if name == "recckpt":
                hs = torch.tensor([(tracking.hook_seconds(dmp) - hook0) / len(kjts)], dtype=torch.float64)
                dist.all_reduce(hs, op=dist.ReduceOp.MAX)
                hook0 = tracking.hook_seconds(dmp)
                r.setdefault("hook_recckpt", []).append(float(hs))
    # an increment after steps that touch 5% of every table's rows (every rank feeds the same 5%)
    dmp, dense_opt = models["recckpt"]
    t_full, _, _ = _timed(lambda: saver.save("f1"), rank)
    hot = [torch.randperm(rows, generator=torch.Generator().manual_seed(3 + i))[:rows // 20] for i in range(a.tables)]
    for k in range(0, rows // 20, batch):
        n = min(batch, rows // 20 - k)
        kjt = _kjt(a, [h[k:k + n] for h in hot], n)
        dense_opt.zero_grad()
        dmp(kjt).backward()
        dense_opt.step()
    t_inc, _, _ = _timed(lambda: saver.save("i1", incremental=True), rank)
    if rank == 0:
        base = os.path.join(a.dir, "track")
        r["full_bytes"] = _dir_bytes(os.path.join(base, "f1"))
        r["incr_bytes"] = _dir_bytes(os.path.join(base, "i1"))
        r["incr_rows"] = saver.last_save.sparse_rows
        r["touched_rows"] = (rows // 20) * a.tables
        r["full_s"], r["incr_s"] = t_full, t_inc


def _dcp_state(dmp, dense_opt) -> dict:
    return {"model": dmp.state_dict(), "fused_optim": dmp.fused_optimizer.state_dict(),
            "dense_opt": dense_opt.state_dict()}


def _dcp_load(dmp, dense_opt, path: str) -> None:
    """TorchRec's documented DCP load: load into the live state dicts, then hand them back."""
    import torch.distributed.checkpoint as dcp
    state = _dcp_state(dmp, dense_opt)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["fused_optim"])
    dense_opt.load_state_dict(state["dense_opt"])


def _shards(dmp) -> dict:
    """Copies of this rank's table shards and fused optimizer shards, read from TorchRec."""
    out = {}
    for key, w in dmp.state_dict().items():
        if hasattr(w, "local_shards") and ".embedding_bags." in key:
            out[key] = [s.tensor.clone() for s in w.local_shards()]
    for key, st in dmp.fused_optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if hasattr(v, "local_shards"):
                out[f"{key}/{k}"] = [s.tensor.clone() for s in v.local_shards()]
    return out


def _scramble(dmp) -> None:
    """Overwrite every local table shard and optimizer shard, so a load that skips something shows."""
    import torch
    with torch.no_grad():
        for key, w in dmp.state_dict().items():
            if hasattr(w, "local_shards") and ".embedding_bags." in key:
                for s in w.local_shards():
                    s.tensor.fill_(-3.0)
        for st in dmp.fused_optimizer.state_dict()["state"].values():
            for v in st.values():
                if hasattr(v, "local_shards"):
                    for s in v.local_shards():
                        s.tensor.fill_(-5.0)


def _same(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
                                        for k in a)


# ------------------------------------------------------------------------------------------ worker
LAST_CPU: list[float] = [0.0]   # CPU seconds of the last _timed operation, all ranks together


def _cpu_seconds() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _timed(fn, rank: int) -> tuple:
    """(seconds of the slowest rank, RSS growth peak of the worse rank, fn's result); the CPU seconds every
    rank's process spent on it (getrusage, all threads, summed over ranks) go to LAST_CPU[0]."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    with PeakRSS() as p:
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        cpu = _cpu_seconds() - c0
    both = torch.tensor([dt, float(p.growth)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    total = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    LAST_CPU[0] = float(total[0])
    return float(both[0]), int(both[1]), res


def _phase_save(a, rank: int, world: int, opt: str, res: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import recckpt
    from recckpt.train.snapshot import HostBuffers
    dmp, dense_opt = _build(a, world, rank, opt, "tw")
    _train_step(a, dmp, dense_opt, rank)
    trained = _shards(dmp)
    r = res.setdefault(opt, {})
    for rnd in range(a.rounds):
        rk, dc = os.path.join(a.dir, opt, f"recckpt_{rnd}"), os.path.join(a.dir, opt, f"dcp_{rnd}")
        saver = recckpt.Saver(dmp, output_dir=rk, max_keep=None, concurrency=a.concurrency)
        saver.register_for_checkpointing("dense_opt", dense_opt)

        def save_rk():
            saver.save("c")

        def save_dcp():
            dcp.save(_dcp_state(dmp, dense_opt), storage_writer=dcp.FileSystemWriter(dc, thread_count=a.dcp_threads))
        order = [("recckpt", save_rk), ("dcp", save_dcp)]
        for name, fn in (order if rnd % 2 == 0 else order[::-1]):
            t, mem, _ = _timed(fn, rank)
            r.setdefault(f"save_{name}", []).append(t)
            r.setdefault(f"save_cpu_{name}", []).append(LAST_CPU[0])
            r.setdefault(f"save_mem_{name}", []).append(mem)
        if rank == 0:
            r["bytes_recckpt"] = _dir_bytes(rk)
            r["bytes_dcp"] = _dir_bytes(dc)
        for temp in ("warm", "cold"):
            loads = [("recckpt", lambda: saver.load()), ("dcp", lambda: _dcp_load(dmp, dense_opt, dc))]
            for name, fn in (loads if rnd % 2 == 0 else loads[::-1]):
                _scramble(dmp)
                if temp == "cold":
                    dist.barrier()
                    if rank == 0:
                        _drop_cache(rk, dc)
                t, mem, _ = _timed(fn, rank)
                r.setdefault(f"load_{temp}_{name}", []).append(t)
                r.setdefault(f"load_{temp}_cpu_{name}", []).append(LAST_CPU[0])
                r.setdefault(f"load_mem_{temp}_{name}", []).append(mem)
                ok = _same(_shards(dmp), trained)
                r.setdefault("loads_exact", []).append(ok)
                if not ok:
                    raise AssertionError(f"{opt}: the {temp} {name} load did not restore the trained shards")
            if temp == "cold":   # the disk's pace for this rank's share, in the same round
                mine = sorted(glob.glob(os.path.join(rk, "c", "sparse", f"shard-{rank:05d}-*.bin")))
                if not mine:
                    raise AssertionError(f"rank {rank}: no shard files of its own under {rk}/c/sparse")
                dist.barrier()
                if rank == 0:
                    _drop_cache(rk)
                t, _, nread = _timed(lambda: _read_plain(mine), rank)
                both = torch.tensor([nread], dtype=torch.int64)
                dist.all_reduce(both, op=dist.ReduceOp.SUM)
                r.setdefault("read_cold_plain", []).append(t)
                r.setdefault("read_cold_plain_bytes", []).append(int(both[0]))
        # The async stall: the step that saves copies the state into reused host buffers.
        bufs = HostBuffers()
        for i in range(2):
            t, mem, snap = _timed(lambda: saver.capture_copy(bufs, rank), rank)
            r.setdefault("stall_first" if i == 0 else "stall_reused", []).append(t)
            if i:
                r.setdefault("stall_mem", []).append(mem)
        tw, _, _ = _timed(lambda: saver.write("async", snap), rank)
        r.setdefault("async_write", []).append(tw)
        if rnd < a.rounds - 1:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(rk)   # keep the last round's checkpoints for the 3-rank loads
                shutil.rmtree(dc)


def _phase_reshard(a, rank: int, world: int, opt: str, plan_kind: str, res: dict) -> None:
    import recckpt
    dmp, dense_opt = _build(a, world, rank, opt, plan_kind)
    # One step first, for DCP: it loads into the live state dicts, and a KeyedOptimizer with no state yet gives
    # it nothing to load into (recckpt's load initialises that state itself: no step needed).
    _train_step(a, dmp, dense_opt, rank)
    rk, dc = os.path.join(a.dir, opt, f"recckpt_{a.rounds - 1}"), os.path.join(a.dir, opt, f"dcp_{a.rounds - 1}")
    r = res.setdefault(opt, {})
    key = f"reshard_{plan_kind}3"
    saver = recckpt.Saver(dmp, output_dir=rk, max_keep=None, concurrency=a.concurrency)
    saver.register_for_checkpointing("dense_opt", dense_opt)
    got = {}
    for rnd in range(a.rounds):
        for name, fn in [("recckpt", lambda: saver.load(ckpt_id="c")), ("dcp", lambda: _dcp_load(dmp, dense_opt, dc))]:
            if r.get(f"{key}_{name}_error"):
                continue
            _scramble(dmp)
            try:
                t, mem, _ = _timed(fn, rank)
            except BaseException as e:  # noqa: BLE001 - DCP's errors are BaseExceptions; reported, not raised
                # DCP's CheckpointException carries each rank's traceback: keep its first line and the cause
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                cause = next((x for x in reversed(lines) if "Error" in x.split(":")[0]), "")
                r[f"{key}_{name}_error"] = f"{type(e).__name__}: {lines[0][:120] if lines else ''} {cause[:240]}"
                import torch.distributed as dist
                dist.barrier()
                continue
            r.setdefault(f"{key}_{name}", []).append(t)
            r.setdefault(f"{key}_cpu_{name}", []).append(LAST_CPU[0])
            r.setdefault(f"{key}_mem_{name}", []).append(mem)
            got[name] = _shards(dmp)
    if "recckpt" in got and "dcp" in got:
        r[f"{key}_equal"] = _same(got["recckpt"], got["dcp"])


def _worker(rank: int, world: int, a, phase: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
    res: dict = {}
    try:
        for opt in a.opts.split(","):
            if phase == "track":
                if opt == "adagrad":
                    _phase_track(a, rank, world, res)
            elif phase == "save":
                _phase_save(a, rank, world, opt, res)
            else:
                for plan_kind in (["rw", "cw"] if opt == "rowwise" else ["rw"]):
                    _phase_reshard(a, rank, world, opt, plan_kind, res)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    except BaseException:
        with open(f"{out}.error{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    dist.destroy_process_group()


def _spawn(a, world: int, phase: str) -> dict:
    import torch.multiprocessing as mp
    out = os.path.join(a.dir, f"{phase}.json")
    a.port = _free_port()
    try:
        mp.spawn(_worker, args=(world, a, phase, out), nprocs=world)
    except Exception:
        errs = [open(os.path.join(a.dir, f)).read() for f in os.listdir(a.dir) if f.startswith(f"{phase}.json.error")]
        if errs:
            raise RuntimeError("a benchmark rank failed:\n" + "\n".join(errs)) from None
        if not os.path.exists(out):   # a rank that aborts at exit after writing its results is fine
            raise
    return json.load(open(out))


# ------------------------------------------------------------------------------------------ report
def _best(v):
    return min(v) if v else float("nan")


def _median(v):
    v = sorted(v)
    if not v:
        return float("nan")
    k = len(v) // 2
    return v[k] if len(v) % 2 else (v[k - 1] + v[k]) / 2


def report(a, res: dict) -> dict:
    targets = {}
    lines = [f"{a.tables} EBC tables, {a.rows} rows in all, dim {a.dim}; 2 ranks table-wise; median of {a.rounds} "
             f"rounds [min-max] (slowest rank; ratio and targets on the medians); memory = peak RSS growth of the "
             f"worse rank during the operation (median); DCP FileSystemWriter thread_count={a.dcp_threads}, "
             f"recckpt concurrency {a.concurrency}"]
    head = f"{'':34}{'recckpt':>26}{'DCP':>26}{'DCP/recckpt':>13}"
    tr = res.get("tracking")
    if tr:
        med = {k: sorted(v)[len(v) // 2] for k, v in tr.items() if k.startswith("step_")}
        lines += ["", "change tracking (fused Adagrad, TW@2, 2048 ids per table per step, median step)"]
        for k, v in med.items():
            lines.append(f"  {k[5:]:16} {v * 1e3:8.2f} ms  ({v / med['step_none'] - 1:+.1%} vs none)")
        hook = sorted(tr["hook_recckpt"])[len(tr["hook_recckpt"]) // 2]
        lines.append(f"  recckpt's hooks themselves: {hook * 1e3:.3f} ms a step = {hook / med['step_none']:.2%} of a "
                     f"step without tracking (timed inside the hooks: robust to the machine's noise)")
        targets["tracking.step_overhead"] = (hook / med["step_none"], "<=", 0.05)
        ratio = tr["incr_bytes"] / tr["full_bytes"]
        lines.append(f"  increment after 5% of rows touched: {tr['incr_rows']} rows (touched {tr['touched_rows']}), "
                     f"{tr['incr_bytes'] / 2**20:.1f} MB vs full {tr['full_bytes'] / 2**20:.1f} MB = {ratio:.3f}; "
                     f"{tr['incr_s']:.2f} s vs {tr['full_s']:.2f} s")
        targets["tracking.increment_bytes_vs_full"] = (ratio, "<=", 0.1)
    for opt, r in res.items():
        if opt == "tracking":
            continue
        lines += ["", f"fused {opt}", head]

        def row(label, key, unit="s", scale=1.0):
            xs, ys = r.get(f"{key}_recckpt", []), r.get(f"{key}_dcp", [])
            err = r.get(f"{key}_dcp_error") or (not ys and "no DCP run")
            x, y = _median(xs), (None if err else _median(ys))

            def cell(v, m):
                return f"{m / scale:.3f}{unit.strip()}" + (f" [{min(v) / scale:.2f}-{max(v) / scale:.2f}]" if len(v) > 1 else "")
            ytxt = "fails" if err else cell(ys, y)
            ratio = "-" if err else f"{y / x:.2f}x"
            lines.append(f"{label:34}{cell(xs, x):>26}{ytxt:>26}{ratio:>13}")
            return (y / x) if not err else None
        mb = 1 << 20
        lines.append(f"{'bytes (MB)':34}{r['bytes_recckpt'] / mb:>26.1f}{r['bytes_dcp'] / mb:>26.1f}"
                     f"{r['bytes_dcp'] / r['bytes_recckpt']:>12.2f}x")
        targets[f"{opt}.bytes_vs_dcp"] = (r["bytes_recckpt"] / r["bytes_dcp"], "<=", 1.05)
        targets[f"{opt}.save_speedup"] = (row("save", "save"), ">=", 1.5)
        row("  CPU s, all ranks", "save_cpu")
        targets[f"{opt}.load_warm_speedup"] = (row("load @2, warm", "load_warm"), ">=", 1.2)
        row("  CPU s, all ranks", "load_warm_cpu")
        targets[f"{opt}.load_cold_speedup"] = (row("load @2, cold (cache dropped)", "load_cold"), ">=", 1.2)
        row("  CPU s, all ranks", "load_cold_cpu")
        if r.get("read_cold_plain"):
            f, x, y = _median(r["read_cold_plain"]), _median(r["load_cold_recckpt"]), _median(r["load_cold_dcp"])
            lines.append(f"{'  plain read of rank files, cold':34}{f:>25.3f}s   (the disk's pace: recckpt's cold load "
                         f"{f / x:.2f}x it, DCP's {f / y:.2f}x)")
        for kind in ("rw", "cw"):
            key = f"reshard_{kind}3"
            if f"{key}_recckpt" in r or f"{key}_recckpt_error" in r:
                s = row(f"load TW@2 -> {kind.upper()}@3", key)
                row("  CPU s, all ranks", f"{key}_cpu")
                if kind == "rw":
                    targets[f"{opt}.reshard_speedup"] = (s, ">=", 1.5)
                if r.get(f"{key}_dcp_error"):
                    lines.append(f"{'':4}DCP: {r[f'{key}_dcp_error']}")
                if r.get(f"{key}_recckpt_error"):
                    lines.append(f"{'':4}recckpt: {r[f'{key}_recckpt_error']}")
                if f"{key}_equal" in r:
                    lines.append(f"{'':4}recckpt's and DCP's loaded shards equal: {r[f'{key}_equal']}")
        row("peak RSS growth, save (MB)", "save_mem", " ", mb)
        row("peak RSS growth, load warm (MB)", "load_mem_warm", " ", mb)
        row("peak RSS growth, load @3 RW (MB)", "reshard_rw3_mem", " ", mb)
        st, sy = _median(r["stall_reused"]), _median(r["save_recckpt"])
        lines.append(f"{'async stall (reused buffers)':34}{st:>11.3f}s   = {st / sy:.2f} of a sync save "
                     f"({_best(r['stall_first']):.3f}s the first time; host buffers "
                     f"+{_best(r['stall_mem']) / mb:.0f} MB on the reused copy)")
        lines.append(f"{'every load restored the shards':34}{all(r['loads_exact'])}")
    lines += ["", "targets:"]
    out = {}
    for name, (v, op, bound) in targets.items():
        met = v is not None and (v <= bound if op == "<=" else v >= bound)
        out[name] = {"value": v, "target": f"{op} {bound}", "met": met}
        lines.append(f"  {name:32} {('n/a' if v is None else f'{v:.2f}'):>6} (target {op} {bound}): "
                     f"{'met' if met else 'NOT met'}")
    print("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--opts", default="adagrad,rowwise")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dcp-threads", type=int, default=1,
                    help="DCP FileSystemWriter thread_count (default 1: FileSystemWriter's own default)")
    ap.add_argument("--concurrency", type=int, default=4, help="recckpt Saver concurrency (default 4: Saver's own)")
    ap.add_argument("--phases", default="save,track", help="save (save/load/reshard vs DCP), track (tracking)")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds a rank waits in a collective before failing (gloo's timeout; default 600)")
    a = ap.parse_args(argv)
    keep = a.dir is not None
    a.dir = a.dir or tempfile.mkdtemp(prefix="recckpt-bench-torchrec-")
    shutil.rmtree(a.dir, ignore_errors=True)    # checkpoints of an earlier run would be refused
    os.makedirs(a.dir)
    try:
        res = {}
        if "track" in a.phases:
            res.update(_spawn(a, 2, "track"))
        if "save" in a.phases:
            res.update(_spawn(a, 2, "save"))
            for opt, r in _spawn(a, 3, "reshard").items():
                res[opt].update(r)
        targets = report(a, res)
        out = {"args": vars(a), "results": res, "targets": targets}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return out
    finally:
        if not keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
