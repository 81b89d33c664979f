"""The chain fold (recckpt.format.fold and the engine's fold_links/copy_rows): newest event wins, removed
ids stay removed, each winning row lands once in its place, in any bucket grouping; duplicates within one
link decided by the workers' recorded steps, never by read order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recckpt import _C, HashTable, SaveOptions, Saver
from recckpt.errors import DuplicateIdsError
from recckpt.format.chain import open_chain
from recckpt.format.checkpoint import CheckpointReader
from recckpt.format.fold import bucket_groups, fold_rows, plan_fold
from recckpt.storage import open_storage

OPTS = SaveOptions(num_buckets=16, chunk_bytes=256, segment_bytes=4096, fsync=False)


def _reference(links):
    """dict id -> (link, row index) of the newest row event, ids whose newest event is a removal absent."""
    state = {}
    for j, (rows, removed) in enumerate(links):
        for i, x in enumerate(rows):
            state[int(x)] = (j, i)
        for x in removed:
            state.pop(int(x), None)
    return state


@pytest.mark.parametrize("seed", range(6))
def test_engine_fold_matches_a_dictionary_replay(seed):
    rng = np.random.default_rng(seed)
    links = [(rng.permutation(rng.choice(400, 200, replace=False)).astype("<i8"), np.empty(0, "<i8"))]
    for _ in range(int(rng.integers(1, 6))):
        ids = rng.choice(600, 160, replace=False)
        rows, removed = ids[:120].astype("<i8"), ids[120:].astype("<i8")   # disjoint within a link
        links.append((rows, removed))
    r = _C.fold_links([a for a, _ in links], [b for _, b in links], [None] * len(links), [None] * len(links))
    assert len(r["dup_ids"]) == 0
    n_base = len(links[0][0])
    out = {}                                     # position -> (link, row)
    out.update({i: (0, i) for i in range(n_base)})
    for j in range(1, len(links)):
        assert np.all(np.diff(r["src"][j]) > 0)   # read order: one pass over each link's rows
        for s, d in zip(r["src"][j], r["dst"][j]):
            out[int(d)] = (j, int(s))
    for h in r["holes"]:
        out.pop(int(h))
    assert set(out) <= set(range(n_base + r["new_rows"]))
    got = {int(links[j][0][i]): (j, i) for j, i in out.values()}
    assert got == _reference(links)
    assert len(got) == len(out)                  # no id twice in the output
    base_ids = links[0][0]
    assert np.array_equal(np.sort(r["hole_ids"]), np.sort(base_ids[r["holes"]]))


@pytest.mark.parametrize("seed", range(3))
def test_engine_fold_matches_a_dictionary_replay_across_partitions(seed):
    """Enough events (~90 000) that the engine splits them into many partitions by id before folding, with
    masked events in every link: the same answer as replaying the events in a dictionary."""
    rng = np.random.default_rng(100 + seed)
    base = rng.permutation(60_000).astype("<i8") * 7 - 200_000       # negative ids too
    links = [(base, np.empty(0, "<i8"))]
    masks = [(rng.random(len(base)) < 0.01, None)]
    for _ in range(8):
        ids = rng.choice(np.concatenate([base, np.arange(10 ** 6, 10 ** 6 + 5000)]), 4000, replace=False)
        rows, removed = ids[:3500].astype("<i8"), ids[3500:].astype("<i8")
        links.append((rows, removed))
        masks.append((rng.random(len(rows)) < 0.05, rng.random(len(removed)) < 0.05))
    r = _C.fold_links([a for a, _ in links], [b for _, b in links], [m for m, _ in masks], [m for _, m in masks])
    assert len(r["dup_ids"]) == 0
    kept = [(rows[~m], removed if g is None else removed[~g]) for (rows, removed), (m, g) in zip(links, masks)]
    ref = _reference(kept)
    index_of = [np.flatnonzero(~m) for m, _ in masks]                # kept position -> position in the link
    want = {x: (j, int(index_of[j][i])) for x, (j, i) in ref.items()}
    n_base = len(base)
    out = {i: (0, i) for i in range(n_base)}
    for j in range(1, len(links)):
        assert np.all(np.diff(r["src"][j]) > 0)
        for sidx, d in zip(r["src"][j], r["dst"][j]):
            assert int(d) not in out or int(d) < n_base
            out[int(d)] = (j, int(sidx))
    for h in r["holes"]:
        del out[int(h)]
    got = {int(links[j][0][i]): (j, i) for j, i in out.values()}
    assert got == want and len(got) == len(out)
    assert set(out) <= set(range(n_base + r["new_rows"]))
    assert np.array_equal(np.sort(r["hole_ids"]), np.sort(base[r["holes"]]))


def _decided(r, rows):
    """What a fold decided, independent of where its (randomly keyed) partitions put new rows: id -> (link,
    row) of every winning row, the hole ids, the duplicates; checks that every output position is filled
    once, a replaced base row by a row of its own id."""
    n_base = len(rows[0])
    dst = np.concatenate([r["dst"][j] for j in range(1, len(rows))])
    ids = np.concatenate([rows[j][r["src"][j]] for j in range(1, len(rows))])
    assert len(np.unique(dst)) == len(dst)
    assert np.array_equal(np.sort(dst[dst >= n_base]), np.arange(n_base, n_base + r["new_rows"]))
    assert np.array_equal(rows[0][dst[dst < n_base]], ids[dst < n_base])
    where = {}
    for j in range(1, len(rows)):
        where.update(zip(rows[j][r["src"][j]].tolist(), zip([j] * len(r["src"][j]), r["src"][j].tolist())))
    return (where, sorted(r["hole_ids"].tolist()), sorted(zip(r["dup_link"].tolist(), r["dup_ids"].tolist())),
            r["new_rows"])


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_engine_fold_on_threads_decides_as_on_one(threads):
    """The partitions are folded on several threads (enough events for each): the same winners, holes,
    duplicates and new rows as on one thread."""
    rng = np.random.default_rng(threads)
    base = rng.permutation(300_000).astype("<i8") * 3 - 10 ** 6
    base = np.concatenate([base, base[:25]])                         # base duplicates: holes
    rows = [base]
    removed = [np.empty(0, "<i8")]
    for _ in range(6):
        ids = rng.choice(np.concatenate([base, np.arange(10 ** 7, 10 ** 7 + 80_000)]), 60_000, replace=False)
        rows.append(np.concatenate([ids[:50_000], ids[:10]]).astype("<i8"))   # and duplicates in a link
        removed.append(ids[50_000:].astype("<i8"))
    masks = [rng.random(len(r)) < 0.02 for r in rows]
    one = _C.fold_links(rows, removed, masks, [None] * len(rows))
    many = _C.fold_links(rows, removed, masks, [None] * len(rows), threads=threads)
    assert one["new_rows"] > 0 and len(one["holes"]) > 0 and len(one["dup_ids"]) > 0
    assert _decided(one, rows) == _decided(many, rows)
    for j in range(1, len(rows)):
        assert np.all(np.diff(many["src"][j]) > 0)


def test_engine_reports_every_duplicate_across_partitions():
    rng = np.random.default_rng(7)
    base = rng.permutation(50_000).astype("<i8")
    base_dups = base[rng.choice(50_000, 40, replace=False)]
    inc = rng.choice(80_000, 20_000, replace=False).astype("<i8")
    inc_dups = inc[:30]
    r = _C.fold_links([np.concatenate([base, base_dups]), np.concatenate([inc, inc_dups])],
                      [np.empty(0, "<i8"), np.empty(0, "<i8")], [None, None], [None, None])
    got = sorted(zip(r["dup_link"].tolist(), r["dup_ids"].tolist()))
    assert got == sorted([(0, int(x)) for x in base_dups] + [(1, int(x)) for x in inc_dups])
    # the first copy of a base id keeps its place; the later copies are holes
    assert sorted(r["holes"].tolist()) == list(range(50_000, 50_040))


def test_engine_reports_duplicates_within_a_link_and_skips_masked_events():
    base = np.array([1, 2, 2, 3], dtype="<i8")
    inc = np.array([4, 4, 1], dtype="<i8")
    r = _C.fold_links([base, inc], [np.empty(0, "<i8"), np.array([3], "<i8")], [None, None], [None, None])
    assert sorted(zip(r["dup_link"].tolist(), r["dup_ids"].tolist())) == [(0, 2), (1, 4)]
    skip = np.array([0, 1, 0], dtype=bool)       # the second copy of 4 is left out: no duplicate
    r = _C.fold_links([base, inc], [np.empty(0, "<i8"), np.array([3], "<i8")],
                      [np.array([0, 0, 1, 0], dtype=bool), skip], [None, None])
    assert len(r["dup_ids"]) == 0
    assert sorted(r["hole_ids"].tolist()) == [2, 3]   # the skipped base copy, and the removed id
    assert r["new_rows"] == 1 and r["src"][1].tolist() == [0, 2] and r["dst"][1].tolist() == [4, 0]


def test_copy_rows_checks_indexes_and_sizes():
    src = np.arange(12, dtype=np.uint8)
    dst = np.zeros(12, dtype=np.uint8)
    _C.copy_rows(src, np.array([2, 0], "<i8"), dst, np.array([0, 2], "<i8"), 4)
    assert dst.tolist() == [8, 9, 10, 11, 0, 0, 0, 0, 0, 1, 2, 3]
    with pytest.raises(IndexError):
        _C.copy_rows(src, np.array([3], "<i8"), dst, np.array([0], "<i8"), 4)
    with pytest.raises(ValueError, match="whole rows"):
        _C.copy_rows(src, np.array([0], "<i8"), dst, np.array([0], "<i8"), 5)
    read_only = np.zeros(12, np.uint8)
    read_only.setflags(write=False)
    with pytest.raises((ValueError, BufferError), match="writable|read-only"):
        _C.copy_rows(src, np.array([0], "<i8"), read_only, np.array([0], "<i8"), 4)


@pytest.mark.parametrize("rows", [1000, 200_000])   # one thread, and big enough to be spread over several
def test_copy_rows_scatters_like_numpy(rows):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (rows, 96), dtype=np.uint8)
    dst = np.zeros((rows * 2, 96), dtype=np.uint8)
    s_idx = rng.integers(0, rows, rows // 2).astype("<i8")
    d_idx = rng.permutation(rows * 2)[: rows // 2].astype("<i8")
    _C.copy_rows(src.reshape(-1), s_idx, dst.reshape(-1), d_idx, 96)
    want = np.zeros_like(dst)
    want[d_idx] = src[s_idx]
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("rows", [1000, 200_000])
def test_copy_rows_moves_rows_forward_within_one_buffer(rows):
    # What dropping holes in place does: kept rows move to the front, in order, in the same memory.
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, (rows, 64), dtype=np.uint8)
    keep = np.flatnonzero(rng.random(rows) > 0.3)
    want = buf[keep].copy()
    first = int(np.flatnonzero(keep != np.arange(len(keep)))[0])
    _C.copy_rows(buf.reshape(-1), keep[first:].astype("<i8"), buf.reshape(-1),
                 np.arange(first, len(keep), dtype="<i8"), 64)
    assert np.array_equal(buf[:len(keep)], want)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4, track_changes=True)


def _chain(tmp_path, n_incr=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = Model()
    s = Saver(m, output_dir=tmp_path, max_keep=None, options=OPTS)
    m.emb.lookup(torch.randint(0, 400, (300,), generator=gen), insert=True)
    m.emb.write_rows("embedding", torch.arange(len(m.emb)), torch.randn(len(m.emb), 4, generator=gen))
    s.save("c0")
    for k in range(1, n_incr + 1):
        rows = m.emb.lookup(torch.randint(0, 600, (80,), generator=gen), insert=True)
        m.emb.write_rows("embedding", rows, torch.randn(rows.numel(), 4, generator=gen))
        m.emb.remove_ids(torch.randint(0, 600, (20,), generator=gen))
        s.save(f"c{k}", incremental=True)
    want = dict(zip(m.emb.ids().tolist(), m.emb.weight.detach().clone()))
    return open_chain(CheckpointReader(open_storage(str(tmp_path)), f"c{n_incr}")), want


@pytest.mark.parametrize("group_bytes", [1, 2000, 256 << 20])
def test_fold_rows_gives_the_newest_state_in_any_grouping(tmp_path, group_bytes):
    links, want = _chain(tmp_path)
    assert len(links) == 5
    got = {}
    for ids, cols in fold_rows(links, "emb", ["embedding"], group_bytes=group_bytes):
        assert ids.dtype == np.int64 and cols[0].shape == (len(ids), 16)
        emb = torch.from_numpy(cols[0].copy()).view(torch.float32)
        for i, row in zip(ids.tolist(), emb):
            assert i not in got
            got[i] = row
    assert set(got) == set(want)
    assert all(torch.equal(got[i], want[i]) for i in want)
    if group_bytes == 1:
        assert len(bucket_groups(links, "emb", 0, 16, 1)) == 16


def test_fold_of_a_bucket_range_is_that_range_of_the_state(tmp_path):
    links, want = _chain(tmp_path, seed=3)
    from recckpt.format.hashing import bucket_of
    ids = np.concatenate([i for i, _ in fold_rows(links, "emb", [], lo=4, hi=9)])
    w = np.array(sorted(want), dtype=np.int64)
    b = bucket_of(w, 16)
    assert sorted(ids.tolist()) == w[(b >= 4) & (b < 9)].tolist()
    plan = plan_fold(links, "emb", 4, 9)
    assert plan.rows == len(ids)


def _two_workers_touch_one_id(out, steps):
    """Two workers save one chain; in the increment both store id 5 (inconsistent routing)."""
    tables = []
    for w in range(2):
        m = Model()
        m.emb.lookup(torch.tensor([10 * w + 1, 10 * w + 2]), insert=True)
        tables.append((m, Saver(m, output_dir=out, max_keep=None, options=OPTS)))
    for w, (_, s) in enumerate(tables):
        s.save("c0", shard_id=w, shard_num=2, step=1)
    for w, (m, s) in enumerate(tables):
        rows = m.emb.lookup(torch.tensor([5]), insert=True)
        m.emb.write_rows("embedding", rows, torch.full((1, 4), float(w + 1)))
        s.save("c1", shard_id=w, shard_num=2, step=steps[w], incremental=True)
    c1 = CheckpointReader(open_storage(str(out)), "c1")
    assert c1.manifest.parent.ckpt_id == "c0" and c1.manifest.tables["emb"].changes


@pytest.mark.parametrize("steps,winner", [((20, 10), 0), ((10, 20), 1)])
def test_duplicates_within_a_link_newest_keeps_the_higher_step(tmp_path, steps, winner):
    _two_workers_touch_one_id(tmp_path, steps)
    m = Model()
    with pytest.raises(DuplicateIdsError, match=r"c1.*table 'emb': id 5 is stored more than once"):
        Saver(m, output_dir=tmp_path, options=OPTS).load(ckpt_id="c1")
    assert len(m.emb) == 0
    for world in (1, 2):
        got = {}
        for rank in range(world):
            m = Model()
            Saver(m, output_dir=tmp_path, options=OPTS).load(ckpt_id="c1", shard_id=rank, shard_num=world,
                                                             load_conf={"duplicates": "newest"})
            got.update(zip(m.emb.ids().tolist(), m.emb.weight.detach()))
        assert sorted(got) == [1, 2, 5, 11, 12]
        assert torch.equal(got[5], torch.full((4,), float(winner + 1)))


def test_duplicates_within_a_link_with_equal_steps_are_refused(tmp_path):
    _two_workers_touch_one_id(tmp_path, (7, 7))
    m = Model()
    with pytest.raises(DuplicateIdsError, match="steps are equal or were not recorded"):
        Saver(m, output_dir=tmp_path, options=OPTS).load(ckpt_id="c1", load_conf={"duplicates": "newest"})
    assert len(m.emb) == 0
