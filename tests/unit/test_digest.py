"""Content digests (docs/FORMAT.md "Content digests"): the engine's sums do not depend on row order,
chunking, threads or column splits; saves record them per table, slot and dense tensor, equal whatever
the world size, bucket count or segment size; increments record none for tables saved as changes;
compaction records the folded state's; a manifest with garbled digests is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from spec import independent_reader as R

from helpers.checkpoints import make_checkpoint, table_rows
from recckpt import _C, HashTable, SaveOptions, Saver, SparseAdam
from recckpt.errors import CorruptCheckpointError
from recckpt.format import catalog, checked_json
from recckpt.format.digest import Digest, SlotGeometry, TableDigest, dense_digest
from recckpt.format.schema import SlotInfo
from recckpt.storage import open_storage


def _rows(n, seed=0):
    g = np.random.default_rng(seed)
    ids = np.unique(g.integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64))
    n = len(ids)
    return ids, {"emb": g.standard_normal((n, 2, 12), dtype=np.float32),
                 "acc": g.standard_normal((n, 5)).astype(np.float16),
                 "flag": g.integers(0, 2, (n,), dtype=np.uint8),
                 "cnt": g.integers(0, 1 << 40, (n,), dtype=np.int64)}


SLOTS = {"emb": SlotInfo("F32", (2, 12), "sparse"), "acc": SlotInfo("F16", (5,), "sparse_opt"),
         "flag": SlotInfo("U8", (), "sparse"), "cnt": SlotInfo("I64", (), "sparse")}


def _digest(ids, cols, threads=1, windows=None, order=None):
    d = TableDigest.for_slots(SLOTS, windows)
    if order is not None:
        ids, cols = ids[order], {k: v[order] for k, v in cols.items()}
    d.update(ids, [np.ascontiguousarray(cols[s]).reshape(len(ids), -1).view(np.uint8) for s in SLOTS], threads)
    return d


def test_engine_matches_the_numpy_reference_of_the_spec():
    ids, cols = _rows(3000)
    d = _digest(ids, cols)
    assert d.rows == len(ids)
    assert d.ids.hex() == R.digest_ids(ids)
    for s in SLOTS:
        assert d.slot_digests[s].hex() == R.digest_rows(ids, cols[s]), s


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.int64])
@pytest.mark.parametrize("width", [1, 3, 4, 5, 8, 16, 24, 32, 64, 128, 256, 257, 600])
def test_every_row_width_matches_the_reference(dtype, width):
    """Rows of up to 256 elements are summed per element position across rows, wider ones row by row,
    narrow ones across rows: each path, each itemsize, against the spec's numpy definition."""
    g = np.random.default_rng(width)
    ids = np.unique(g.integers(-(1 << 63), (1 << 63) - 1, size=700, dtype=np.int64))
    rows = g.integers(0, 1 << 62, (len(ids), width * np.dtype(dtype).itemsize), dtype=np.uint64)
    rows = rows.astype(np.uint8).view(dtype).reshape(len(ids), width)
    d = TableDigest.for_slots({"s": SlotInfo({1: "U8", 2: "F16", 4: "F32", 8: "I64"}[np.dtype(dtype).itemsize],
                                             (width,), "sparse")})
    d.update(ids, [rows.view(np.uint8).reshape(len(ids), -1)])
    assert d.slot_digests["s"].hex() == R.digest_rows(ids, rows)


def test_a_window_of_several_blocks_matches_the_reference():
    """A column window of a [.., 3, 40] slot holds three blocks of its columns a row: their positions in
    the logical row are k * 40 + first + c, in both the per-position and the row-by-row paths."""
    ids, _ = _rows(400, seed=5)
    g = np.random.default_rng(6)
    for shape, (first, end) in (((3, 40), (7, 30)), ((3, 200), (10, 190))):
        full = g.standard_normal((len(ids), *shape), dtype=np.float32)
        d = TableDigest.for_slots({"e": SlotInfo("F32", shape, "sparse")}, {"e": (first, end)})
        part = np.ascontiguousarray(full[:, :, first:end])
        d.update(ids, [part.reshape(len(ids), -1).view(np.uint8)])
        rest = TableDigest.for_slots({"e": SlotInfo("F32", shape, "sparse")}, {"e": (0, first)})
        rest.update(ids, [np.ascontiguousarray(full[:, :, :first]).reshape(len(ids), -1).view(np.uint8)])
        tail = TableDigest.for_slots({"e": SlotInfo("F32", shape, "sparse")}, {"e": (end, shape[1])})
        tail.update(ids, [np.ascontiguousarray(full[:, :, end:]).reshape(len(ids), -1).view(np.uint8)])
        total = d.slot_digests["e"] + rest.slot_digests["e"] + tail.slot_digests["e"]
        assert total.hex() == R.digest_rows(ids, full), shape


def test_sums_do_not_depend_on_order_chunks_or_threads():
    ids, cols = _rows(200_000, seed=1)   # ~15 MB: big enough for the engine to split it over threads
    whole = _digest(ids, cols, threads=1)
    assert _digest(ids, cols, threads=4).to_json() == whole.to_json()
    perm = np.random.default_rng(2).permutation(len(ids))
    parts = [_digest(ids[perm[k::3]], {s: c[perm[k::3]] for s, c in cols.items()}) for k in range(3)]
    assert (parts[0] + parts[1] + parts[2]).to_json() == whole.to_json()
    changed = {s: c.copy() for s, c in cols.items()}
    changed["emb"][123, 1, 7] = np.nextafter(changed["emb"][123, 1, 7], np.float32(np.inf))
    other = _digest(ids, changed).to_json()
    assert other["slots"]["emb"] != whole.to_json()["slots"]["emb"]
    assert {k: v for k, v in other["slots"].items() if k != "emb"} == \
        {k: v for k, v in whole.to_json()["slots"].items() if k != "emb"}
    assert other["ids"] == whole.to_json()["ids"]


def test_column_split_slots_sum_to_the_whole_rows_digest():
    """A column-wise plan: each holder digests its columns of the last dimension; the sum is the whole."""
    ids, cols = _rows(500, seed=3)
    whole = _digest(ids, cols).slot_digests["emb"]
    total = Digest()
    for first, end in ((0, 5), (5, 12)):
        d = TableDigest.for_slots({"emb": SLOTS["emb"]}, {"emb": (first, end)})
        part = np.ascontiguousarray(cols["emb"][:, :, first:end])
        d.update(ids, [part.reshape(len(ids), -1).view(np.uint8)])
        total = total + d.slot_digests["emb"]
    assert total == whole
    # the same element swapped between two columns is a different row
    swapped = cols["emb"].copy()
    swapped[0, 0, [0, 1]] = swapped[0, 0, [1, 0]]
    assert swapped[0, 0, 0] != swapped[0, 0, 1]
    assert _digest(ids, {**cols, "emb": swapped}).slot_digests["emb"] != whole


def test_engine_refuses_inconsistent_geometry():
    ids = np.arange(4, dtype=np.int64)
    col = np.zeros((4, 12), np.uint8)
    with pytest.raises(ValueError, match="itemsize"):
        _C.row_digests(ids, [col], [(12, 3, 4, 4, 0)], 1)
    with pytest.raises(ValueError, match="window"):
        _C.row_digests(ids, [col], [(12, 4, 3, 4, 2)], 1)
    with pytest.raises(ValueError, match="expected 4 rows"):
        _C.row_digests(ids, [col[:3]], [(12, 4, 3, 3, 0)], 1)
    with pytest.raises(ValueError, match="outside a row"):
        SlotGeometry.columns("F32", (8,), 4, 9)


def test_dense_digest_is_one_row_of_id_zero():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    d = dense_digest("F32", (2, 3, 4), a.view(np.uint8).reshape(-1))
    assert d.digest.hex() == R.digest_rows(np.zeros(1, np.int64), a.reshape(1, -1))
    with pytest.raises(ValueError):
        dense_digest("F32", (2, 3, 5), a.view(np.uint8).reshape(-1))


def _manifest_json(path):
    with open(path) as f:
        return json.load(f)


def test_saves_record_equal_digests_whatever_the_layout(tmp_path):
    rows = table_rows(2000)
    make_checkpoint(str(tmp_path), "one", rows)
    make_checkpoint(str(tmp_path), "three", rows, workers=3)
    a = _manifest_json(tmp_path / "one" / "manifest.json")["digests"]
    b = _manifest_json(tmp_path / "three" / "manifest.json")["digests"]
    assert a["tables"]["user"]["rows"] == len(rows["ids"])
    assert set(a["tables"]["user"]["slots"]) == {"embedding", "adagrad.acc", "freq", "last_step"}
    assert set(a["dense"]) == {"lin.weight", "lin.bias"}
    assert a == b
    # the digests describe the rows: recomputed from what an independent reader reads
    assert R.check_digests(str(tmp_path / "three"))["tables"] == a["tables"]
    # another bucket count and segment size: different bytes on disk, same digests
    t = HashTable("emb", 8)
    t(torch.arange(5000))
    m = torch.nn.Sequential()
    m.emb = t
    saves = []
    for opts in (SaveOptions(num_buckets=16, segment_bytes=4096, fsync=False), SaveOptions(fsync=False)):
        s = Saver(m, output_dir=str(tmp_path / f"b{opts.num_buckets}"), options=opts)
        s.save("c")
        saves.append(_manifest_json(tmp_path / f"b{opts.num_buckets}" / "c" / "manifest.json")["digests"])
    assert saves[0] == saves[1]


def test_one_changed_row_changes_only_its_slot(tmp_path):
    rows = table_rows(500)
    make_checkpoint(str(tmp_path), "a", rows)
    rows["adagrad.acc"] = rows["adagrad.acc"].copy()
    rows["adagrad.acc"][17, 3] += 1
    make_checkpoint(str(tmp_path), "b", rows, dense_value=0.25)
    a = _manifest_json(tmp_path / "a" / "manifest.json")["digests"]
    b = _manifest_json(tmp_path / "b" / "manifest.json")["digests"]
    ta, tb = a["tables"]["user"], b["tables"]["user"]
    assert ta["ids"] == tb["ids"]
    assert [s for s in ta["slots"] if ta["slots"][s] != tb["slots"][s]] == ["adagrad.acc"]
    assert all(a["dense"][k]["digest"] != b["dense"][k]["digest"] for k in a["dense"])


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4, track_changes=True)
        self.other = HashTable("other", 2, track_changes=False)   # written whole in increments
        self.lin = torch.nn.Linear(4, 1)


def test_increments_record_digests_only_for_tables_written_whole(tmp_path):
    m = _Model()
    opt = SparseAdam([m.emb, m.other], lr=0.1)
    m.emb(torch.arange(100))
    m.other(torch.arange(50))
    s = Saver(m, opt, output_dir=str(tmp_path), max_keep=None, options=SaveOptions(num_buckets=16, fsync=False))
    s.save("full")
    m.emb(torch.arange(100, 120))
    s.save("inc", incremental=True)
    man = _manifest_json(tmp_path / "inc" / "manifest.json")
    assert man["tables"]["emb"]["changes"] is True
    assert set(man["digests"]["tables"]) == {"other"}
    assert set(man["digests"]["dense"]) == {"lin.weight", "lin.bias"}
    # compaction writes the chain's state whole: its digests equal a full save's of the same state
    from recckpt import compact
    compact(str(tmp_path / "inc"), str(tmp_path / "folded"))
    s.save("full2")
    folded = _manifest_json(tmp_path / "folded" / "manifest.json")["digests"]
    assert folded == _manifest_json(tmp_path / "full2" / "manifest.json")["digests"]
    assert folded["tables"]["emb"]["rows"] == 120


def _rewrite(path, edit):
    obj = _manifest_json(path)
    obj.pop("crc32c")
    edit(obj)
    path.write_bytes(checked_json.dumps(obj))


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["digests"]["tables"]["user"].update(ids="XYZ"), "hex digits"),
    (lambda m: m["digests"]["tables"]["user"].update(rows=3), "holds 1000 rows"),
    (lambda m: m["digests"]["tables"]["user"]["slots"].pop("freq"), "differ from the table's slots"),
    (lambda m: m["digests"]["tables"].update(ghost=m["digests"]["tables"]["user"]), "no such table"),
    (lambda m: m["digests"]["dense"]["lin.bias"].update(dtype="F128"), "unknown dtype"),
])
def test_garbled_digests_are_refused(tmp_path, edit, match):
    make_checkpoint(str(tmp_path), "c", table_rows(1000))
    _rewrite(tmp_path / "c" / "manifest.json", edit)
    with pytest.raises(CorruptCheckpointError, match=match):
        catalog.read_manifest(open_storage(str(tmp_path)), "c")


def test_digests_of_an_unknown_algorithm_are_ignored(tmp_path):
    make_checkpoint(str(tmp_path), "c", table_rows(100))
    _rewrite(tmp_path / "c" / "manifest.json", lambda m: m["digests"].update(hash="sha3-rows"))
    assert catalog.read_manifest(open_storage(str(tmp_path)), "c").digests is None
