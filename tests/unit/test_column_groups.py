"""Format version 5's column groups and row runs through recckpt's readers (docs/FORMAT.md), with a fake
fixed-size table saved with whole rows (a row-wise or table-wise TorchRec plan) and loaded by processes
that hold a column range (a column-wise plan): each reads only the groups of its columns and no ids, from a
local disk and from an object store; a corrupt group fails the load naming the file; the model-free tools
and the independent reader read the rows, the latter a column window as the format says."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from spec import independent_reader as R

import recckpt
from helpers.fake_tables import Holder, RecordsImports
from helpers.pagecache import drop_cache
from recckpt import SaveOptions, Saver
from recckpt.errors import CorruptCheckpointError
from recckpt.format.checkpoint import CheckpointReader
from recckpt.format.sparse_io import ReadOptions
from recckpt.state.protocol import RowRangeLayout, SlotSpec, SparseTableMeta
from recckpt.storage import open_storage

N, D = 20_000, 24
OPTS = SaveOptions(num_buckets=1024, fsync=False, segment_bytes=1 << 20)


def full_rows():
    ids = np.arange(N, dtype=np.int64)
    return {"embedding": (ids[:, None] * 0.5 + np.arange(D)).astype(np.float32),
            "adagrad.acc": (ids[:, None] % 11 + np.arange(D) * 0.25).astype(np.float32),
            "rowwise": (ids % 17).astype(np.float32)}


class Fixed(RecordsImports, torch.nn.Module):
    """Rows `owned` of N, columns `columns` of the split slots (None: all)."""

    def __init__(self, owned=((0, N),), columns=None):
        super().__init__()
        # a column-wise plan's layout names every process's columns
        self.layout = RowRangeLayout(N, owned, columns, False, None if columns is None else _blocks(columns))
        self.slots = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
                      "adagrad.acc": SlotSpec(torch.float32, (D,), "sparse_opt"),
                      "rowwise": SlotSpec(torch.float32, (), "sparse_opt")}
        self.rows = {}

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta("t", self.slots, self.layout.owned_count)

    def export_chunks(self, slots, max_rows):
        cols = full_rows()
        for a, b in self.layout.owned_rows:
            for s in range(a, b, max_rows):
                e = min(b, s + max_rows)
                yield torch.arange(s, e), {k: torch.from_numpy(cols[k][s:e]) for k in slots}


def _blocks(columns):
    a, b = columns
    return tuple(x for x in ((0, a), (a, b), (b, D)) if x[1] > x[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("groups")
    Saver(Holder(Fixed()), output_dir=str(out), options=OPTS).save("c")
    return out


def test_a_whole_row_save_is_stored_by_column_group_as_row_runs(saved):
    man = json.load(open(saved / "c" / "manifest.json"))
    t = man["tables"]["t"]
    assert man["format_version"] == 5 and t["bucket_fn"] == "row_range"
    assert t["column_groups"] == {"slots": ["embedding", "adagrad.acc"], "width": 4}
    segs = CheckpointReader(open_storage(str(saved)), "c").index.tables["t"][1]
    assert len(segs) > 3 and all(s.is_run and s.columns[0].length == 0 and s.buckets.length == 0 for s in segs)
    assert all(len(s.columns) == 1 + 6 + 6 + 1 for s in segs)
    # 8 bytes of ids a row and the directories are gone: the shard files hold the rows' bytes + padding
    shard = sum(f.stat().st_size for f in (saved / "c" / "sparse").glob("*.bin"))
    assert shard <= N * (2 * D * 4 + 4) + len(segs) * 3 * 4096


@pytest.mark.parametrize("columns", [(0, 8), (8, 16), (16, 24), (4, 12), (2, 11), (0, 24)])
def test_a_column_split_load_reads_only_the_groups_of_its_columns(saved, columns):
    c0, c1 = columns
    t = Fixed(((3_000, 17_000),), columns if columns != (0, D) else None)
    res = Saver(Holder(t), output_dir=str(saved)).load(ckpt_id="c")
    cols = full_rows()
    assert sorted(t.rows) == list(range(3_000, 17_000))
    for i in (3_000, 9_999, 16_999):
        for k in ("embedding", "adagrad.acc"):
            np.testing.assert_array_equal(t.rows[i][k].numpy(), cols[k][i, c0:c1])
        assert float(t.rows[i]["rowwise"]) == cols["rowwise"][i]
    rows = 14_000
    share = rows * (2 * 4 * (c1 - c0) + 4)
    groups = (-(-c1 // 4) - c0 // 4) * 4          # the columns of the groups overlapping [c0, c1)
    read = rows * (2 * 4 * groups + 4)
    # a cut at each end of the rows: at most a chunk of each column of the two segments cut
    assert read <= res.bytes_read <= read + 2 * 13 * (16 << 10), (res.bytes_read, read)
    if c0 % 4 == 0 and c1 % 4 == 0:
        assert res.bytes_read <= 1.02 * share + (64 << 10)


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_a_cold_column_split_load_reads_past_the_page_cache(saved, mode):
    """Shard files out of the page cache: under "always" the engine reads the groups (read_strided) and the
    per-row slot (read_ranges) past it, with O_DIRECT; under "auto" both go through it (column groups read
    directly only under "always", and the per-row slot's 72 kB is under read_ranges' 256 KiB small-piece
    bound). The rows come back exactly as warm either way."""
    for f in (saved / "c" / "sparse").glob("*.bin"):
        drop_cache(f)
    t = Fixed(((1_000, 19_000),), (4, 16))
    recckpt._C._inject_fault("direct", 0)   # counts direct reads
    Saver(Holder(t), output_dir=str(saved), read_options=ReadOptions(direct_reads=mode)).load(ckpt_id="c")
    seen = recckpt._C._fault_seen("direct")
    assert seen >= 1 if mode == "always" else seen == 0
    cols = full_rows()
    assert sorted(t.rows) == list(range(1_000, 19_000))
    for i in (1_000, 10_001, 18_999):
        for k in ("embedding", "adagrad.acc"):
            np.testing.assert_array_equal(t.rows[i][k].numpy(), cols[k][i, 4:16])
        assert float(t.rows[i]["rowwise"]) == cols["rowwise"][i]


def test_a_column_split_load_from_an_object_store(saved):
    """Through a store the engine cannot read: each group's rows are fetched, verified and placed in numpy."""
    import fsspec
    fs = fsspec.filesystem("memory")
    root = "memory://groups-load"
    for p in (saved / "c").rglob("*"):
        if p.is_file():
            fs.pipe(f"{root}/c/{p.relative_to(saved / 'c')}", p.read_bytes())
    t = Fixed(((0, N),), (6, 18))
    res = Saver(Holder(t), output_dir=root).load(ckpt_id="c")
    cols = full_rows()
    assert len(t.rows) == N
    for i in (0, 12_345, N - 1):
        np.testing.assert_array_equal(t.rows[i]["embedding"].numpy(), cols["embedding"][i, 6:18])
    assert res.bytes_read <= N * (2 * 4 * 16 + 4) * 1.05


def test_a_corrupt_group_fails_the_load_naming_file_table_and_columns(saved, tmp_path):
    import shutil
    shutil.copytree(saved / "c", tmp_path / "c")
    idx = CheckpointReader(open_storage(str(tmp_path)), "c").index
    seg = idx.tables["t"][1][1]
    col = seg.columns[3]                 # the embedding's columns [8, 12)
    path = tmp_path / "c" / idx.files[seg.file][0]
    data = bytearray(path.read_bytes())
    data[col.offset + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as e:
        Saver(Holder(Fixed()), output_dir=str(tmp_path)).load(ckpt_id="c")
    msg = str(e.value)
    assert idx.files[seg.file][0] in msg and "'t'" in msg and "slot 'embedding'" in msg and "CRC mismatch" in msg
    # a process whose columns avoid the bad group loads
    t = Fixed(((0, N),), (12, 24))
    Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c")
    assert len(t.rows) == N
    assert not recckpt.verify(str(tmp_path / "c")).ok


def test_model_free_tools_and_the_independent_reader(saved):
    cols = full_rows()
    view = recckpt.open(str(saved / "c"))
    seen = 0
    for ids, part in view.iter_rows("t", chunk_rows=3_000):
        ids = np.asarray(ids)
        np.testing.assert_array_equal(part["embedding"], cols["embedding"][ids])
        np.testing.assert_array_equal(part["rowwise"], cols["rowwise"][ids])
        seen += len(ids)
    assert seen == N
    assert recckpt.verify(str(saved / "c")).ok
    R.check_digests(str(saved / "c"))
    got = R.read_checkpoint(str(saved / "c"))["tables"]["t"]
    assert sorted(got["ids"].tolist()) == list(range(N))
    np.testing.assert_array_equal(got["slots"]["adagrad.acc"], cols["adagrad.acc"][got["ids"]])
    # FORMAT.md, what a loading rank reads: columns [8, 16) of buckets [256, 768) read by the rules alone
    part = R.read_bucket_range(str(saved / "c"), "t", 256, 768, columns=(8, 16))
    rows = part["ids"]
    assert len(rows) == N // 2
    np.testing.assert_array_equal(part["slots"]["embedding"], cols["embedding"][rows, 8:16])
    share = len(rows) * (2 * 4 * 8 + 4)
    assert share <= part["bytes_read"] <= 1.05 * share + (64 << 10)


@pytest.mark.parametrize("mode,strided_direct", [("auto", recckpt._C.DIRECT_NEVER), ("never", recckpt._C.DIRECT_NEVER),
                                                 ("always", recckpt._C.DIRECT_ALWAYS)])
def test_column_groups_go_past_the_page_cache_only_when_always_is_asked(saved, monkeypatch, mode, strided_direct):
    """ReadOptions.strided_direct: a cold grouped load through the cache (measured faster, and it leaves the
    checkpoint cached for the next load) unless direct_reads="always"."""
    from recckpt.format import sparse_io
    for f in (saved / "c" / "sparse").glob("*.bin"):
        drop_cache(f)
    asked, real = [], sparse_io._C.read_strided

    def spy(*args, **kw):
        asked.append(kw.get("direct"))
        return real(*args, **kw)
    monkeypatch.setattr(sparse_io._C, "read_strided", spy)
    t = Fixed(((1_000, 19_000),), (4, 16))
    Saver(Holder(t), output_dir=str(saved), read_options=ReadOptions(direct_reads=mode)).load(ckpt_id="c")
    assert asked and set(asked) == {strided_direct}
    assert sorted(t.rows) == list(range(1_000, 19_000))
