"""IdMap (recckpt._C.IdMap) against a Python dict model."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from recckpt import _C

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EXTREMES = [0, -1, 1, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1]

ids_strategy = st.lists(
    st.one_of(st.sampled_from(EXTREMES), st.integers(-20, 20), st.integers(INT64_MIN, INT64_MAX)), max_size=80
)


class Model:
    def __init__(self):
        self.rows = {}

    def insert(self, ids):
        rows, new = [], []
        for i in ids:
            if i in self.rows:
                rows.append(self.rows[i])
                new.append(False)
            else:
                self.rows[i] = len(self.rows)
                rows.append(self.rows[i])
                new.append(True)
        return rows, new

    def lookup(self, ids):
        return [self.rows.get(i, -1) for i in ids]


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(ids_strategy, max_size=8), probe=ids_strategy, capacity=st.integers(0, 40))
def test_idmap_matches_dict_model(batches, probe, capacity):
    m, model = _C.IdMap(capacity), Model()
    for batch in batches:
        arr = np.array(batch, dtype=np.int64)
        rows, is_new = m.insert(arr)
        exp_rows, exp_new = model.insert(batch)
        assert rows.dtype == np.int64 and is_new.dtype == np.bool_
        assert rows.tolist() == exp_rows
        assert is_new.tolist() == exp_new
        assert len(m) == m.size == len(model.rows)
    assert m.lookup(np.array(probe, dtype=np.int64)).tolist() == model.lookup(probe)
    keys = m.keys()
    assert keys.dtype == np.int64
    assert keys.tolist() == list(model.rows)  # keys[row] == id, in insertion order


def test_idmap_extremes_and_duplicates_in_one_batch():
    m = _C.IdMap()
    ids = np.array([INT64_MAX, INT64_MIN, 0, -1, INT64_MAX, 0, INT64_MIN, -1], np.int64)
    rows, is_new = m.insert(ids)
    assert rows.tolist() == [0, 1, 2, 3, 0, 2, 1, 3]
    assert is_new.tolist() == [True] * 4 + [False] * 4
    assert m.lookup(np.array([1, -2, INT64_MAX - 1, INT64_MIN + 1], np.int64)).tolist() == [-1] * 4
    assert m.lookup(np.array([-1, INT64_MIN], np.int64)).tolist() == [3, 1]


def test_idmap_empty_inputs():
    m = _C.IdMap()
    rows, is_new = m.insert(np.empty(0, np.int64))
    assert rows.shape == (0,) and is_new.shape == (0,)
    assert m.lookup(np.empty(0, np.int64)).shape == (0,)
    assert m.keys().shape == (0,) and len(m) == 0


def test_idmap_growth_one_million():
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(INT64_MIN, INT64_MAX, size=1_000_000, dtype=np.int64, endpoint=True))
    rng.shuffle(ids)
    m = _C.IdMap()  # not presized: grows many times, inserting in batches of varying size
    start, cap0 = 0, m.capacity
    for size in [1, 7, 1000, 50_000, 300_000, len(ids)]:
        rows, is_new = m.insert(ids[start:size])
        assert is_new.all()
        np.testing.assert_array_equal(rows, np.arange(start, size))
        start = size
    assert len(m) == len(ids) and m.capacity > cap0
    assert len(m) <= 0.7 * m.capacity
    np.testing.assert_array_equal(m.lookup(ids), np.arange(len(ids)))
    np.testing.assert_array_equal(m.keys(), ids)
    absent = ids[:1000] ^ np.int64(0x5555)
    absent = absent[~np.isin(absent, ids)]
    assert (m.lookup(absent) == -1).all()
    rows, is_new = m.insert(ids[::-1].copy())  # all present: no new rows
    assert not is_new.any() and len(m) == len(ids)
    np.testing.assert_array_equal(rows, np.arange(len(ids))[::-1])


def test_idmap_reserve_and_clear():
    m = _C.IdMap()
    c0 = m.capacity
    m.reserve(100_000)
    c1 = m.capacity
    assert c1 > c0 and 100_000 <= 0.7 * c1
    ids = np.arange(-50_000, 50_000, dtype=np.int64) * 7919
    m.insert(ids)
    assert m.capacity == c1, "a presized map does not grow"
    m.reserve(10)  # never shrinks, keeps keys
    assert m.capacity == c1 and len(m) == 100_000
    np.testing.assert_array_equal(m.lookup(ids), np.arange(100_000))
    m.clear()
    assert len(m) == 0 and m.keys().shape == (0,)
    assert (m.lookup(ids[:100]) == -1).all()
    rows, is_new = m.insert(ids[50:53])  # rows restart at 0 after clear
    assert rows.tolist() == [0, 1, 2] and is_new.all()
    presized = _C.IdMap(1000)
    assert 1000 <= 0.7 * presized.capacity


def test_idmap_rejects_bad_input():
    m = _C.IdMap()
    with pytest.raises(TypeError, match="int64"):
        m.insert(np.arange(3, dtype=np.int32))
    with pytest.raises(TypeError, match="int64"):
        m.lookup(np.arange(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="contiguous"):
        m.insert(np.arange(6, dtype=np.int64)[::2])
    with pytest.raises(ValueError, match="1-D"):
        m.insert(np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError):
        m.insert([1, 2, 3])
    with pytest.raises(ValueError):
        _C.IdMap(-1)
    with pytest.raises(ValueError):
        m.reserve(-5)
    assert len(m) == 0


def test_idmap_concurrent_inserts_are_consistent():
    m = _C.IdMap()
    batches = [np.arange(k, 400_000, 4, dtype=np.int64) for k in range(4)]
    out = [None] * 4

    def run(k):
        out[k] = m.insert(batches[k])[0]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == 400_000
    allrows = np.concatenate(out)
    assert np.array_equal(np.sort(allrows), np.arange(400_000))
    keys = m.keys()
    for b, r in zip(batches, out):
        np.testing.assert_array_equal(keys[r], b)


def test_idmap_keys_and_len_while_another_thread_inserts():
    m = _C.IdMap()
    batches = [np.arange(k * 20_000, (k + 1) * 20_000, dtype=np.int64) * -3 for k in range(50)]
    expected = np.concatenate(batches)
    done = threading.Event()

    def writer():
        for b in batches:
            m.insert(b)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    snapshots = 0
    while not done.is_set() or snapshots == 0:
        n = len(m)
        keys = m.keys()
        assert len(keys) >= n and len(keys) % 20_000 == 0  # whole batches only: insert is atomic
        np.testing.assert_array_equal(keys, expected[: len(keys)])
        snapshots += 1
    t.join()
    np.testing.assert_array_equal(m.keys(), expected)
