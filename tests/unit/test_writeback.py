"""ShardWriter(writeback=True): each written block's range is handed to the device right away
(sync_file_range), so a save's final fsync finds little dirty data left (docs/ENGINE.md)."""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
import pytest

from recckpt import _C

_libc = ctypes.CDLL(None, use_errno=True)
_CACHESTAT = 451   # the same number on every architecture since Linux 6.5


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def dirty_pages(path: str) -> tuple[int, int]:
    """(dirty pages, cached pages) of the whole file, from the kernel's cachestat."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = _Stat()
        if _libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) != 0:
            pytest.skip(f"cachestat is not available here (errno {ctypes.get_errno()}): cannot see dirty pages")
        return st.dirty, st.cache
    finally:
        os.close(fd)


def write(path: str, writeback: bool, rows: int = 400_000) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1 << 60, rows, dtype=np.int64)
    cols = [rng.standard_normal((rows, 32), dtype=np.float32).view(np.uint8)]   # ~51 MB of rows
    w = _C.ShardWriter([path], 64, 1 << 20, 1 << 30, writeback)
    w.submit(0, ids, cols)
    w.finish(False)   # no fsync: what is left dirty is what writeback did not start


@pytest.mark.skipif(platform.system() != "Linux", reason="sync_file_range and cachestat are Linux's")
def test_writeback_leaves_little_dirty_data_for_the_final_fsync(tmp_path):
    a, b = str(tmp_path / "wb.bin"), str(tmp_path / "plain.bin")
    write(a, True)
    dirty, cached = dirty_pages(a)
    assert cached > 0
    assert dirty <= cached // 10, f"{dirty} of {cached} pages still dirty after writing with writeback"
    write(b, False)
    assert open(a, "rb").read() == open(b, "rb").read()   # the same bytes either way
