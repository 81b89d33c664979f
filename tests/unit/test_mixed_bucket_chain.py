"""A chain whose links bucket a fixed-size table differently (issue 26): the base written with "hash"
buckets (as TorchRec tables were by the integration's first cut), the increments by the fixed-size layout
("row_range"). It loads exactly on one process and on 3 processes' row splits, and verifies."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import recckpt
from helpers.fake_tables import Holder, RecordsImports
from recckpt import SaveOptions, Saver
from recckpt.state.protocol import Changes, RowRangeLayout, SlotSpec, SparseTableMeta

N, D = 6_000, 8
SLOTS = {"embedding": SlotSpec(torch.float32, (D,), "sparse"), "count": SlotSpec(torch.int32, (), "sparse")}


class HashBucketed(RecordsImports, torch.nn.Module):
    """A table without the fixed-size protocol holding rows 0..N-1: saved with "hash" buckets."""

    def __init__(self, ids, cols):
        super().__init__()
        self.ids, self.cols = ids, cols

    def sparse_meta(self):
        return SparseTableMeta("fixed", SLOTS, len(self.ids))

    def export_chunks(self, slots, max_rows):
        for s in range(0, len(self.ids), max_rows):
            yield torch.from_numpy(self.ids[s:s + max_rows]), {k: torch.from_numpy(self.cols[k][s:s + max_rows])
                                                                for k in slots}

    def import_rows(self, ids, columns):
        raise AssertionError("not loaded in this test")

    def clear_rows(self):
        pass


class Fixed(RecordsImports, torch.nn.Module):
    """Rows 0..N-1 (this process owning `owned` ranges), with change tracking: saved "row_range"."""

    def __init__(self, owned=((0, N),)):
        super().__init__()
        self.layout = RowRangeLayout(N, owned)
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        self.changed: list[set[int]] = [set()]   # ids changed since mark k, per mark

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta("fixed", SLOTS, len(self.rows))

    def export_chunks(self, slots, max_rows):
        ids = np.array(sorted(self.rows), dtype=np.int64)
        yield from self._chunks(ids, slots, max_rows)

    def _chunks(self, ids, slots, max_rows):
        for s in range(0, len(ids), max_rows):
            part = ids[s:s + max_rows]
            yield torch.from_numpy(part), {k: torch.from_numpy(np.stack([self.rows[int(i)][k] for i in part]))
                                           for k in slots}

    def import_rows(self, ids, columns):
        for j, i in enumerate(ids.tolist()):
            self.rows[i] = {k: v[j].numpy().copy() for k, v in columns.items()}

    def clear_rows(self):
        self.rows.clear()
        self.changed = [None] * len(self.changed)    # marks before a reload cannot tell changes

    def write(self, ids, emb):
        for j, i in enumerate(ids.tolist()):
            self.rows[i]["embedding"] = emb[j].copy()
            for c in self.changed:
                if c is not None:
                    c.add(i)

    def mark_changes(self):
        self.changed.append(set())
        return len(self.changed) - 1

    def export_changes(self, since, slots, max_rows):
        c = self.changed[since] if since < len(self.changed) else None
        if c is None:
            return None
        ids = np.array(sorted(c), dtype=np.int64)
        return Changes(len(ids), self._chunks(ids, slots, max_rows), torch.empty(0, dtype=torch.int64))

    def forget_changes(self, upto):
        pass


def truth():
    ids = np.arange(N, dtype=np.int64)
    return ids, {"embedding": (ids[:, None] * 0.5 + np.arange(D)).astype(np.float32),
                 "count": (ids % 777).astype(np.int32)}


def build(out):
    ids, cols = truth()
    opts = SaveOptions(fsync=False, num_buckets=256)
    Saver(Holder(HashBucketed(ids, cols)), output_dir=out, options=opts, max_keep=None).save("base")
    live = Fixed()
    s = Saver(Holder(live), output_dir=out, options=opts, max_keep=None)
    s.load(ckpt_id="base")
    gen = np.random.default_rng(5)
    for k in (1, 2, 3):
        rows = gen.choice(N, 300, replace=False)
        emb = gen.standard_normal((300, D)).astype(np.float32)
        live.write(rows, emb)
        cols["embedding"][rows] = emb
        s.save(f"i{k}", incremental=True)
    return cols


def test_a_hash_base_with_row_range_increments_loads_exactly(tmp_path):
    out = str(tmp_path / "run")
    cols = build(out)
    man = {c: json.load(open(tmp_path / "run" / c / "manifest.json")) for c in ("base", "i1", "i2", "i3")}
    assert man["base"]["tables"]["fixed"]["bucket_fn"] == "hash"
    # one chain: every increment on the one before, down to the hash-bucketed base (no full save instead)
    for c, parent in (("i1", "base"), ("i2", "i1"), ("i3", "i2")):
        assert man[c]["parent"]["ckpt_id"] == parent and man[c]["tables"]["fixed"]["changes"], c
        assert man[c]["tables"]["fixed"]["bucket_fn"] == "row_range"
    assert recckpt.verify(str(tmp_path / "run" / "i3")).ok
    splits = [((0, 1_000),), ((1_000, 2_500), (4_000, 4_700)), ((2_500, 4_000), (4_700, N))]
    for layouts in ([((0, N),)], splits):
        seen = set()
        for r, owned in enumerate(layouts):
            t = Fixed(owned)
            Saver(Holder(t), output_dir=out).load(ckpt_id="i3", shard_id=r, shard_num=len(layouts))
            want = [i for a, b in owned for i in range(a, b)]
            assert sorted(t.rows) == want
            got = np.stack([t.rows[i]["embedding"] for i in want])
            np.testing.assert_array_equal(got, cols["embedding"][want])
            assert [int(t.rows[i]["count"]) for i in want] == cols["count"][want].tolist()
            seen |= set(want)
        assert seen == set(range(N))


def test_the_fold_keeps_a_differently_bucketed_links_ids_by_the_newest_links_buckets(tmp_path):
    """The model-free reader folds the same chain bucket range by bucket range (row_range buckets of the
    newest link): every id once, with its newest row."""
    out = str(tmp_path / "run")
    cols = build(out)
    from recckpt.format.chain import open_chain
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.format.fold import fold_rows
    from recckpt.storage import open_storage
    links = open_chain(CheckpointReader(open_storage(out), "i3"))
    got_ids, got_emb = [], []
    for lo, hi in ((0, 100), (100, 101), (101, 256)):
        for ids, (emb, _cnt) in fold_rows(links, "fixed", ["embedding", "count"], lo, hi):
            assert np.all((ids * 256 // N >= lo) & (ids * 256 // N < hi)), (lo, hi)
            got_ids.append(ids)
            got_emb.append(emb.view(np.float32))
    ids = np.concatenate(got_ids)
    assert sorted(ids.tolist()) == list(range(N))
    np.testing.assert_array_equal(np.concatenate(got_emb), cols["embedding"][ids])


@pytest.mark.parametrize("ckpt", ["i1", "i3"])
def test_compaction_of_a_mixed_chain_is_exact(tmp_path, ckpt):
    out = str(tmp_path / "run")
    cols = build(out)
    if ckpt == "i1":   # the state at i1: replay the first increment only
        cols = None
    dst = str(tmp_path / "compacted")
    from recckpt.tools.compaction import compact
    compact(f"{out}/{ckpt}", dst, fsync=False)
    t = Fixed()
    Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_path=dst, direct_path=True)
    t2 = Fixed()
    Saver(Holder(t2), output_dir=out).load(ckpt_id=ckpt)
    assert sorted(t.rows) == sorted(t2.rows) == list(range(N))
    for i in range(0, N, 7):
        np.testing.assert_array_equal(t.rows[i]["embedding"], t2.rows[i]["embedding"])
    if cols is not None:
        np.testing.assert_array_equal(np.stack([t.rows[i]["embedding"] for i in range(N)]), cols["embedding"])
