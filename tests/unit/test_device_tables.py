"""Tables on a device (issue 18): the device-agnostic path on the CPU, and the same checks on CUDA.

The CPU tests drive exactly the code a CUDA table runs (device handling in HashTable, the staging
pool, the host-to-device load path) with device="cpu". The CUDA tests skip, saying so, where torch
sees no CUDA device; they are complete and run unchanged on a GPU machine.

Tolerance of CUDA vs CPU numerics: both run the same float32 torch ops, but CUDA kernels may fuse or
reorder (sqrt, division, addcmul), so results differ by a few ulps per step; after 20 steps we allow
rtol=1e-5, atol=1e-6 on embeddings and optimizer slots (float32 tables; documented in
docs/SPARSE_STATE.md).
"""
from __future__ import annotations

import pytest
import torch

from recckpt import HashTable, Saver, SaveOptions, SparseAdagrad, SparseAdam
from recckpt.state import initializers

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False here")
RTOL, ATOL = 1e-5, 1e-6
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
