"""Column-split saves (format version 4's column blocks), with a small fake fixed-size table whose processes
each hold a column range of every row, as a column-wise TorchRec plan does: saved by 2 "ranks" (both
from this process), then read back by whole-row and column-split loaders, recckpt.open, export, verify
and the independent reader, every value compared. A per-row float slot ("rowacc", as RowWiseAdagrad's
per-column-shard state) holds a different value per block, to check the documented rule."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from spec import independent_reader as R

import recckpt
from helpers.fake_tables import Holder, RecordsImports
from recckpt import SaveOptions, Saver
from recckpt.errors import IncompatibleCheckpointError
from recckpt.format.verifier import verify
from recckpt.state.protocol import RowRangeLayout, SlotSpec, SparseTableMeta

N, D = 20_000, 16
SAVE_BLOCKS = ((0, 6), (6, 16))


def full_rows():
    ids = np.arange(N, dtype=np.int64)
    emb = (ids[:, None] * 0.001 + np.arange(D)).astype(np.float32)
    mom = (ids[:, None] % 97 + np.arange(D) * 0.5).astype(np.float32)
    cnt = (ids % 1000).astype(np.int32)
    return ids, {"embedding": emb, "momentum": mom, "count": cnt}


def rowacc(block: int) -> np.ndarray:
    """The per-row value the process holding column block `block` keeps (differs per block)."""
    return (np.arange(N) % 13 + 100.0 * (block + 1)).astype(np.float32)


class FakeCW(RecordsImports, torch.nn.Module):
    """Rows `owned`, columns `columns` of the split slots (embedding, momentum); the layout names every
    process's column range (`blocks`)."""

    def __init__(self, owned, columns=None, blocks=None, block=0):
        super().__init__()
        self.layout = RowRangeLayout(N, owned, columns, False, blocks)
        self.block = block
        self.slots = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
                      "momentum": SlotSpec(torch.float32, (D,), "sparse_opt"),
                      "count": SlotSpec(torch.int32, (), "sparse"),
                      "rowacc": SlotSpec(torch.float32, (), "sparse_opt")}
        self.rows = {}

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta("cw", self.slots, self.layout.owned_count)

    def export_chunks(self, slots, max_rows):
        ids, cols = full_rows()
        cols["rowacc"] = rowacc(self.block)
        c0, c1 = self.layout.columns or (0, D)
        for a, b in self.layout.owned_rows:
            for s in range(a, b, max_rows):
                e = min(b, s + max_rows)
                out = {}
                for k in slots:
                    v = cols[k][s:e]
                    out[k] = torch.from_numpy(np.ascontiguousarray(v[:, c0:c1] if v.ndim == 2 else v))
                yield torch.from_numpy(ids[s:e]), out

    def import_rows(self, ids, columns):
        c0, c1 = self.layout.columns or (0, D)
        for k, v in columns.items():
            want = (len(ids), c1 - c0) if self.slots[k].shape else (len(ids),)
            assert tuple(v.shape) == want, (k, tuple(v.shape), want)
        super().import_rows(ids, columns)


OPTS = SaveOptions(num_buckets=4096, fsync=False, segment_bytes=1 << 20)


@pytest.fixture
def saved(tmp_path):
    for w, cols in enumerate(SAVE_BLOCKS):   # two column-wise ranks, every row each
        Saver(Holder(FakeCW(((0, N),), cols, SAVE_BLOCKS, w)), output_dir=str(tmp_path), options=OPTS).save(
            "c", shard_id=w, shard_num=2)
    return tmp_path


def expect_rowacc(c0, c1):
    """The rule of docs/TORCHREC.md: the width-weighted mean over the saved blocks overlapping [c0, c1)."""
    acc, tot = np.zeros(N), 0
    for j, (a, b) in enumerate(SAVE_BLOCKS):
        w = min(b, c1) - max(a, c0)
        if w > 0:
            acc += rowacc(j).astype(np.float64) * w
            tot += w
    return (acc / tot).astype(np.float32)


def test_the_manifest_and_every_model_free_reader_see_whole_rows(saved):
    man = json.load(open(saved / "c" / "manifest.json"))
    t = man["tables"]["cw"]
    assert t["column_blocks"] == {"slots": ["embedding", "momentum"], "blocks": [list(b) for b in SAVE_BLOCKS]}
    assert t["rows"] == N and t["bucket_fn"] == "row_range"
    ids, cols = full_rows()
    assert verify(str(saved / "c")).ok
    got = R.read_checkpoint(str(saved / "c"))["tables"]["cw"]
    o = np.argsort(got["ids"])
    np.testing.assert_array_equal(got["ids"][o], ids)
    for k in ("embedding", "momentum", "count"):
        np.testing.assert_array_equal(got["slots"][k][o], cols[k])
    np.testing.assert_array_equal(got["slots"]["rowacc"][o], rowacc(0))   # unsplit slots: block 0's
    R.check_digests(str(saved / "c"))
    view = recckpt.open(str(saved / "c"))
    seen = 0
    for cid, part in view.iter_rows("cw", chunk_rows=3000):
        cid = np.asarray(cid)
        np.testing.assert_array_equal(part["embedding"], cols["embedding"][cid])
        np.testing.assert_array_equal(part["momentum"], cols["momentum"][cid])
        np.testing.assert_array_equal(part["rowacc"], rowacc(0)[cid])
        seen += len(cid)
    assert seen == N
    half = sum(len(i) for i, _ in view.iter_rows("cw", shard=(1, 2)))
    assert 0 < half < N


@pytest.mark.parametrize("owned, columns, blocks", [
    (((0, 7_000),), None, None),                                  # whole rows (row-wise), rows split
    (((5_000, N),), None, None),
    (((0, N),), (0, 6), SAVE_BLOCKS),                             # the same column split
    (((0, N),), (6, 16), SAVE_BLOCKS),
    (((0, N),), (4, 10), ((0, 4), (4, 10), (10, 16))),            # another column split
    (((0, N),), (10, 16), ((0, 4), (4, 10), (10, 16))),
])
def test_loads_give_each_process_its_rows_and_columns(saved, owned, columns, blocks):
    ids, cols = full_rows()
    t = FakeCW(owned, columns, blocks)
    res = Saver(Holder(t), output_dir=str(saved)).load(ckpt_id="c", shard_id=0, shard_num=1)
    want = [i for a, b in owned for i in range(a, b)]
    assert sorted(t.rows) == want
    c0, c1 = columns or (0, D)
    acc = expect_rowacc(c0, c1)
    for i in want[::101] + [want[0], want[-1]]:
        for k in ("embedding", "momentum"):
            np.testing.assert_array_equal(t.rows[i][k].numpy(), cols[k][i, c0:c1])
        assert int(t.rows[i]["count"]) == cols["count"][i]
        assert float(t.rows[i]["rowacc"]) == pytest.approx(float(acc[i]), rel=1e-6)
    share = len(want) * (8 * (c1 - c0) + 4 + 4)   # its rows x columns of every slot
    # Format version 5: a process reads of the blocks overlapping its columns only the column groups (of 4
    # columns, from each block's start) overlapping them, and no ids: here exactly its columns, plus the
    # unsplit slots of each block it reads (the bound, every split; version 4 read 1.45-2.9x here)
    assert res.bytes_read <= 1.2 * share + (64 << 10), (res.bytes_read, share)


def test_a_hash_keyed_table_loads_a_column_split_table_as_whole_rows(saved):
    """(It was refused; a model-bank warm start of a HashTable from a column-wise TorchRec table needs it.)
    The blocks' columns joined, an unsplit per-row value by the width-weighted mean over every block, as a
    whole-row TorchRec load gets it."""
    from helpers.tables import DictTable
    dst = DictTable("cw", FakeCW(()).slots)
    r = Saver(Holder(dst), output_dir=str(saved)).load(ckpt_id="c")
    assert r.sparse_rows == N
    order = torch.argsort(dst.ids)
    ids, cols = full_rows()
    assert torch.equal(dst.ids[order], torch.from_numpy(ids))
    for k in ("embedding", "momentum", "count"):
        assert torch.equal(dst.cols[k][order], torch.from_numpy(cols[k])), k
    assert np.allclose(dst.cols["rowacc"][order].numpy(), expect_rowacc(0, D), rtol=1e-6, atol=0)


def test_export_writes_whole_rows_and_compaction_refuses_naming_the_table(saved, tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "x"
    res = recckpt.export(str(saved / "c"), str(out))
    assert res is not None and any(out.iterdir())
    from recckpt.tools.compaction import compact
    with pytest.raises(IncompatibleCheckpointError, match="'cw'.*column-split"):
        compact(str(saved / "c"), str(saved / "d"), fsync=False)
    assert not (saved / "d").exists()


def test_compaction_keeps_a_fixed_size_tables_row_range_buckets(tmp_path):
    """A compacted TorchRec-style table stays bucketed by row range, so loads of it stay bounded by the
    shard (it was re-bucketed by hash before)."""
    from recckpt.tools.compaction import compact
    Saver(Holder(FakeCW(((0, N),))), output_dir=str(tmp_path), options=OPTS).save("c")
    compact(str(tmp_path / "c"), str(tmp_path / "d"), fsync=False)
    t = json.load(open(tmp_path / "d" / "manifest.json"))["tables"]["cw"]
    assert t["bucket_fn"] == "row_range" and t["num_rows"] == N and "column_blocks" not in t
    # and its column groups and row runs (format version 5): column-wise loads of it stay bounded in columns
    assert t["column_groups"] == {"slots": ["embedding", "momentum"], "width": 4}
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.storage import open_storage
    assert all(seg.is_run for seg in CheckpointReader(open_storage(str(tmp_path)), "d").index.tables["cw"][1])
    dst = FakeCW(((0, 5_000),))
    res = Saver(Holder(dst), output_dir=str(tmp_path)).load(ckpt_id="d")
    assert sorted(dst.rows) == list(range(5_000))
    assert res.bytes_read <= 1.2 * 5_000 * (8 * D + 8) + (64 << 10)


class TrackedCW(FakeCW):
    """FakeCW that also says it tracks changes: a column-split table must still be saved whole."""

    def mark_changes(self):
        return 1

    def export_changes(self, since, slots, max_rows):
        raise AssertionError("a column-split table is saved whole in an increment")

    def forget_changes(self, upto):
        pass


def test_an_async_snapshot_and_an_increment_hold_a_column_split_table_whole(tmp_path):
    """The async path copies this process's columns only (the snapshot buffers are narrowed), and an
    incremental save holds a column-split table whole (docs/FORMAT.md: blocks never hold changes); both
    read back as the sync full save does."""
    from recckpt.train.snapshot import HostBuffers
    savers = [Saver(Holder(TrackedCW(((0, N),), cols, SAVE_BLOCKS, w)), output_dir=str(tmp_path), options=OPTS)
              for w, cols in enumerate(SAVE_BLOCKS)]
    for w, s in enumerate(savers):
        s.write("a", s.capture_copy(HostBuffers(), shard_id=w), shard_id=w, shard_num=2)
    for w, s in enumerate(savers):
        s.save("b", shard_id=w, shard_num=2, incremental=True)
    man_a = json.load(open(tmp_path / "a" / "manifest.json"))
    man_b = json.load(open(tmp_path / "b" / "manifest.json"))
    assert "parent" in man_b and not man_b["tables"]["cw"].get("changes")
    assert man_a["tables"]["cw"]["column_blocks"] == man_b["tables"]["cw"]["column_blocks"]
    assert man_a["digests"]["tables"]["cw"] == man_b["digests"]["tables"]["cw"]
    ids, cols = full_rows()
    for ck in ("a", "b"):
        t = FakeCW(((0, N),), (6, 16), SAVE_BLOCKS)
        Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id=ck)
        assert len(t.rows) == N
        for i in (0, 777, N - 1):
            np.testing.assert_array_equal(t.rows[i]["embedding"].numpy(), cols["embedding"][i, 6:16])
            assert float(t.rows[i]["rowacc"]) == float(rowacc(1)[i])


def test_processes_that_disagree_on_a_column_split_tables_rows_commit_nothing(tmp_path):
    """Each column block must hold every row, which no single process can check: the commit does, and a
    save whose blocks differ is refused naming the table, leaving earlier checkpoints intact (it used to
    commit a checkpoint every reader refused)."""
    from recckpt.errors import CheckpointSaveError
    Saver(Holder(FakeCW(((0, N),))), output_dir=str(tmp_path), options=OPTS).save("good")
    Saver(Holder(FakeCW(((0, N),), (0, 6), SAVE_BLOCKS, 0)), output_dir=str(tmp_path), options=OPTS).save(
        "c", shard_id=0, shard_num=2)
    with pytest.raises(CheckpointSaveError, match=r"'cw'.*\[20000, 19990\] rows"):
        Saver(Holder(FakeCW(((0, N - 10),), (6, 16), SAVE_BLOCKS, 1)), output_dir=str(tmp_path),
              options=OPTS).save("c", shard_id=1, shard_num=2)
    assert Saver(Holder(FakeCW(())), output_dir=str(tmp_path)).checkpoints() == ["good"]
    assert verify(str(tmp_path / "good")).ok and not (tmp_path / "c").exists()


def test_a_load_with_an_ownership_function_reads_a_column_split_tables_ids_once(saved):
    """Reads of ids alone (an ownership function's duplicate check) take block 0's ids: every block holds
    every row, so the table's ids are not counted twice (nor refused)."""
    t = FakeCW(((0, N),), (0, 6), SAVE_BLOCKS)
    res = Saver(Holder(t), output_dir=str(saved)).load(
        ckpt_id="c", load_conf={"ownership": lambda ids, world: torch.zeros_like(ids)})
    assert len(t.rows) == N and res.sparse_rows == N
