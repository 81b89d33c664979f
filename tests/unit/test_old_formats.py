"""Checkpoints of every older readable format version load exactly (tests/fixtures/, written by the
recckpt that wrote version 3: see tests/fixtures/make_fixtures.py). Copied to a temporary directory
first, so a test can never change the committed fixtures."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import recckpt
from recckpt import HashTable, SaveOptions, Saver
from recckpt.format import names

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
DIM = 4


def expected_rows(version: str):
    """The formula of make_fixtures.expected_rows, repeated here so that neither can drift silently."""
    ids = np.arange(40, dtype=np.int64) * 7919 - 100_000
    emb = (ids[:, None] % 1000).astype(np.float32) / 8 + np.arange(DIM, dtype=np.float32)
    if version == "inc":
        emb[:5] += 1000
        ids, emb = ids[1:], emb[1:]
        ids = np.concatenate([ids, [123456789]])
        emb = np.concatenate([emb, np.full((1, DIM), 7.0, np.float32)])
    return ids, emb


class Step:
    def __init__(self):
        self.step = None

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.user = HashTable("user", DIM)
        self.lin = torch.nn.Linear(2, 2)


CASES = [  # (format version, checkpoint dir under fixtures, contents, step)
    (1, "v1/ckpt", "base", 3),
    (2, "v2/ckpt", "base", 3),
    (3, "v3/out/base", "base", 3),
    (3, "v3/out/inc", "inc", 4),
]


@pytest.fixture
def fixtures(tmp_path):
    dst = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, dst)
    return str(dst)


def _rows_by_id(ids, emb):
    o = np.argsort(ids)
    return ids[o], emb[o]


@pytest.mark.parametrize("version, rel, contents, step", CASES, ids=[c[1] for c in CASES])
def test_old_format_loads_exactly(fixtures, version, rel, contents, step):
    path = os.path.join(fixtures, rel)
    import json
    assert json.load(open(os.path.join(path, "manifest.json")))["format_version"] == version
    assert version in names.READABLE_FORMAT_VERSIONS
    m = Model()
    s = Saver(m, output_dir=os.path.join(fixtures, "unused"))
    st = Step()
    s.register_for_checkpointing("step", st)
    s.load(path, direct_path=True)
    want_ids, want_emb = _rows_by_id(*expected_rows(contents))
    ids = m.user.sparse_meta().num_rows
    assert ids == len(want_ids)
    got = [(i, c["embedding"]) for i, c in m.user.export_chunks(["embedding"], 1 << 20)]
    got_ids, got_emb = _rows_by_id(torch.cat([g[0] for g in got]).numpy(),
                                   torch.cat([g[1] for g in got]).numpy())
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_emb, want_emb)
    assert st.step == step
    assert torch.equal(m.lin.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(m.lin.bias, torch.tensor([0.5, -0.5]))
    report = recckpt.verify(path)
    assert report.ok, str(report)


@pytest.mark.parametrize("version, rel, contents, step", CASES, ids=[c[1] for c in CASES])
def test_old_format_reads_by_bucket_range(fixtures, version, rel, contents, step):
    """The reader's resharded reads (3 shards) of an old checkpoint give every row exactly once."""
    view = recckpt.open(os.path.join(fixtures, rel))
    parts = [list(view.iter_rows("user", shard=(r, 3))) for r in range(3)]
    ids = np.concatenate([c[0] for p in parts for c in p])
    emb = np.concatenate([c[1]["embedding"] for p in parts for c in p])
    want_ids, want_emb = _rows_by_id(*expected_rows(contents))
    got_ids, got_emb = _rows_by_id(ids, emb)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_emb, want_emb)


def test_version_4_increments_on_a_version_3_chain_load_exactly(fixtures):
    """A job that restored the version 3 chain (base, inc) and saves increments now writes version 4 links
    on it: the mixed chain loads exactly (its v4 links' indexes validated together, all links read
    together), on one rank and resharded."""
    out = os.path.join(fixtures, "v3", "out")
    m = Model()
    s = Saver(m, output_dir=out, max_keep=None, options=SaveOptions(num_buckets=16, chunk_bytes=64, fsync=False))
    s.register_for_checkpointing("step", Step())
    s.load(ckpt_id="inc")
    ids, emb = expected_rows("inc")
    for k in range(3):
        rows = torch.from_numpy(ids[k * 7:k * 7 + 9])
        m.user.write_rows("embedding", m.user.lookup(rows), torch.full((9, DIM), float(k)))
        m.user.remove_ids(torch.tensor([int(ids[30 + k])]))
        s.save(f"v4_{k}", incremental=True)
        assert s.last_save.parent == ("inc" if k == 0 else f"v4_{k - 1}")
    import json
    assert json.load(open(os.path.join(out, "v4_2", "manifest.json")))["format_version"] == names.FORMAT_VERSION
    def rows_of(table):
        got = [(i.numpy(), c["embedding"].numpy()) for i, c in table.export_chunks(["embedding"], 1 << 20)]
        return {int(i): r for ids_, emb_ in got for i, r in zip(ids_, emb_)}

    want = rows_of(m.user)
    assert len(want) == len(ids) - 3
    m2 = Model()
    s2 = Saver(m2, output_dir=out)
    s2.register_for_checkpointing("step", Step())
    s2.load()
    got = rows_of(m2.user)
    assert got.keys() == want.keys() and all(np.array_equal(got[i], want[i]) for i in want)
    view = recckpt.open(os.path.join(out, "v4_2"))
    parts = [c for r in range(3) for c in view.iter_rows("user", shard=(r, 3))]
    got_ids = np.concatenate([c[0] for c in parts])
    assert sorted(got_ids.tolist()) == sorted(want)
    assert recckpt.verify(os.path.join(out, "v4_2")).ok
