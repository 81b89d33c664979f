"""docs/FORMAT.md "Content digests": the independent reader recomputes every digest a save records from
the rows it reads, for every dtype (BF16 and BOOL included), on one worker and on several."""
import json

import numpy as np
import pytest

from spec import independent_reader as R

torch = pytest.importorskip("torch", reason="the library under test needs torch")
recckpt = pytest.importorskip("recckpt", reason="recckpt (and its C++ extension) is not importable")
from helpers.tables import DictTable  # noqa: E402
from recckpt import SaveOptions, Saver  # noqa: E402
from recckpt.state.protocol import SlotSpec  # noqa: E402

_M = (1 << 64) - 1


def _fmix(z):
    z = ((z ^ (z >> 33)) * 0xFF51AFD7ED558CCD) & _M
    z = ((z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53) & _M
    return z ^ (z >> 33)


def _splitmix(x):
    z = (x + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _mul(v, x):
    return ((v ^ x) & 0xFFFFFFFF) * ((x >> 32) | 1)


def _by_the_words(ids, rows, function):
    """FORMAT.md's definition, element by element in Python integers."""
    a = b = 0
    small = np.asarray(rows).dtype.itemsize <= 4
    for i, row in zip(ids, rows):
        u = int(i) & _M
        ka, kb = _splitmix(u ^ 0x243F6A8885A308D3), _fmix(u ^ 0x13198A2E03707344)
        for e, v in enumerate(np.ascontiguousarray(row).reshape(-1).tolist()):
            v = int(v) & _M
            xa, xb = (ka + e * 0x9E3779B97F4A7C15) & _M, (kb + e * 0xD6E8FEB86659FD93) & _M
            if function == "mulsum128" and small:
                a, b = (a + _mul(v, xa)) & _M, (b + _mul(v, xb)) & _M
            else:
                a, b = (a + _splitmix(v ^ xa)) & _M, (b + _fmix(v ^ xb)) & _M
    return f"{a:016x}{b:016x}"


@pytest.mark.parametrize("function", ["mulsum128", "rowsum128"])
def test_reader_digest_follows_the_definition(function):
    ids = np.array([0, -1, 7, -(1 << 63), (1 << 63) - 1], np.int64)
    g = np.random.default_rng(0)
    for rows in (g.integers(0, 1 << 32, (5, 3), dtype=np.uint64).astype(np.uint32),
                 np.full((5, 2), 0xFFFFFFFF, np.uint32),   # every bit set: the product's largest factors
                 g.integers(0, 1 << 16, (5, 2, 2), dtype=np.uint16),
                 g.integers(0, 256, (5,), dtype=np.uint8),
                 g.integers(-(1 << 63), (1 << 63) - 1, (5, 1), dtype=np.int64).view(np.uint64)):
        assert R.digest_rows(ids, rows, function=function) == _by_the_words(ids, rows, function)
    ka = [_splitmix((int(i) & _M) ^ 0x243F6A8885A308D3) for i in ids]
    kb = [_fmix((int(i) & _M) ^ 0x13198A2E03707344) for i in ids]
    assert R.digest_ids(ids) == f"{sum(ka) & _M:016x}{sum(kb) & _M:016x}"


SPEC = {"embedding": SlotSpec(torch.bfloat16, (6,), "sparse"),
        "mask": SlotSpec(torch.bool, (3,), "sparse"),
        "m": SlotSpec(torch.float64, (2, 2), "sparse_opt"),
        "n": SlotSpec(torch.int16, (), "sparse_opt")}


class _Model(torch.nn.Module):
    def __init__(self, ids, cols):
        super().__init__()
        self.t = DictTable("t", SPEC)
        self.t.set_rows(ids, cols)
        self.w = torch.nn.Parameter(torch.arange(10, dtype=torch.bfloat16).reshape(2, 5))
        self.register_buffer("on", torch.tensor([True, False, True]))


@pytest.mark.parametrize("workers, buckets", [(1, 4096), (3, 7)])
def test_every_recorded_digest_is_recomputed_by_the_reader(tmp_path, workers, buckets):
    g = torch.Generator().manual_seed(1)
    n = 700
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (n,), generator=g))
    n = ids.numel()
    cols = {"embedding": torch.randn(n, 6, generator=g).to(torch.bfloat16),
            "mask": torch.rand(n, 3, generator=g) > 0.5,
            "m": torch.randn(n, 2, 2, generator=g, dtype=torch.float64),
            "n": torch.randint(-1000, 1000, (n,), generator=g).to(torch.int16)}
    opts = SaveOptions(num_buckets=buckets, segment_bytes=4096, fsync=False)
    for w in range(workers):
        sel = torch.arange(n)[w::workers]
        s = Saver(_Model(ids[sel], {k: v[sel] for k, v in cols.items()}), output_dir=str(tmp_path), options=opts)
        if workers == 1:
            s.save("c")
        else:
            s.save("c", shard_id=w, shard_num=workers)
    got = R.check_digests(str(tmp_path / "c"))   # raises naming the table/slot whose digest differs
    path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(path.read_text())
    have = manifest["digests"]
    assert have["tables"] == got["tables"]
    assert {k: v["digest"] for k, v in have["dense"].items()} == {k: v["digest"] for k, v in got["dense"].items()}
    assert have["dense"]["w"]["dtype"] == "BF16" and have["dense"]["on"]["dtype"] == "BOOL"
    # a digest that does not describe the rows is caught, naming the slot
    manifest.pop("crc32c")
    have["tables"]["t"]["slots"]["mask"] = have["tables"]["t"]["slots"]["n"]
    manifest["crc32c"] = R.crc32c(R.canonical_json(manifest))
    path.write_text(json.dumps(manifest))
    with pytest.raises(R.CorruptError, match="slot 'mask'"):
        R.check_digests(str(tmp_path / "c"))
