"""A load of every bucket reads each segment's bucket directory in the same engine call as its rows (not
in a call of its own before them), and still refuses a directory that fails its CRC or its rule, naming
the shard file."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers.hostile import _parsed_index, flip_byte, resign_segment_crcs
from recckpt import HashTable, SaveOptions, Saver
from recckpt.errors import CorruptCheckpointError
from recckpt.format import sparse_io
from recckpt.format.checkpoint import CheckpointReader
from recckpt.format.sparse_io import ReadOptions
from recckpt.storage import open_storage

ROWS = 5000


def _model(fill: bool) -> torch.nn.Module:
    m = torch.nn.Module()
    m.add_module("t", HashTable("t", dim=8))
    if fill:
        with torch.no_grad():
            m.t(torch.arange(ROWS, dtype=torch.int64) * 7919)
    return m


def _saved(tmp_path) -> tuple[torch.nn.Module, str]:
    src = _model(True)
    out = str(tmp_path / "out")
    return src, Saver(src, output_dir=out, options=SaveOptions(fsync=False)).save("c")


def _engine_calls(monkeypatch) -> list[int]:
    calls = []
    real = sparse_io.SegmentReader._read_plain

    def counting(self, table, reqs, dsts, map_into):
        calls.append(len(reqs))
        return real(self, table, reqs, dsts, map_into)

    monkeypatch.setattr(sparse_io.SegmentReader, "_read_plain", counting)
    return calls


def test_a_whole_table_is_one_engine_call_with_its_directory(tmp_path, monkeypatch):
    src, path = _saved(tmp_path)
    segs = _parsed_index(path).tables["t"][1]
    assert segs and all(seg.dir_entries > 0 for seg in segs)   # each with a directory to check
    calls = _engine_calls(monkeypatch)
    dst = _model(False)
    Saver(dst, output_dir=str(tmp_path / "out")).load()
    # one call: each segment's directory, ids and embedding slot together (before: the directories first)
    assert calls == [3 * len(segs)]
    ids = src.t.ids()
    assert torch.equal(dst.t.read_rows("embedding", dst.t.lookup(ids)), src.t.read_rows("embedding", src.t.lookup(ids)))


def test_a_flipped_directory_byte_fails_the_load_naming_its_file(tmp_path):
    _, path = _saved(tmp_path)
    doc = _parsed_index(path)
    seg = doc.tables["t"][1][0]
    shard = os.path.join(path, doc.files[seg.file][0])
    flip_byte(shard, seg.buckets.offset + 5)
    dst = _model(False)
    with pytest.raises(CorruptCheckpointError) as e:
        Saver(dst, output_dir=str(tmp_path / "out")).load()
    assert doc.files[seg.file][0] in str(e.value) and "bucket offsets" in str(e.value), str(e.value)
    assert len(dst.t) == 0   # nothing was applied


def test_a_directory_that_breaks_its_rule_fails_the_load_even_with_good_crcs(tmp_path):
    _, path = _saved(tmp_path)
    doc = _parsed_index(path)
    seg = doc.tables["t"][1][0]
    shard = os.path.join(path, doc.files[seg.file][0])
    with open(shard, "r+b") as f:   # two bucket numbers swapped: no longer increasing
        f.seek(seg.buckets.offset)
        b = np.frombuffer(f.read(8 * seg.dir_entries), dtype="<u4").copy()
        b[[1, 2]] = b[[2, 1]]
        f.seek(seg.buckets.offset)
        f.write(b.tobytes())
    resign_segment_crcs(path, "t")   # as an attacker would: every CRC matches the edited bytes
    dst = _model(False)
    with pytest.raises(CorruptCheckpointError, match="not a valid partition") as e:
        Saver(dst, output_dir=str(tmp_path / "out")).load()
    assert doc.files[seg.file][0] in str(e.value)
    assert len(dst.t) == 0


def _segment_reader(path: str, batch_bytes: int):
    r = CheckpointReader(open_storage(path), "", read_options=ReadOptions(batch_bytes=batch_bytes))
    return r, r.segments


def test_a_bad_last_directory_stops_the_read_before_any_batch_when_the_table_is_several(tmp_path):
    # Several batches (found by a review): the directories are then read first, as before, so that no
    # batch of rows is handed out before a later segment's directory is found bad.
    src = _model(False)
    with torch.no_grad():
        src.t(torch.arange(20000, dtype=torch.int64) * 7919)
    path = Saver(src, output_dir=str(tmp_path / "out"), options=SaveOptions(fsync=False)).save("c")
    r, seg_reader = _segment_reader(path, batch_bytes=1)
    segs = r.index.tables["t"][1]
    assert len(segs) >= 2
    flip_byte(os.path.join(path, r.index.files[segs[-1].file][0]), segs[-1].buckets.offset + 5)
    handed_out = 0
    with pytest.raises(CorruptCheckpointError, match="bucket offsets"):
        for batch in seg_reader.batches("t", [], [], dirs_with_rows=True):
            handed_out += len(seg_reader.read_batch(batch)[0])
    assert handed_out == 0


def test_a_directory_of_a_segment_without_rows_is_still_checked(tmp_path):
    # A segment of no rows (recckpt never writes one; an edited index can claim one) has nothing to read
    # its directory with: it is checked alone (found by a review: it had gone unchecked).
    import dataclasses
    _, path = _saved(tmp_path)
    r, seg_reader = _segment_reader(path, batch_bytes=1 << 30)
    slots, segs = r.index.tables["t"]
    r.index.tables["t"] = (slots, [dataclasses.replace(seg, rows=0) for seg in segs])
    with pytest.raises(CorruptCheckpointError, match="not a valid partition of 0 rows"):
        for batch in seg_reader.batches("t", [], [], dirs_with_rows=True):
            seg_reader.read_batch(batch)
