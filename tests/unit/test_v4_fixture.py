"""Format version 4 checkpoints still load exactly (tests/fixtures/v4, written by the recckpt that wrote
version 4: see tests/fixtures/make_fixtures_v4.py): a chain of two fixed-size tables, one by row ranges and
one column-split, loaded on one process and resharded onto other row and column splits, read by the
model-free tools, given the same content digests when saved again in format version 5 (whose layout
differs: column groups, row runs), and extended by a version 5 increment whose chain loads exactly too.
Copied to a temporary directory first, so a test can never change the committed fixtures."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from spec import independent_reader as R

import recckpt
from recckpt import SaveOptions, Saver
from recckpt.format import names
from recckpt.format.checkpoint import CheckpointReader
from recckpt.format.verifier import verify
from recckpt.state.protocol import Changes, RowRangeLayout, SlotSpec, SparseTableMeta
from recckpt.storage import open_storage

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
N, D = 96, 8
SAVED_BLOCKS = ((0, 3), (3, 8))
CHANGED = np.r_[10:20, 60:63]


def expected_rows(table: str, version: str, block: int = 0) -> dict:
    """The formula of make_fixtures_v4.expected_rows, repeated here so that neither can drift silently."""
    ids = np.arange(N)
    emb = (ids[:, None] * 0.25 + np.arange(D)).astype(np.float32)
    acc = (ids[:, None] % 7 + np.arange(D) * 0.5).astype(np.float32)
    out = {"embedding": emb, "adagrad.acc": acc}
    if table == "fixed":
        out["count"] = (ids * 3).astype(np.int32)
        if version == "inc":
            out["embedding"] = emb.copy()
            out["embedding"][CHANGED] += 1000
    else:
        out["rowacc"] = (ids % 5 + 100.0 * (block + 1)).astype(np.float32)
    return out


def rowacc_for(c0: int, c1: int) -> np.ndarray:
    """docs/TORCHREC.md: a loader of columns [c0, c1) gets the width-weighted mean of the saved blocks' values."""
    acc, tot = np.zeros(N), 0
    for j, (a, b) in enumerate(SAVED_BLOCKS):
        w = min(b, c1) - max(a, c0)
        if w > 0:
            acc += expected_rows("cw", "base", j)["rowacc"].astype(np.float64) * w
            tot += w
    return (acc / tot).astype(np.float32)


def slots_of(table: str) -> dict:
    out = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
           "adagrad.acc": SlotSpec(torch.float32, (D,), "sparse_opt")}
    out["count" if table == "fixed" else "rowacc"] = (SlotSpec(torch.int32, (), "sparse") if table == "fixed"
                                                     else SlotSpec(torch.float32, (), "sparse_opt"))
    return out


class Table(torch.nn.Module):
    """A fixed-size table of N rows as one process holds it: rows `owned`, columns `columns` of the split
    slots (with the plan's `blocks`); rows written by loads, exported by saves, with change tracking."""

    def __init__(self, name, owned, columns=None, blocks=None):
        super().__init__()
        self.name = name
        self.layout = RowRangeLayout(N, owned, columns, False, blocks)
        c0, c1 = columns or (0, D)
        self.data = {k: np.full((N, c1 - c0) if s.shape else (N,), -1, dtype=torch.empty(0, dtype=s.dtype).numpy().dtype)
                     for k, s in slots_of(name).items()}
        self.got = np.zeros(N, dtype=np.int64)
        self.changed: list[set] = []

    def row_layout(self):
        return self.layout

    def sparse_meta(self):
        return SparseTableMeta(self.name, slots_of(self.name), self.layout.owned_count)

    def owned(self) -> np.ndarray:
        return np.concatenate([np.arange(a, b) for a, b in self.layout.owned_rows]).astype(np.int64)

    def import_rows(self, ids, columns):
        i = ids.numpy()
        for k, v in columns.items():
            assert tuple(v.shape[1:]) == self.data[k].shape[1:], (k, tuple(v.shape))
            self.data[k][i] = v.numpy()
        self.got[i] += 1

    def clear_rows(self):
        self.changed = [None] * len(self.changed)

    def _chunks(self, ids, slots, max_rows):
        for s in range(0, len(ids), max_rows):
            part = ids[s:s + max_rows]
            yield torch.from_numpy(part), {k: torch.from_numpy(np.ascontiguousarray(self.data[k][part])) for k in slots}

    def export_chunks(self, slots, max_rows):
        yield from self._chunks(self.owned(), slots, max_rows)

    def get_extra_state(self):
        return self

    def set_extra_state(self, state):
        pass


class Tracked(Table):
    """`Table` with change tracking (ChangeTracking): the rows written since each mark."""

    def mark_changes(self):
        self.changed.append(set())
        return len(self.changed) - 1

    def export_changes(self, since, slots, max_rows):
        if self.changed[since] is None:
            return None
        ids = np.array(sorted(self.changed[since]), dtype=np.int64)
        return Changes(len(ids), self._chunks(ids, slots, max_rows), torch.empty(0, dtype=torch.int64))

    def forget_changes(self, upto):
        pass

    def write(self, ids: np.ndarray, emb: np.ndarray):
        mine = np.isin(ids, self.owned())
        self.data["embedding"][ids[mine]] = emb[mine]
        for c in self.changed:
            if c is not None:
                c.update(ids[mine].tolist())


class Model(torch.nn.Module):
    def __init__(self, owned=((0, N),), columns=None, blocks=None):
        super().__init__()
        self.fixed = Tracked("fixed", owned)
        self.cw = Table("cw", ((0, N),), columns, blocks)
        self.lin = torch.nn.Linear(2, 2)


@pytest.fixture
def out(tmp_path):
    dst = tmp_path / "v4"
    shutil.copytree(os.path.join(FIXTURES, "v4"), dst)
    return str(dst / "out")


def _check(model: Model, version: str, columns=None):
    want = expected_rows("fixed", version)
    rows = model.fixed.owned()
    assert (model.fixed.got[rows] == 1).all() and (np.delete(model.fixed.got, rows) == 0).all()
    for k, v in want.items():
        np.testing.assert_array_equal(model.fixed.data[k][rows], v[rows], err_msg=k)
    c0, c1 = columns or (0, D)
    cw = expected_rows("cw", "base")
    assert (model.cw.got == 1).all()
    for k in ("embedding", "adagrad.acc"):
        np.testing.assert_array_equal(model.cw.data[k], cw[k][:, c0:c1], err_msg=k)
    np.testing.assert_array_equal(model.cw.data["rowacc"], rowacc_for(c0, c1))


def test_the_fixture_is_format_version_4(out):
    for ck in ("base", "inc"):
        assert json.load(open(os.path.join(out, ck, "manifest.json")))["format_version"] == 4
    assert 4 in names.READABLE_FORMAT_VERSIONS and names.FORMAT_VERSION == 5


@pytest.mark.parametrize("version", ["base", "inc"])
def test_loads_exactly_on_one_process(out, version):
    m = Model()
    res = Saver(m, output_dir=out).load(ckpt_id=version)
    _check(m, version)
    assert res.ckpt_id == version
    torch.testing.assert_close(m.lin.weight.detach(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_loads_exactly_resharded_onto_other_row_and_column_splits(out):
    rows = [((0, 20),), ((20, 50), (70, 80)), ((50, 70), (80, N))]
    blocks = ((0, 2), (2, 5), (5, 8))   # cuts both saved blocks
    for r in range(3):
        m = Model(rows[r], blocks[r], blocks)
        Saver(m, output_dir=out).load(ckpt_id="inc", shard_id=r, shard_num=3)
        _check(m, "inc", blocks[r])


def test_model_free_readers_see_the_rows(out):
    for ck in ("base", "inc"):
        assert verify(os.path.join(out, ck)).ok
    R.check_digests(os.path.join(out, "base"))
    got = R.read_chain(out, "inc")["tables"]
    want = expected_rows("fixed", "inc")
    assert got["fixed"]["ids"].tolist() == list(range(N))
    for k, v in want.items():
        np.testing.assert_array_equal(got["fixed"]["slots"][k], v)
    view = recckpt.open(os.path.join(out, "inc"))
    seen = 0
    for ids, part in view.iter_rows("fixed", chunk_rows=40):
        np.testing.assert_array_equal(part["embedding"], want["embedding"][np.asarray(ids)])
        seen += len(ids)
    assert seen == N


OPTS5 = SaveOptions(num_buckets=16, segment_bytes=1024, fsync=False)


def _two_workers(out, ckpt: str, dst: str) -> list[tuple[Model, Saver]]:
    """Both workers of the fixture's plan (rows split in halves; column blocks as saved), loaded from
    `out`, with Savers writing to `dst`."""
    workers = []
    for w in range(2):
        m = Model(((w * N // 2, (w + 1) * N // 2),), SAVED_BLOCKS[w], SAVED_BLOCKS)
        s = Saver(m, output_dir=dst, options=OPTS5)
        s.load(ckpt_path=None if dst == out else out, ckpt_id=ckpt, shard_id=w, shard_num=2)
        workers.append((m, s))
    return workers


def test_saved_again_in_version_5_the_digests_are_equal(out, tmp_path):
    """Digests are over logical rows: the same state saved by version 4 and by version 5 (column groups,
    row runs: another layout) has equal digests. The fixture's record rowsum128 (the function of the
    recckpt that wrote it) and a save today mulsum128: the fixture's rows, recomputed under mulsum128 by
    the independent reader, give the digests of the new save."""
    dst = str(tmp_path / "v5")
    for w, (_, s) in enumerate(_two_workers(out, "base", dst)):
        s.save("again", shard_id=w, shard_num=2)
    old = json.load(open(os.path.join(out, "base", "manifest.json")))
    new = json.load(open(os.path.join(dst, "again", "manifest.json")))
    assert new["format_version"] == 5
    assert (old["digests"]["hash"], new["digests"]["hash"]) == ("rowsum128", "mulsum128")
    R.check_digests(os.path.join(out, "base"))   # the fixture's rowsum128 digests describe its rows
    recomputed = R.content_digests(R.read_checkpoint(os.path.join(out, "base"), bf16="bits"), "mulsum128")
    for t in ("fixed", "cw"):
        assert new["tables"][t]["column_groups"] == {"slots": ["embedding", "adagrad.acc"], "width": 4}
        assert new["digests"]["tables"][t] == recomputed["tables"][t]
    index = CheckpointReader(open_storage(dst), "again").index
    assert all(seg.is_run for seg in index.tables["fixed"][1])        # no ids stored
    assert all(len(seg.columns) == 1 + 2 + 2 + 1 for seg in index.tables["fixed"][1])   # 2 groups a slot
    assert verify(os.path.join(dst, "again")).ok
    R.check_digests(os.path.join(dst, "again"))


def test_diff_compares_digests_of_one_function_only(out, tmp_path):
    """`diff` of the fixture (rowsum128 digests) and the same rows saved today (mulsum128) cannot compare
    digests of two functions: it says so, and by value finds the rows equal. Two rowsum128 checkpoints
    still compare by digest: a slot digest changed in a copy of the fixture is reported as that slot."""
    dst = str(tmp_path / "v5")
    for w, (_, s) in enumerate(_two_workers(out, "base", dst)):
        s.save("again", shard_id=w, shard_num=2)
    base, again = os.path.join(out, "base"), os.path.join(dst, "again")
    r = recckpt.diff(base, again)
    assert set(r.not_compared) == {"fixed", "cw"} and not r.contents, r
    assert "rowsum128 vs mulsum128" in r.not_compared["fixed"]
    assert r.dense == {"added": [], "removed": [], "changed": []}   # the dense files, read and compared
    by_value = recckpt.diff(base, again, values=True)
    assert all(not (v.only_a or v.only_b or v.changed_rows) for v in by_value.values.values())
    assert not by_value.digests_disagree and not by_value.contents   # (the format version and step differ)
    copy = str(tmp_path / "copy" / "base")
    shutil.copytree(base, copy)
    path = os.path.join(copy, "manifest.json")
    manifest = json.load(open(path))
    manifest.pop("crc32c")
    slots = manifest["digests"]["tables"]["fixed"]["slots"]
    slots["embedding"] = slots["adagrad.acc"]
    manifest["crc32c"] = R.crc32c(R.canonical_json(manifest))
    with open(path, "w") as f:
        json.dump(manifest, f)
    assert recckpt.diff(base, copy).contents == {"fixed": ["embedding"]}


def test_a_version_5_increment_on_the_version_4_base(out):
    """An upgraded recckpt saves an increment (format version 5) on a version 4 parent: the chain of mixed
    versions loads exactly, on one process and resharded, and verifies."""
    workers = _two_workers(out, "inc", out)
    for _, s in workers:
        assert s.chain_parent() == "inc"   # a full load of every table: the parent of the next increment
    more = np.r_[0:3, 45:52]
    emb = expected_rows("fixed", "inc")["embedding"][more] - 7
    for m, _ in workers:
        m.fixed.write(more, emb)
    for w, (_, s) in enumerate(workers):
        s.save("inc2", shard_id=w, shard_num=2, incremental=True)
    man = json.load(open(os.path.join(out, "inc2", "manifest.json")))
    assert man["format_version"] == 5 and man["parent"]["ckpt_id"] == "inc"
    assert man["tables"]["fixed"]["changes"] and man["tables"]["fixed"]["rows"] == len(more)
    assert verify(os.path.join(out, "inc2")).ok
    want = expected_rows("fixed", "inc")
    want["embedding"][more] = emb
    for owned, world in ((((0, N),), 1), (((30, 47),), 3)):
        m = Model(owned)
        Saver(m, output_dir=out).load(ckpt_id="inc2", shard_id=world - 1, shard_num=world)
        rows = m.fixed.owned()
        assert (m.fixed.got[rows] == 1).all()
        for k, v in want.items():
            np.testing.assert_array_equal(m.fixed.data[k][rows], v[rows], err_msg=k)
    got = R.read_chain(out, "inc2")["tables"]["fixed"]
    np.testing.assert_array_equal(got["slots"]["embedding"], want["embedding"])
