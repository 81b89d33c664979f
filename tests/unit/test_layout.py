"""The segment layout rules (recckpt/format/layout.py), the read options and requests, checked against
what the engine really writes and reads."""
import numpy as np
import pytest
import torch

from helpers.tables import DictTable
from recckpt import _C, ReadOptions, SaveOptions, Saver
from recckpt.format import layout
from recckpt.format.checkpoint import CheckpointReader
from recckpt.format.schema import Column
from recckpt.format.sparse_io import ReadRequest
from recckpt.state.protocol import SlotSpec
from recckpt.storage import open_storage


def test_rules():
    assert layout.COLUMN_ALIGN == _C.COLUMN_ALIGN
    assert [layout.align_up(x) for x in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    assert layout.column_start(100, 1, 8, 2) == 4096      # a non-empty slot column is aligned
    assert layout.column_start(100, 1, 0, 2) == 100       # an empty one is not
    assert layout.column_start(100, 0, 8, 2) == 100       # nor the ids column
    assert layout.column_start(100, 1, 8, 1) == 100       # nor anything in version 1
    assert layout.pad_before(100, 4096, 1, 2) == 3996
    assert layout.pad_before(100, 4096, 1, 1) == 0 and layout.pad_before(100, 4096, 0, 2) == 0
    assert layout.segment_rows(1 << 20, [256]) % layout.row_granule([256]) == 0
    assert layout.segment_rows(100, [256]) == 1           # fewer than a granule fit: as many as fit, >= 1
    assert layout.granule_cut(35, 16) == 32 and layout.granule_cut(32, 16) == 32
    # a chunk that will be packed (fewer than PACK_BELOW bytes) is not cut: alignment does not apply to it
    small = -(-layout.PACK_BELOW // 200) - 1   # the most rows of 200 bytes that are packed
    assert layout.granule_cut(small, 16, 200) == small and layout.granule_cut(small + 1, 16, 200) == small + 1 - (
        small + 1) % 16


def test_engine_writes_what_the_layout_says(tmp_path):
    slots = {"embedding": SlotSpec(torch.float32, (3,), "sparse"), "cnt": SlotSpec(torch.int32, (), "sparse"),
             "none": SlotSpec(torch.int8, (0,), "sparse")}
    t = DictTable("t", slots)
    ids = torch.arange(1000, dtype=torch.int64) * 7919 - 5000
    t.set_rows(ids, {"embedding": torch.randn(1000, 3), "cnt": torch.arange(1000, dtype=torch.int32),
                     "none": torch.empty(1000, 0, dtype=torch.int8)})
    Saver(torch.nn.ModuleDict({"t": t}), output_dir=str(tmp_path),
          options=SaveOptions(num_buckets=8, segment_bytes=4000, fsync=False)).save("c")
    index = CheckpointReader(open_storage(str(tmp_path / "c")), "").index
    segs = index.tables["t"][1]
    assert len(segs) > 1
    granule = layout.row_granule([12, 4, 0])
    for s in segs[:-1]:
        assert s.rows % granule == 0 or s.rows < granule
    for s in segs:   # 4000-byte segments are packed (format version 4): contiguous columns
        assert s.packed
        assert s.columns[0].offset == s.offset + 8 * s.dir_entries
        for k in range(1, len(s.columns)):
            prev, col = s.columns[k - 1], s.columns[k]
            assert col.offset == prev.offset + prev.length
    # Bigger segments are aligned: each non-empty slot column starts on a page.
    ids = torch.arange(4000, dtype=torch.int64) * 7919 - 5000
    t.set_rows(ids, {"embedding": torch.randn(4000, 3), "cnt": torch.arange(4000, dtype=torch.int32),
                     "none": torch.empty(4000, 0, dtype=torch.int8)})
    Saver(torch.nn.ModuleDict({"t": t}), output_dir=str(tmp_path),
          options=SaveOptions(num_buckets=8, segment_bytes=2 * layout.PACK_BELOW, fsync=False)).save("d")
    index = CheckpointReader(open_storage(str(tmp_path / "d")), "").index
    big = [s for s in index.tables["t"][1] if s.rows * 24 >= layout.PACK_BELOW]
    assert big and all(not s.packed for s in big)
    for s in big:
        for k in range(1, len(s.columns)):
            prev, col = s.columns[k - 1], s.columns[k]
            assert col.offset == layout.column_start(prev.offset + prev.length, k, col.length, index.format_version)
            if col.length:
                assert col.offset % layout.COLUMN_ALIGN == 0


def test_pack_threshold_and_checksum_steps_are_the_engines():
    assert layout.PACK_BELOW == _C.PACK_BELOW
    lengths = np.array([0, 1, 64 * 512, 64 * 512 + 1, 10**6, 64 << 18, 10**12], dtype=np.int64)
    for chunk in (64, 1000, 256 << 10):
        want = [_C.column_step(int(n), chunk) for n in lengths]
        assert [layout.checksum_step(int(n), chunk) for n in lengths] == want
        assert layout.checksum_steps(lengths, chunk).tolist() == want
    assert layout.checksum_step(10**6, 256 << 10) == 16384      # ceil(10**6 / 64) -> 2**14
    assert layout.checksum_step(100, 256 << 10) == layout.MIN_STEP


def test_read_request_for_engine_reads_a_column(tmp_path):
    data = np.arange(3000, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096) + data.tobytes())
    col = Column(4096, 3000, tuple(int(c) for c in _C.crc32c_chunks(data, 1000)))
    req = ReadRequest(0, col, 500, 2500, "slot 'x'", 1000, pad=4096)
    dst = np.empty(req.nbytes, np.uint8)
    nread, errors = _C.read_ranges([req.for_engine(str(path), dst)], 1)
    assert errors == [] and np.array_equal(dst, data[500:2500])


@pytest.mark.parametrize("kw", [{"batch_bytes": 0}, {"readahead_bytes": -1}, {"batch_bytes": 1.5},
                                {"readahead_bytes": True}, {"whole_file_fraction": 0},
                                {"whole_file_fraction": "all"}, {"whole_file_fraction": True}])
def test_read_options_validate(kw):
    with pytest.raises(ValueError, match="ReadOptions"):
        ReadOptions(**kw)


def test_saver_rejects_wrong_read_options(tmp_path):
    with pytest.raises(TypeError, match="read_options"):
        Saver(torch.nn.Module(), output_dir=str(tmp_path), read_options={"batch_bytes": 1})
