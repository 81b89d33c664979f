"""Format version 4's "id_range" bucket function (managed-collision tables: raw ids in [0, H), routed to
processes by id range): the engine against the formula in exact integers, the manifest's validation, and a
save 2 -> load 3 of a small fake `RoutedRows` table that routes ids by range as TorchRec's MCH does: exact
rows, each process reading about its share, every process counting every shard for the capacity check, and
a hash-bucketed checkpoint of the same table still loading."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from spec import independent_reader as R

from helpers.fake_tables import Holder, RecordsImports
from recckpt import _C, SaveOptions, Saver
from recckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from recckpt.format.hashing import id_range_buckets
from recckpt.format.manifest_parse import manifest_from_json
from recckpt.format.verifier import verify
from recckpt.state.protocol import Admitted, SlotSpec, SparseTableMeta

I64_MAX = (1 << 63) - 1


def formula(ids, num_buckets, h):
    """docs/FORMAT.md, in Python integers: floor(id * (B - 1) / H) inside [0, H), else B - 1."""
    return [int(x) * (num_buckets - 1) // h if 0 <= int(x) < h else num_buckets - 1 for x in ids]


@pytest.mark.parametrize("h", [1, 2, 3, 7, 1000, 10 ** 12, (1 << 62) + 1, I64_MAX])
@pytest.mark.parametrize("num_buckets", [1, 2, 3, 4096, (1 << 24) - 1])
def test_engine_matches_the_formula_at_the_edges(h, num_buckets):
    rng = np.random.default_rng(h % 1000 + num_buckets)
    edges = [0, 1, h - 1, h, h + 1, -1, -h, I64_MAX, -I64_MAX - 1, h // 2, h // 3]
    ids = np.array([x for x in edges if -I64_MAX - 1 <= x <= I64_MAX]
                   + rng.integers(0, h, 2000, dtype=np.int64, endpoint=False).tolist()
                   + rng.integers(-I64_MAX - 1, I64_MAX, 500, dtype=np.int64).tolist(), dtype=np.int64)
    got = np.asarray(_C.bucket_of(ids, num_buckets, id_range=h))
    assert got.tolist() == formula(ids.tolist(), num_buckets, h)
    inside = ids[(ids >= 0) & (ids < h)]
    # contiguous: sorted ids give sorted buckets, and only ids outside [0, H) use the reserved bucket
    b = np.asarray(_C.bucket_of(np.sort(inside), num_buckets, id_range=h))
    assert np.all(np.diff(b) >= 0)
    if num_buckets > 1:
        assert b.max(initial=0) < num_buckets - 1


def test_engine_refuses_id_range_with_num_rows_or_negative():
    with pytest.raises(ValueError, match="id_range"):
        _C.bucket_of(np.zeros(1, np.int64), 16, num_rows=10, id_range=10)
    with pytest.raises(ValueError, match="id_range"):
        _C.bucket_of(np.zeros(1, np.int64), 16, id_range=-1)


def id_intervals(h: int):
    """Every [a, b) around [0, H) for small H; for a large one, every interval with an end at an edge
    (below 0, 0, 1, H - 1, H, past H) and a fixed sample of the rest (all of them is O(H^3) in Python)."""
    every = [(a, b) for a in range(-1, h + 2) for b in range(a, h + 3)]
    if h <= 64:
        return every
    edges = {-1, 0, 1, h - 1, h, h + 1, h + 2}
    rng = np.random.default_rng(h)
    picked = rng.choice(len(every), 3000, replace=False)
    return [p for p in every if p[0] in edges or p[1] in edges] + [every[i] for i in picked]


@pytest.mark.parametrize("h,num_buckets", [(1, 5), (7, 5), (10, 4), (37, 64), (1000, 17), (5, 1), (5, 2)])
def test_bucket_ranges_of_an_id_range_hold_exactly_its_buckets(h, num_buckets):
    """`id_range_buckets(a, b)`: exactly the buckets from that of the first id of [a, b) within [0, H) to that
    of its last one, plus the reserved one."""
    all_ids = list(range(-3, h + 3))
    buckets = formula(all_ids, num_buckets, h)
    for a, b in id_intervals(h):
        ranges = id_range_buckets(a, b, h, num_buckets)
        covered = {k for lo, hi in ranges for k in range(lo, hi)}
        need = {bk for x, bk in zip(all_ids, buckets) if a <= x < b or not 0 <= x < h}
        assert need <= covered, (a, b, ranges)
        inside = [bk for x, bk in zip(all_ids, buckets) if a <= x < b and 0 <= x < h]
        span = set(range(min(inside), max(inside) + 1)) if inside else set()
        assert covered == span | {num_buckets - 1}, (a, b, ranges)
        assert all(lo < hi for lo, hi in ranges) and ranges == sorted(ranges)


# ------------------------------------------------------------------------------------- a fake routed table

H, W_SAVE, D = 10 ** 12, 2, 32
ROWS = 24_000


def saved_rows():
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(0, H, ROWS + 100, dtype=np.int64))[:ROWS]
    rng.shuffle(ids)
    emb = (ids[:, None] % 10007 * 0.01 + np.arange(D)).astype(np.float32)
    cnt = ids % 1000
    return ids, {"embedding": emb, "mch.counts": cnt}


def route(ids: np.ndarray, shards: int) -> np.ndarray:
    block = -(-H // shards)
    return ids // block


class FakeRouted(RecordsImports, torch.nn.Module):
    """Raw ids in [0, H), shard s of `shards` holding ids [s * block, (s + 1) * block) as TorchRec's MCH routes
    them, with `cap` slots; keyed by raw id on the protocol."""

    def __init__(self, shard, shards, cap=ROWS, id_space=H):
        super().__init__()
        self.shard, self.shards, self.cap, self.space = shard, shards, cap, id_space
        self.slots = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
                      "mch.counts": SlotSpec(torch.int64, (), "sparse")}
        self.rows, self.planned, self.data, self.seen = {}, None, None, 0

    def sparse_meta(self):
        return SparseTableMeta("mch_t", self.slots, 0 if self.data is None else len(self.data[0]))

    def fill(self):
        ids, cols = saved_rows()
        mask = route(ids, self.shards) == self.shard
        self.data = (ids[mask], {k: v[mask] for k, v in cols.items()})

    def export_chunks(self, slots, max_rows):
        ids, cols = self.data
        for s in range(0, len(ids), max_rows):
            yield torch.from_numpy(ids[s:s + max_rows]), {k: torch.from_numpy(cols[k][s:s + max_rows]) for k in slots}

    # RoutedRows
    def id_space(self):
        return self.space

    def owned_ids(self):
        block = -(-H // self.shards)
        return self.shard * block, min((self.shard + 1) * block, H)

    def plan_slots(self):
        return ["mch.counts"]

    def plan_rows(self, chunks, loaded_slots, admission):
        counts = np.zeros(self.shards, np.int64)
        mine = []
        for ids, cols in chunks:
            ids = ids.numpy()
            self.seen += len(ids)
            s = route(ids, self.shards)
            counts += np.bincount(s, minlength=self.shards)
            if (s == self.shard).any():
                assert "mch.counts" in cols, "a chunk holding this shard's ids came without its ranking slot"
                mine.append(ids[s == self.shard].copy())
        over = [i for i in range(self.shards) if counts[i] > self.cap]
        if over:
            raise IncompatibleCheckpointError(f"table 'mch_t': shards {over} get {counts[over].tolist()} ids for "
                                              f"{self.cap} slots")
        self.planned = np.sort(np.concatenate(mine)) if mine else np.zeros(0, np.int64)
        return Admitted(int(counts.sum()), 0, {}, len(self.planned))

    def keep(self, ids):
        return torch.from_numpy(np.isin(ids.numpy(), self.planned))


def _save(path, id_space=H):
    opts = SaveOptions(num_buckets=4096, fsync=False, segment_bytes=1 << 20)
    for w in range(W_SAVE):
        t = FakeRouted(w, W_SAVE, id_space=id_space)
        t.fill()
        Saver(Holder(t), output_dir=str(path), options=opts).save("c", shard_id=w, shard_num=W_SAVE)
    return json.load(open(path / "c" / "manifest.json"))["tables"]["mch_t"]


def test_routed_table_save_2_load_3_exact_and_bounded(tmp_path):
    t = _save(tmp_path)
    assert (t["bucket_fn"], t["input_size"]) == ("id_range", H)
    ids_all, cols_all = saved_rows()
    row_bytes = 8 + 4 * D + 8
    seen = set()
    for r in range(3):
        t = FakeRouted(r, 3)
        res = Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=r, shard_num=3)
        want = sorted(ids_all[route(ids_all, 3) == r].tolist())
        assert sorted(t.rows) == want and t.seen == ROWS   # it counted every shard's ids
        pos = {int(i): k for k, i in enumerate(ids_all)}
        for i in want[::53] + [want[0], want[-1]]:
            np.testing.assert_array_equal(t.rows[i]["embedding"].numpy(), cols_all["embedding"][pos[i]])
            assert int(t.rows[i]["mch.counts"]) == cols_all["mch.counts"][pos[i]]
        seen |= set(want)
        share = len(want) * row_bytes
        # its rows twice (the plan reads its ids and ranking slot, the load its rows), the other ids once
        # (8 bytes each, for the capacity check of every shard), a bucket at each end, the directories
        assert res.bytes_read <= 1.2 * (share + len(want) * 16) + 8 * ROWS + (256 << 10), (r, res.bytes_read, share)
        assert res.bytes_read < 0.6 * ROWS * row_bytes, (r, res.bytes_read)
    assert seen == set(ids_all.tolist())


def test_every_process_refuses_an_overflow_it_does_not_hold(tmp_path):
    _save(tmp_path)
    ids_all, _ = saved_rows()
    counts = np.bincount(route(ids_all, 3), minlength=3)
    big = int(np.argmax(counts))
    cap = int(counts[big]) - 1   # only the biggest shard overflows
    assert sorted(counts.tolist())[-2] <= cap
    for r in range(3):
        t = FakeRouted(r, 3, cap=cap)
        with pytest.raises(IncompatibleCheckpointError, match=rf"shards \[{big}\]"):
            Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=r, shard_num=3)
        assert not t.rows


def test_a_hash_bucketed_checkpoint_of_the_table_still_loads(tmp_path):
    man = _save(tmp_path, id_space=0)   # id_space 0: the table asks for "hash" buckets (checkpoints before id_range)
    assert man["bucket_fn"] == "hash" and "input_size" not in man
    ids_all, cols_all = saved_rows()
    t = FakeRouted(1, 3)
    res = Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=1, shard_num=3)
    assert sorted(t.rows) == sorted(ids_all[route(ids_all, 3) == 1].tolist())
    assert res.bytes_read >= ROWS * (8 + 4 * D)   # every bucket read


def test_manifest_validation_names_the_table(tmp_path):
    _save(tmp_path)
    good = json.load(open(tmp_path / "c" / "manifest.json"))
    info = manifest_from_json(good, "c/manifest.json").tables["mch_t"]
    assert (info.bucket_fn, info.input_size, info.bucket_args()) == ("id_range", H, {"num_rows": 0, "id_range": H})
    for bad in ({"input_size": None}, {"input_size": 0}, {"input_size": 1 << 63}, {"input_size": "100"},
                {"bucket_fn": "idrange"}, {"bucket_fn": "hash"}, {"num_rows": 100},
                {"column_blocks": {"slots": ["embedding"], "blocks": [[0, D]]}}):
        obj = json.loads(json.dumps(good))
        t = obj["tables"]["mch_t"]
        for k, v in bad.items():
            if v is None:
                del t[k]
            else:
                t[k] = v
        with pytest.raises(CorruptCheckpointError, match="mch_t"):
            manifest_from_json(obj, "c/manifest.json")


def test_model_free_readers_and_compaction_keep_the_id_range(tmp_path):
    """verify and the independent reader check every id against the id_range function; compaction keeps the
    table's "id_range" buckets, so a load of the compacted checkpoint stays bounded by the raw-id range."""
    from recckpt.tools.compaction import compact
    _save(tmp_path)
    ids_all, cols_all = saved_rows()
    assert verify(str(tmp_path / "c")).ok
    got = R.read_checkpoint(str(tmp_path / "c"))["tables"]["mch_t"]
    o, p = np.argsort(got["ids"]), np.argsort(ids_all)
    np.testing.assert_array_equal(got["ids"][o], ids_all[p])
    np.testing.assert_array_equal(got["slots"]["embedding"][o], cols_all["embedding"][p])
    R.check_digests(str(tmp_path / "c"))
    compact(str(tmp_path / "c"), str(tmp_path / "d"), fsync=False)
    t = json.load(open(tmp_path / "d" / "manifest.json"))["tables"]["mch_t"]
    assert (t["bucket_fn"], t["input_size"]) == ("id_range", H)
    dst = FakeRouted(0, 3)
    res = Saver(Holder(dst), output_dir=str(tmp_path)).load(ckpt_id="d", shard_id=0, shard_num=3)
    assert sorted(dst.rows) == sorted(ids_all[route(ids_all, 3) == 0].tolist())
    assert res.bytes_read < 0.6 * ROWS * (8 + 4 * D + 8)


def test_a_hash_routed_table_loading_an_id_range_checkpoint_gets_the_ids_partition_gives_it(tmp_path):
    """The checkpoint's buckets follow the raw-id range, not recckpt's hash ownership: a HashTable-like table
    loaded on 2 processes gets, on each, exactly the ids `recckpt.partition` routes there (it read every
    bucket), and the two together every id once."""
    from helpers.tables import DictTable, table_contents
    from recckpt import partition
    _save(tmp_path)
    ids_all, cols_all = saved_rows()
    seen = []
    for r in range(2):
        t = DictTable("mch_t", FakeRouted(0, 1).slots)
        Saver(Holder(t), output_dir=str(tmp_path)).load(ckpt_id="c", shard_id=r, shard_num=2)
        got = np.array(sorted(table_contents(t)["embedding"]), dtype=np.int64)
        want = np.sort(ids_all[np.asarray(partition(ids_all, 2, 4096)) == r])
        np.testing.assert_array_equal(got, want)
        seen.append(got)
    assert sorted(np.concatenate(seen).tolist()) == sorted(ids_all.tolist())
