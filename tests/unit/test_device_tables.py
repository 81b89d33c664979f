"""Tables on a device (issue 18): the device-agnostic path on the CPU, and the same checks on CUDA.

The CPU tests drive exactly the code a CUDA table runs (device handling in HashTable, the staging
pool, the host-to-device load path) with device="cpu". The CUDA tests skip, saying so, where torch
sees no CUDA device; they are complete and run unchanged on a GPU machine.

Tolerance of CUDA vs CPU numerics: both run the same float32 torch ops, but CUDA kernels may fuse or
reorder (sqrt, division, addcmul) and sum repeated ids with atomics in any order, so results differ
by a few ulps per step; after 20 steps we allow rtol=1e-4, atol=1e-5 on embeddings and optimizer
slots (float32 tables; documented in docs/SPARSE_STATE.md).
"""
from __future__ import annotations

import pytest
import torch

from recckpt import HashTable, SaveOptions, Saver, SparseAdagrad, SparseAdam
from recckpt.errors import CheckpointSaveError
from recckpt.state import initializers, staging
from recckpt.train.manager import CheckpointManager

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False here")
RTOL, ATOL = 1e-4, 1e-5
SMALL = SaveOptions(num_buckets=16, chunk_bytes=64, segment_bytes=4096, fsync=False)


class Model(torch.nn.Module):
    def __init__(self, *tables):
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)


def _train(table, opt, steps=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(-50, 50, (64,), generator=g)
        out = table(ids)
        w = torch.randn(out.shape, generator=g).to(out.device)
        (out.float() * w).sum().backward()
        opt.step()


def _table(device, name="t", dim=8, capacity=0):
    return HashTable(name, dim, initializer=initializers.uniform(-0.1, 0.1), device=device, capacity=capacity)


def _assert_same_rows(a: HashTable, b: HashTable, rtol=0.0, atol=0.0):
    ia, ib = a.ids(), b.ids()
    assert sorted(ia.tolist()) == sorted(ib.tolist())
    order_a, order_b = ia.argsort(), ib.argsort()
    assert a.slot_names == b.slot_names
    for s in a.slot_names:
        torch.testing.assert_close(a.slot(s).cpu()[order_a], b.slot(s).cpu()[order_b], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------- the table itself
def test_device_argument_is_checked():
    assert HashTable("t", 4).device == torch.device("cpu")
    assert HashTable("t", 4, device=torch.device("cpu")).slot("embedding").device.type == "cpu"
    with pytest.raises(ValueError, match="meta"):
        HashTable("t", 4, device="meta")
    with pytest.raises(ValueError, match="device"):
        HashTable("t", 4, device="no-such-device")
    if not CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            HashTable("t", 4, device="cuda")


@pytest.mark.parametrize("opt_cls", [SparseAdagrad, SparseAdam])
def test_explicit_cpu_device_trains_like_the_default(opt_cls):
    a = _table("cpu")
    b = HashTable("t", 8, initializer=initializers.uniform(-0.1, 0.1))
    torch.manual_seed(0)  # the initializer draws from the global generator as ids arrive
    _train(a, opt_cls([a]))
    torch.manual_seed(0)
    _train(b, opt_cls([b]))
    _assert_same_rows(a, b)
    assert a.ids().device.type == "cpu" and a.lookup(a.ids()).device.type == "cpu"


def _cuda_vs_cpu(opt_cls, dtype=torch.float32):
    torch.manual_seed(0)
    cpu = HashTable("t", 8, dtype=dtype, initializer=initializers.zeros())
    gpu = HashTable("t", 8, dtype=dtype, initializer=initializers.zeros(), device="cuda")
    # identical starting rows: initialise on the CPU and import them into both
    ids = torch.arange(-50, 50)
    init = {"embedding": (torch.rand(100, 8, generator=torch.Generator().manual_seed(1)) - 0.5).to(dtype)}
    cpu.import_rows(ids, init)
    gpu.import_rows(ids, init)
    _train(cpu, opt_cls([cpu]))
    _train(gpu, opt_cls([gpu]))
    return cpu, gpu


@needs_cuda
@pytest.mark.parametrize("opt_cls", [SparseAdagrad, SparseAdam])
def test_cuda_table_matches_cpu_numerics(opt_cls):
    cpu, gpu = _cuda_vs_cpu(opt_cls)
    assert gpu.slot("embedding").device.type == "cuda" and gpu.ids().device.type == "cpu"
    for s in gpu.slot_names:
        assert gpu.slot(s).device.type == "cuda", s
    _assert_same_rows(cpu, gpu, rtol=RTOL, atol=ATOL)


@needs_cuda
def test_cuda_table_eval_lookup_and_output_device():
    t = _table("cuda")
    t(torch.arange(10))
    t.eval()
    out = t(torch.tensor([3, 1000]))  # host ids: output on the host, zeros for the unseen id
    assert out.device.type == "cpu" and out[1].abs().sum() == 0
    assert t(torch.tensor([3], device="cuda")).device.type == "cuda"


# ------------------------------------------------------------------------- device-to-host staging


@pytest.fixture
def force_staging(monkeypatch):
    """Send host tensors through the staging buffers, as device tensors go: the CPU runs the GPU path."""
    monkeypatch.setattr(staging, "needs_staging", lambda t: True)


def _filled(n, dim=16, device="cpu", name="t"):
    t = _table(device, name=name, dim=dim, capacity=n)
    SparseAdam([t])  # adds adam.m and adam.v
    g = torch.Generator().manual_seed(n)
    ids = torch.randperm(4 * n, generator=g)[:n] - 2 * n
    t.import_rows(ids, {s: torch.randn(n, *t.slot_spec(s).shape, generator=g) for s in t.slot_names})
    return t


def test_staging_pool_never_holds_more_than_its_bound(force_staging):
    table = _filled(20000)  # 20000 rows x (8 + 3 x 64) bytes = 4 MB through a 64 KiB pool
    pool = staging.StagingPool(64 << 10)
    seen_ids, seen = [], {s: [] for s in table.slot_names}
    for piece in pool.stage(table.export_chunks(table.slot_names, 1 << 30), "table 't'"):
        assert piece.borrowed
        assert pool.allocated_bytes <= pool.max_bytes
        seen_ids.append(piece.ids.clone())
        for s, c in piece.cols.items():
            seen[s].append(c.clone())
    assert pool.peak_bytes <= 64 << 10 and pool.pieces >= 4 * 1000 * 1000 // (64 << 10)
    assert torch.equal(torch.cat(seen_ids), table.ids())
    for s in table.slot_names:
        assert torch.equal(torch.cat(seen[s]), table.slot(s))


def test_staging_reuses_buffers_and_pieces_are_whole_granules(force_staging):
    table = _filled(3000)
    pool = staging.StagingPool(32 << 10)
    ptrs = set()
    for piece in pool.stage(table.export_chunks(table.slot_names, 1 << 30), "t", row_multiple=16):
        assert piece.ids.shape[0] % 16 == 0 or piece.ids[-1] == table.ids()[-1]
        ptrs.add(piece.ids.data_ptr())  # ids come first in a buffer: its base address
    assert len(ptrs) <= 2  # double buffering: two buffers, reused for every piece
    first = pool.allocated_bytes
    list(pool.stage(table.export_chunks(table.slot_names, 1 << 30), "t"))
    assert pool.allocated_bytes == first  # a second save allocates nothing


def test_host_chunks_pass_through_without_copies():
    table = _filled(100)
    pool = staging.StagingPool(1 << 10)  # too small for a staged row: never used for host tensors
    (piece,) = list(pool.stage(table.export_chunks(table.slot_names, 1000), "t"))
    assert not piece.borrowed and pool.allocated_bytes == 0
    assert piece.cols["embedding"].data_ptr() == table.slot("embedding").data_ptr()


def test_staging_buffer_smaller_than_a_row_names_the_option(force_staging, tmp_path):
    table = _filled(10, dim=256)
    saver = Saver(Model(table), output_dir=str(tmp_path), options=SaveOptions(staging_bytes=1024, fsync=False))
    with pytest.raises(CheckpointSaveError, match="staging_bytes"):
        saver.save("c1")
    assert saver.checkpoints() == []


def _load_into(tmp_path, ckpt, device, **kw):
    t = _table(device, capacity=0, dim=16)
    SparseAdam([t])
    Saver(Model(t), output_dir=str(tmp_path)).load(ckpt_id=ckpt, **kw)
    return t


def test_staged_save_writes_the_same_checkpoint(force_staging, tmp_path, monkeypatch):
    table = _filled(5000)
    opts = SaveOptions(num_buckets=16, segment_bytes=64 << 10, staging_bytes=16 << 10, fsync=False)
    saver = Saver(Model(table), output_dir=str(tmp_path / "staged"), options=opts)
    saver.save("c1")
    assert saver._staging.pieces > 1 and saver._staging.peak_bytes <= 16 << 10
    monkeypatch.setattr(staging, "needs_staging", lambda t: t.device.type != "cpu")
    Saver(Model(table), output_dir=str(tmp_path / "plain"), options=opts).save("c1")
    for d in ("staged", "plain"):
        _assert_same_rows(_load_into(tmp_path / d, "c1", "cpu"), table)


def test_async_snapshot_goes_through_the_staging_pool(force_staging, tmp_path):
    table = _filled(4000)
    opts = SaveOptions(num_buckets=16, staging_bytes=16 << 10, fsync=False)
    saver = Saver(Model(table), output_dir=str(tmp_path), options=opts)
    mgr = CheckpointManager(saver, async_save=True)
    pool = mgr._buffers.staging() if hasattr(mgr, "_buffers") else None
    expected = {s: table.slot(s).clone() for s in table.slot_names}
    ids = table.ids()
    mgr.save()
    table.import_rows(ids[:100], {"embedding": torch.zeros(100, 16)})  # training goes on meanwhile
    mgr.wait()
    assert pool is not None and pool.pieces > 1 and pool.peak_bytes <= 16 << 10
    got = _load_into(tmp_path, saver.latest_checkpoint(), "cpu")
    order = got.lookup(ids)
    for s in table.slot_names:
        assert torch.equal(got.slot(s)[order], expected[s])


# ------------------------------------------------------------------------------ host-to-device loads
@pytest.fixture
def uploads(monkeypatch):
    """Counts the batches the loader copies host -> table storage through HostToDevice."""
    count = [0]
    orig = staging.HostToDevice.upload

    def spy(self, views, targets):
        count[0] += sum(v is not t for v, t in zip(views, targets)) > 0
        return orig(self, views, targets)
    monkeypatch.setattr(staging.HostToDevice, "upload", spy)
    return count


def _saved(tmp_path, table, **opts):
    saver = Saver(Model(table), output_dir=str(tmp_path), options=SaveOptions(num_buckets=16, fsync=False, **opts))
    saver.save("c1")
    return saver


@pytest.mark.parametrize("mmap", [False, True])
def test_load_through_host_buffers_gives_the_same_table(force_staging, uploads, tmp_path, mmap):
    table = _filled(3000)
    _saved(tmp_path, table)
    got = _load_into(tmp_path, "c1", "cpu", load_conf={"mmap": mmap})
    _assert_same_rows(got, table)
    if mmap:
        assert uploads[0] == 0  # a mapped load adopts the mapped storage instead of reading batches
    else:
        assert uploads[0] >= 1


def test_resharded_load_through_host_buffers(force_staging, uploads, tmp_path):
    table = _filled(3000)
    _saved(tmp_path, table)
    parts = [_load_into(tmp_path, "c1", "cpu", shard_id=r, shard_num=3) for r in range(3)]
    assert uploads[0] >= 3
    ids = torch.cat([p.ids() for p in parts])
    assert sorted(ids.tolist()) == sorted(table.ids().tolist())
    for p in parts:
        rows = table.lookup(p.ids())
        for s in table.slot_names:
            assert torch.equal(p.slot(s), table.slot(s)[rows])


def test_merge_load_into_a_table_uses_import_rows(force_staging, tmp_path):
    table = _filled(500)
    _saved(tmp_path, table)
    t = _table("cpu", dim=16)
    SparseAdam([t])
    t.import_rows(torch.tensor([10 ** 12]), {"embedding": torch.ones(1, 16)})
    Saver(Model(t), output_dir=str(tmp_path)).load(ckpt_id="c1", load_conf={"merge": True})
    assert len(t) == 501 and torch.equal(t.slot("embedding")[t.lookup(torch.tensor([10 ** 12]))], torch.ones(1, 16))


# ------------------------------------------------------------------------------------- CUDA checks
@needs_cuda
@pytest.mark.parametrize("mmap", [False, True])
def test_checkpoint_from_cuda_loads_on_cpu_and_back(tmp_path, mmap):
    gpu = _filled(20000, device="cuda")
    saver = _saved(tmp_path / "g", gpu, staging_bytes=64 << 10)
    assert saver._staging.pieces > 1 and saver._staging.peak_bytes <= 64 << 10
    cpu = _load_into(tmp_path / "g", "c1", "cpu", load_conf={"mmap": mmap})
    _assert_same_rows(cpu, gpu)
    _saved(tmp_path / "c", cpu)
    back = _load_into(tmp_path / "c", "c1", "cuda", load_conf={"mmap": mmap})
    assert back.slot("embedding").device.type == "cuda"
    _assert_same_rows(back, gpu)
    parts = [_load_into(tmp_path / "g", "c1", "cuda", shard_id=r, shard_num=3) for r in range(3)]
    assert sum(len(p) for p in parts) == len(gpu)


@needs_cuda
def test_cuda_table_trains_on_after_a_load(tmp_path):
    _, gpu = _cuda_vs_cpu(SparseAdam)
    _saved(tmp_path, gpu)
    t = HashTable("t", 8, initializer=initializers.zeros(), device="cuda")
    opt = SparseAdam([t])  # adds the slots the checkpoint holds (its step count is not saved here)
    Saver(Model(t), output_dir=str(tmp_path)).load(ckpt_id="c1")
    _assert_same_rows(t, gpu)
    _train(t, opt, steps=3, seed=5)  # growth and updates after the upload see the loaded rows
    assert len(t) >= len(gpu)


@needs_cuda
def test_cuda_async_snapshot_is_consistent(tmp_path):
    gpu = _filled(20000, device="cuda")
    saver = Saver(Model(gpu), output_dir=str(tmp_path), options=SaveOptions(num_buckets=16, fsync=False,
                                                                             staging_bytes=64 << 10))
    mgr = CheckpointManager(saver, async_save=True)
    expected = {s: gpu.slot(s).cpu().clone() for s in gpu.slot_names}
    ids = gpu.ids()
    mgr.save()
    gpu.import_rows(ids[:100], {"embedding": torch.zeros(100, 16)})
    mgr.wait()
    got = _load_into(tmp_path, saver.latest_checkpoint(), "cpu")
    order = got.lookup(ids)
    for s in gpu.slot_names:
        assert torch.equal(got.slot(s)[order], expected[s])


def test_staging_keeps_order_when_staged_and_host_chunks_mix(monkeypatch):
    # float32 tensors stand for device ones: ids (int64) pass through inside a staged piece, and
    # whole float64 chunks pass through between staged ones; the order of rows must not change.
    monkeypatch.setattr(staging, "needs_staging", lambda t: t.dtype == torch.float32)
    g = torch.Generator().manual_seed(3)
    chunks = []
    for i in range(6):
        n = 50 + 37 * i
        dtype = torch.float32 if i % 2 == 0 else torch.float64
        chunks.append((torch.arange(n) + 1000 * i, {"a": torch.randn(n, 5, generator=g).to(dtype)}))
    pool = staging.StagingPool(1024)  # 512-byte buffers: a few rows per piece
    got = [(p.ids.clone(), p.cols["a"].clone(), p.borrowed) for p in pool.stage(iter(chunks), "t")]
    assert torch.equal(torch.cat([i for i, _, _ in got]), torch.cat([i for i, _ in chunks]))
    assert torch.equal(torch.cat([c.double() for _, c, _ in got]), torch.cat([c["a"].double() for _, c in chunks]))
    assert {b for *_, b in got} == {True, False} and pool.peak_bytes <= 1024
