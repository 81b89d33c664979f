"""recckpt.open, export, diff, inspect and verify on incremental checkpoints: a link of a chain is shown
as the state it stands for (base + every increment up to it: newest row wins, removed ids absent), the
same state a load or `recckpt compact` gives, and every link is checked."""
from __future__ import annotations

import json
import shutil
import uuid

import numpy as np
import pytest

import recckpt
from recckpt.cli import main as cli_main
from recckpt.errors import CorruptCheckpointError
from recckpt.format.hashing import bucket_of
from unit.test_incremental import run_chain

SLOTS = ["embedding", "adam.m", "adam.v"]


@pytest.fixture(params=["local", "memory"])
def chain(request, tmp_path):
    out = str(tmp_path / "run") if request.param == "local" else f"memory://h17b-{uuid.uuid4().hex}"
    _, _, snaps = run_chain(out, n_incr=3)
    return out, snaps


def _rows(view, table="emb", slots=None, **kw) -> dict[str, dict[int, np.ndarray]]:
    got: dict[str, dict[int, np.ndarray]] = {}
    seen = 0
    for ids, cols in view.iter_rows(table, slots, **kw):
        seen += len(ids)
        for s, a in cols.items():
            got.setdefault(s, {}).update(zip(ids.tolist(), a))
    assert all(seen == len(v) for v in got.values()), "an id came twice"
    return got


def _equal(got: dict[str, dict[int, np.ndarray]], snap, slots) -> None:
    for s in slots:
        assert set(got[s]) == set(snap[s]), f"slot {s}: ids differ"
        for i, row in snap[s].items():
            assert np.array_equal(got[s][i], row.numpy()), (s, i)


def test_every_link_shows_its_folded_state(chain):
    out, snaps = chain
    for k, (ckpt, snap) in enumerate(snaps.items()):
        view = recckpt.open(f"{out}/{ckpt}")
        assert view.links == [f"c{j}" for j in range(k + 1)]
        assert view.parent == (f"c{k - 1}" if k else None)          # metadata still names the parent
        assert view.kind == ("incremental" if k else "full")
        assert view.tables["emb"].rows == len(snap["embedding"])    # the folded count, not the link's own
        assert list(view.tables["emb"].slots) == SLOTS
        _equal(_rows(view, chunk_rows=37), snap, SLOTS)
    rep = recckpt.verify(f"{out}/c3")                                 # local and memory:// alike
    assert rep.ok and rep.links == ["c0", "c1", "c2", "c3"], rep.problems


def test_chunks_shards_and_buckets_of_a_chain(chain):
    out, snaps = chain
    view = recckpt.open(f"{out}/c3")
    snap = snaps["c3"]
    chunks = list(view.iter_rows("emb", ["embedding"], chunk_rows=16))
    assert chunks and all(len(ids) <= 16 for ids, _ in chunks)
    union: dict[int, np.ndarray] = {}
    for rank in range(3):
        part = _rows(view, slots=["embedding"], shard=(rank, 3))["embedding"]
        assert not set(part) & set(union)
        union.update(part)
    _equal({"embedding": union}, snap, ["embedding"])
    nb = view.num_buckets
    lo, hi = nb // 4, nb // 2
    part = _rows(view, slots=["embedding"], buckets=(lo, hi))["embedding"]
    ids = np.array(sorted(snap["embedding"]), dtype=np.int64)
    b = bucket_of(ids, nb)
    assert set(part) == set(ids[(b >= lo) & (b < hi)].tolist())


def test_small_windows_fold_in_many_groups(chain, monkeypatch):
    from recckpt.tools import reader
    monkeypatch.setattr(reader, "WINDOW_BYTES", 512)   # many bucket groups, each planned on its own
    out, snaps = chain
    view = recckpt.open(f"{out}/c2")
    assert view.tables["emb"].rows == len(snaps["c2"]["embedding"])
    _equal(_rows(view, chunk_rows=5), snaps["c2"], SLOTS)


def _parquet_rows(folder) -> dict[int, list]:
    import pyarrow.parquet as pq
    t = pq.read_table(str(folder))
    return dict(zip(t.column("id").to_pylist(), t.column("embedding").to_pylist()))


def test_export_diff_and_inspect_see_the_folded_state(tmp_path):
    out = tmp_path / "run"
    model, _, snaps = run_chain(out, n_incr=3)
    recckpt.compact(str(out / "c3"), str(out / "full3"))
    recckpt.export(str(out / "c3"), tmp_path / "inc")
    recckpt.export(str(out / "full3"), tmp_path / "full")
    inc, full = _parquet_rows(tmp_path / "inc" / "emb"), _parquet_rows(tmp_path / "full" / "emb")
    assert inc == full
    live = {int(i): r.tolist() for i, r in snaps["c3"]["embedding"].items()}
    assert inc == live
    assert len(model.emb) == len(live)
    d = recckpt.diff(str(out / "c3"), str(out / "full3"), values=True)
    v = d.values["emb"]
    assert (v.only_a, v.only_b, v.changed_rows, v.common) == (0, 0, 0, len(live))
    assert not any(d.tables.values()) and not any(any(v.values()) for v in d.slots.values())
    d1 = recckpt.diff(str(out / "c1"), str(out / "c3"), values=True).values["emb"]
    assert d1.only_a + d1.only_b + d1.changed_rows > 0          # and a real change is seen
    assert d1.common + d1.only_b == len(live)


def test_inspect_cli_shows_folded_rows_and_parent(tmp_path, capsys):
    out = tmp_path / "run"
    _, _, snaps = run_chain(out, n_incr=2)
    assert cli_main(["inspect", "--json", str(out / "c2")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["parent"] == "c1" and doc["kind"] == "incremental" and doc["links"] == ["c0", "c1", "c2"]
    assert doc["tables"]["emb"]["rows"] == len(snaps["c2"]["embedding"])
    assert cli_main(["inspect", str(out / "c2")]) == 0
    text = capsys.readouterr().out
    assert "parent c1" in text and "chain of 3 links: c0 <- c1 <- c2" in text
    assert f"emb    {len(snaps['c2']['embedding'])} " in text


def test_verify_checks_every_link(tmp_path, capsys):
    out = tmp_path / "run"
    run_chain(out, n_incr=3)
    rep = recckpt.verify(str(out / "c3"))
    assert rep.ok, rep.problems
    assert rep.links == ["c0", "c1", "c2", "c3"]
    assert cli_main(["verify", str(out / "c3")]) == 0
    assert "chain of 4 links" in capsys.readouterr().out
    (out / "c1" / "stray.txt").write_text("not part of the checkpoint")
    rep = recckpt.verify(str(out / "c3"))
    assert rep.ok and rep.unlisted == ["c1/stray.txt"]       # a link's stray file, named from the output dir

    # a flipped byte in the base's shard file: found by verify of the newest link, naming the base's file
    shard = sorted((out / "c0" / "sparse").glob("shard-*.bin"))
    data = bytearray(shard[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard[0].write_bytes(bytes(data))
    rep = recckpt.verify(str(out / "c3"))
    assert not rep.ok and any("c0" in p for p in rep.problems), rep.problems
    assert cli_main(["verify", str(out / "c3")]) == 1
    assert "c0" in capsys.readouterr().out


def test_missing_or_altered_link_is_named(tmp_path, capsys):
    out = tmp_path / "run"
    run_chain(out, n_incr=3)
    # replaced: a valid checkpoint c1 of another run, not the one c2 recorded the hash of
    run_chain(tmp_path / "other", n_incr=1, seed=1)
    shutil.move(str(out / "c1"), str(tmp_path / "c1.saved"))
    shutil.copytree(tmp_path / "other" / "c1", out / "c1")
    with pytest.raises(CorruptCheckpointError, match=r"c1.*altered or replaced"):
        recckpt.open(str(out / "c3"))
    assert cli_main(["verify", str(out / "c3")]) == 1
    text = capsys.readouterr().out
    assert "c1" in text and "altered or replaced" in text
    shutil.rmtree(out / "c1")
    shutil.move(str(tmp_path / "c1.saved"), str(out / "c1"))
    assert recckpt.verify(str(out / "c3")).ok
    # missing: a link's directory is gone
    shutil.rmtree(out / "c1")
    with pytest.raises(CorruptCheckpointError, match=r"c1.*missing"):
        recckpt.open(str(out / "c3"))
    assert cli_main(["verify", "--json", str(out / "c3")]) == 1
    (rep,) = json.loads(capsys.readouterr().out)
    assert any("c1" in p and "missing" in p for p in rep["problems"])
    assert recckpt.open(str(out / "c0")).tables["emb"].rows > 0    # the base alone still opens
