"""Hash flooding (issue 30 item 9): ids chosen through the inverse of mix64 all share one bucket, and
before the id map's homes were keyed they all shared one home slot (quadratic inserts). The map's
probe count (`IdMap.probes`: slots visited by lookups) shows the clustering without timing anything;
the hostile corpus (id_flood_*) bounds the time of loading such a checkpoint in a child process."""
from __future__ import annotations

import numpy as np

from recckpt import _C
from recckpt.format.hashing import mix64, unmix64

N = 200_000


def chosen_ids(n, step=4096):
    return unmix64(np.arange(n, dtype=np.uint64) * np.uint64(step))


def probes_per_id(ids, bulk=True):
    m = _C.IdMap()
    if bulk:
        assert m.insert_new(ids) == len(ids)
    else:
        rows, new = m.insert(ids)
        assert new.all() and (rows == np.arange(len(ids))).all()
    return m.probes(ids) / len(ids)


def test_unmix64_inverts_mix64():
    x = np.random.default_rng(1).integers(-(1 << 63), (1 << 63) - 1, 100_000, dtype=np.int64)
    assert (unmix64(mix64(x)) == x).all()
    assert (mix64(unmix64(np.arange(5, dtype=np.uint64) * np.uint64(4096))) == np.arange(5) * 4096).all()


def test_chosen_ids_share_one_bucket():
    """The attack is real: the on-disk bucket function stays deterministic, so these ids share bucket 0."""
    assert (_C.bucket_of(chosen_ids(1000), 4096) == 0).all()


def test_chosen_ids_probe_like_random_ids():
    rand = np.random.default_rng(0).integers(-(1 << 62), 1 << 62, N)
    base = probes_per_id(rand)
    assert base < 2.0, base
    for ids in (chosen_ids(N), chosen_ids(N, step=1), chosen_ids(N, step=1 << 40)):
        for bulk in (True, False):   # insert_new (loads) and insert (training) grow the map differently
            got = probes_per_id(ids, bulk)
            assert got <= 1.5 * base + 0.5, (got, base)


def test_each_map_has_its_own_key():
    """Homes differ between maps (each draws a key), yet rows are insertion order in every map."""
    ids = chosen_ids(50_000)
    maps = [_C.IdMap() for _ in range(2)]
    for m in maps:
        m.insert_new(ids)
        assert (m.lookup(ids) == np.arange(len(ids))).all()
        assert (m.keys() == ids).all()
    # A probe count is a function of the key: two equal counts over 50k ids would be a coincidence.
    counts = [m.probes(ids) for m in maps]
    assert counts[0] != counts[1], counts
