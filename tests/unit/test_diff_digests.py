"""`recckpt diff` without --values compares the content digests the manifests record (issue 29 item 1):
it names the table, slot and dense key that differ without reading a row, whatever the world sizes;
it never calls checkpoints the same when it could not compare their rows (an increment's changes, a
checkpoint without digests), and says why."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import recckpt
from helpers.checkpoints import FAST, SPEC, Model, table_rows
from helpers.hostile import read_json, write_json
from helpers.tables import DictTable
from recckpt import Saver
from recckpt.cli import main as cli_main


def _save(out, ckpt_id, rows, workers=1, weight=None, options=FAST):
    """Save `rows` (helpers.checkpoints layout) over `workers` shards; `weight` sets lin.weight."""
    for w in range(workers):
        sel = np.arange(len(rows["ids"]))[w::workers]
        t = DictTable("user", SPEC)
        t.set_rows(torch.from_numpy(rows["ids"][sel]), {k: torch.from_numpy(rows[k][sel]) for k in SPEC})
        m = Model(t)
        with torch.no_grad():
            m.lin.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) if weight is None else weight)
            m.lin.bias.fill_(0.5)
        s = Saver(m, output_dir=str(out), options=options, max_keep=None)
        if workers == 1:
            s.save(ckpt_id)
        else:
            s.save(ckpt_id, shard_id=w, shard_num=workers)


def _cli(capsys, *argv):
    code = cli_main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture()
def pair(tmp_path):
    """a: 1 worker; b: 3 workers and 64 buckets, one element of one row of adagrad.acc changed and one
    element of lin.weight changed."""
    rows = table_rows(800)
    _save(tmp_path, "a", rows)
    rows_b = {k: v.copy() for k, v in rows.items()}
    rows_b["adagrad.acc"][321, 5] += np.float32(0.25)
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weight[2, 1] = -1.0
    _save(tmp_path, "b", rows_b, workers=3, weight=weight,
          options=recckpt.SaveOptions(num_buckets=64, segment_bytes=8192, fsync=False))
    return tmp_path


def _no_row_reads(monkeypatch):
    """Make any read of shard rows fail: a digest diff must not need one."""
    from recckpt.format.sparse_io import SegmentReader

    def refuse(*a, **k):
        raise AssertionError("diff read rows")
    monkeypatch.setattr(SegmentReader, "read", refuse)


def test_one_row_and_one_dense_element_named_by_text_and_json(pair, capsys, monkeypatch):
    _no_row_reads(monkeypatch)
    code, out = _cli(capsys, "diff", str(pair / "a"), str(pair / "b"))
    assert code == 1
    lines = out.splitlines()
    assert "~ slot user.adagrad.acc: rows differ" in lines
    assert "~ dense key lin.weight" in lines
    assert not any(x.startswith("~ slot user.") and "adagrad.acc" not in x for x in lines)   # only that slot
    assert not any("rows of user" in x for x in lines)    # same ids
    assert "lin.bias" not in out
    assert "layout (not a difference of contents): workers 1 -> 3, num_buckets 4096 -> 64" in out
    assert lines[-1] == "checkpoints differ"
    code, out = _cli(capsys, "diff", "--json", str(pair / "a"), str(pair / "b"))
    doc = json.loads(out)
    assert code == 1 and doc["same"] is False and doc["differs"] is True
    assert doc["contents"] == {"user": ["adagrad.acc"]}
    assert doc["dense"] == {"added": [], "removed": [], "changed": ["lin.weight"]}
    assert doc["not_compared"] == {} and doc["values"] is None
    assert doc["rows"]["user"] == [len(np.unique(table_rows(800)["ids"]))] * 2


def test_values_confirm_what_the_digests_found(pair, capsys):
    code, out = _cli(capsys, "diff", "--json", "--values", str(pair / "a"), str(pair / "b"))
    doc = json.loads(out)
    assert code == 1
    v = doc["values"]["user"]
    assert v["changed_rows"] == 1 and v["slots"]["adagrad.acc"]["changed_rows"] == 1
    assert [s for s, x in v["slots"].items() if x["changed_rows"]] == ["adagrad.acc"]


def test_same_rows_on_other_layouts_are_the_same(tmp_path, capsys, monkeypatch):
    rows = table_rows(500)
    _save(tmp_path, "a", rows)
    _save(tmp_path, "b", rows, workers=2, options=recckpt.SaveOptions(num_buckets=7, fsync=False))
    _no_row_reads(monkeypatch)
    code, out = _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0, out
    assert out.splitlines()[-1] == "no differences" and "workers 1 -> 2" in out
    first = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert first.same, (first.metadata, first.contents, first.not_compared, first.dense, first.objects)


def _strip_digests(ckpt):
    m = read_json(str(ckpt), "manifest.json")
    del m["digests"]
    write_json(str(ckpt), "manifest.json", m)


def test_checkpoints_without_digests_are_not_called_the_same(tmp_path, capsys):
    rows = table_rows(300)
    _save(tmp_path, "a", rows)
    _save(tmp_path, "b", rows)
    _strip_digests(tmp_path / "b")          # as a checkpoint written before digests
    code, out = _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1
    assert "? rows of user: not comparable without --values (b records no content digests" in out
    assert out.splitlines()[-1].startswith("no differences found, but the rows marked ? could not be compared")
    doc = json.loads(_cli(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))[1])
    assert doc["same"] is False and doc["differs"] is False and "user" in doc["not_compared"]
    # dense state is compared by value when a side has no digests of it
    assert doc["dense"]["changed"] == []
    # known equal: the same checkpoint, or the rows compared by value
    assert _cli(capsys, "diff", str(tmp_path / "b"), str(tmp_path / "b"))[0] == 0
    code, out = _cli(capsys, "diff", "--values", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and "compared by value below" in out and out.splitlines()[-1] == "no differences"


def test_an_increment_against_a_full_checkpoint(tmp_path, capsys):
    from unit.test_incremental import run_chain
    out = tmp_path / "run"
    _, saver, _ = run_chain(out, n_incr=2)
    saver.save("again")                  # a full save of the same state
    recckpt.compact(str(out / "c2"), str(out / "full2"))
    code, text = _cli(capsys, "diff", str(out / "c2"), str(out / "full2"))
    assert code == 1 and "? rows of emb: not comparable without --values (c2 holds only the changes of table 'emb'" in text
    assert "~ slot" not in text
    code, text = _cli(capsys, "diff", "--values", str(out / "c2"), str(out / "full2"))
    assert code == 0 and text.splitlines()[-1] == "no differences"
    # the compacted checkpoint and a full save of the same state have digests: compared without values
    code, text = _cli(capsys, "diff", str(out / "full2"), str(out / "again"))
    assert code == 0 and text.splitlines()[-1] == "no differences"
    code, text = _cli(capsys, "diff", str(out / "c1"), str(out / "again"))
    assert code == 1 and "? rows of emb" in text


@pytest.mark.parametrize("case", ["empty", "disjoint"])
def test_values_of_a_table_with_no_id_in_both(tmp_path, case):
    """--values on a table that is empty in both checkpoints, or whose ids differ entirely: counted, not a
    crash (numpy cannot infer the row shape of no rows)."""
    paths = []
    for k in range(2):
        m = torch.nn.Module()
        m.add_module("a", recckpt.HashTable("a", dim=4))
        m.add_module("e", recckpt.HashTable("e", dim=4))
        with torch.no_grad():
            m.a(torch.arange(10))
            if case == "disjoint":
                m.e(torch.arange(5) + 100 * k)
        Saver(m, output_dir=str(tmp_path / f"{case}{k}"), options=FAST).save("c")
        paths.append(str(tmp_path / f"{case}{k}" / "c"))
    e = recckpt.diff(*paths, values=True).values["e"]
    assert (e.common, e.changed_rows) == (0, 0)
    assert (e.only_a, e.only_b) == ((5, 5) if case == "disjoint" else (0, 0))


def test_io_state_and_the_sparse_optimizers_state_are_compared(tmp_path, capsys):
    """Checkpoints that differ only in a worker's IO state (a reader's position), or only in the sparse
    optimizer's own state (its learning rate), differ: diff once called both identical."""
    from helpers.checkpoints import Pos

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = recckpt.HashTable("t", dim=4)

    m = M()
    opt = recckpt.SparseAdam(m, lr=0.01)
    with torch.no_grad():
        m.t(torch.arange(6))
    pos = Pos(10)
    s = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), options=FAST, max_keep=None)
    s.register_io_state("reader", pos)
    s.save("base")
    s.save("again")
    pos.pos = 11
    s.save("io")
    pos.pos, opt.lr = 10, 0.5
    s.save("lr")
    same = recckpt.diff(str(tmp_path / "base"), str(tmp_path / "again"))
    assert same.same and not same.differs, same
    io = recckpt.diff(str(tmp_path / "base"), str(tmp_path / "io"))
    assert io.differs and not io.same and io.io_state["changed"] == ["worker 0"], io
    assert io.sparse_optimizer is None and not any(io.objects.values()), io
    lr = recckpt.diff(str(tmp_path / "base"), str(tmp_path / "lr"))
    assert lr.differs and lr.sparse_optimizer == "changed" and not any(lr.io_state.values()), lr
    code, out = _cli(capsys, "diff", str(tmp_path / "base"), str(tmp_path / "io"))
    assert code == 1 and "~ IO state of worker 0" in out, out
    code, out = _cli(capsys, "diff", "--values", str(tmp_path / "base"), str(tmp_path / "lr"))
    assert code == 1 and "~ sparse optimizer state" in out, out
    code, out = _cli(capsys, "diff", str(tmp_path / "base"), str(tmp_path / "again"))
    assert code == 0 and "no differences" in out, out


@pytest.mark.parametrize("before,after,differ", [(0.0, -0.0, True), (float("nan"), float("nan"), False),
                                                (1.5, 1.5, False), (1, 1.0, True),
                                                (np.float32(0.0), np.float32(-0.0), True),
                                                (np.float32("nan"), np.float32("nan"), False)])
def test_plain_numbers_in_a_registered_object_are_compared_bit_for_bit(tmp_path, before, after, differ):
    """As arrays are: 0.0 -> -0.0 is a change, a NaN (a best loss not yet set) equals itself."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = recckpt.HashTable("t", dim=4)

    m, state = M(), {"x": before}
    with torch.no_grad():
        m.t(torch.arange(6))
    s = Saver(m, output_dir=str(tmp_path), options=FAST, max_keep=None)
    s.register_for_checkpointing("obj", state)
    s.save("a")
    state["x"] = after
    s.save("b")
    r = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.differs == differ and r.same == (not differ) and r.objects["changed"] == (["obj"] if differ else []), r


@pytest.mark.parametrize("damage", ["shard missing", "shard truncated", "dense missing", "dense resized",
                                    "extras resized", "dense flipped"])
def test_a_damaged_checkpoint_is_never_called_the_same(tmp_path, capsys, damage):
    """Both manifests record the same content, but one checkpoint's files are gone or cut: it cannot be
    loaded, so diff must not answer "no differences" (it said so before: the digests alone agreed)."""
    rows = table_rows(300)
    _save(tmp_path, "a", rows)
    _save(tmp_path, "b", rows)
    assert _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))[0] == 0   # the same, undamaged
    sparse = tmp_path / "b" / "sparse"
    shard = sorted(p for p in sparse.iterdir() if p.suffix == ".bin")[0]
    victim = {"shard": shard, "dense": tmp_path / "b" / "dense.safetensors",
              "extras": tmp_path / "b" / "extras.safetensors"}[damage.split()[0]]
    if damage.endswith("missing"):
        victim.unlink()
    elif damage.endswith("flipped"):   # the same size: its CRC tells
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10
        victim.write_bytes(bytes(data))
    else:
        data = victim.read_bytes()
        victim.write_bytes(data[:-8] if damage == "shard truncated" else data + b"\0" * 8)
    r = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not r.same and list(r.damaged) == ["b"] and victim.name in r.damaged["b"][0], r.damaged
    code, out = _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and "no differences\n" not in out
    assert "! B is damaged" in out and victim.name in out and "recckpt verify" in out, out
    code, out = _cli(capsys, "diff", "--json", str(tmp_path / "b"), str(tmp_path / "b"))   # even against itself
    doc = json.loads(out)
    assert code == 1 and doc["same"] is False and set(doc["damaged"]) == {"a", "b"}


def test_what_a_damaged_side_cannot_give_is_not_reported_added_or_removed(tmp_path, capsys):
    """Two workers' IO states and the registered objects, equal on both sides; one side loses worker 1's
    IO-state file and its extras: diff says it is damaged, and reports no IO state or object as added
    (it listed worker 0's, which both hold equal, and every object, as added in B)."""
    from helpers.checkpoints import Pos
    for ckpt_id in ("a", "b"):
        for w in range(2):
            torch.manual_seed(w)   # the same rows in both checkpoints
            m = torch.nn.Module()
            m.t = recckpt.HashTable("t", dim=4)
            with torch.no_grad():
                m.t(torch.arange(w, 12, 2))
            s = Saver(m, output_dir=str(tmp_path), options=FAST, max_keep=None)
            s.register_io_state("reader", Pos(10 + w))
            s.register_for_checkpointing("lr", {"value": 0.5})
            s.save(ckpt_id, shard_id=w, shard_num=2)
    first = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert first.same, (first.metadata, first.contents, first.not_compared, first.dense, first.objects)
    io_files = sorted((tmp_path / "a" / "io_state").iterdir())
    assert len(io_files) == 2, io_files
    io_files[1].unlink()
    (tmp_path / "a" / "extras.safetensors").unlink()
    r = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not r.same and list(r.damaged) == ["a"], r
    assert not any(r.io_state.values()) and not any(r.objects.values()) and r.sparse_optimizer is None, r
    code, out = _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and "! A is damaged" in out, out
    assert not [line for line in out.splitlines() if line[:2] in ("+ ", "- ", "~ ")], out
    assert out.count("worker-00001") == 1 and out.count("extras.safetensors") == 1, out   # each named once


def test_inspect_says_a_checkpoint_is_damaged(tmp_path, capsys):
    """inspect read manifests only and showed a checkpoint with a shard file gone as a normal one (exit 0)."""
    _save(tmp_path, "a", table_rows(200))
    next(p for p in (tmp_path / "a" / "sparse").iterdir() if p.suffix == ".bin").unlink()
    code, out = _cli(capsys, "inspect", str(tmp_path / "a"))
    assert code == 1 and "! damaged:" in out and ".bin" in out and "recckpt verify" in out, out
    code, out = _cli(capsys, "inspect", "--json", str(tmp_path / "a"))
    assert code == 1 and ".bin" in json.loads(out)["damaged"][0]
    _save(tmp_path, "b", table_rows(200))
    code, out = _cli(capsys, "inspect", "--json", str(tmp_path / "b"))
    assert code == 0 and json.loads(out)["damaged"] == []


def test_inspect_names_a_file_replaced_by_a_directory_and_reads_only_what_a_load_reads(tmp_path, capsys):
    """A dense file replaced by a directory gave a bare error line, not the damage report; and inspect of an
    increment CRC-checked every older link's dense and object files too (a load of it reads only its own)."""
    import shutil
    _save(tmp_path, "a", table_rows(200))
    dense = tmp_path / "a" / "dense.safetensors"
    dense.unlink()
    dense.mkdir()
    code, out = _cli(capsys, "inspect", str(tmp_path / "a"))
    assert code == 1 and "! damaged:" in out and "dense.safetensors" in out, out
    shutil.rmtree(tmp_path / "a")
    m = torch.nn.Module()
    m.user = recckpt.HashTable("user", 4, track_changes=True)
    m.lin = torch.nn.Linear(4, 3)
    m.user(torch.arange(50))
    s = Saver(m, output_dir=str(tmp_path / "run"), options=FAST, max_keep=None)
    s.save("c0")
    m.user(torch.arange(50, 60))
    s.save("c1", incremental=True)
    assert recckpt.open(str(tmp_path / "run" / "c1")).links == ["c0", "c1"]
    old_dense = tmp_path / "run" / "c0" / "dense.safetensors"
    data = bytearray(old_dense.read_bytes())
    data[-2] ^= 0x01   # same size: only a read of c0's dense would see it
    old_dense.write_bytes(bytes(data))
    code, out = _cli(capsys, "inspect", "--no-objects", str(tmp_path / "run" / "c1"))
    assert code == 0 and "damaged" not in out, out
    code, out = _cli(capsys, "inspect", "--no-objects", str(tmp_path / "run" / "c0"))
    assert code == 1 and "! damaged:" in out and "dense.safetensors" in out, out


def test_inspect_and_diff_of_an_increment_report_its_damaged_link(tmp_path, capsys):
    """An increment whose base lost part of a shard file: inspect and diff failed whole with a bare error
    (`recckpt.open` checked every link's shard sizes), where a damaged full checkpoint gets the `!` report.
    Now the link's damage is reported as a full checkpoint's is, and the undamaged parts are shown."""
    m = torch.nn.Module()
    m.user = recckpt.HashTable("user", 4, track_changes=True)
    m.user(torch.arange(100))
    s = Saver(m, output_dir=str(tmp_path / "run"), options=FAST, max_keep=None)
    s.save("c0")
    m.user.write_rows("embedding", m.user.lookup(torch.arange(5)), torch.ones(5, 4))
    s.save("c1", incremental=True)
    s.save("full")
    shard = next(p for p in (tmp_path / "run" / "c0" / "sparse").iterdir() if p.suffix == ".bin")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    c1 = str(tmp_path / "run" / "c1")
    code, out = _cli(capsys, "inspect", c1)
    assert code == 1 and f"! damaged: {shard}" in out, out
    assert "id c1," in out and "parent c0" in out and "tables not shown" in out and "c0 <- c1" in out, out
    code, out = _cli(capsys, "inspect", "--json", c1)
    assert code == 1 and str(shard) in json.loads(out)["damaged"][0], out
    code, out = _cli(capsys, "diff", c1, str(tmp_path / "run" / "full"))
    assert code == 1 and "! A is damaged" in out and str(shard) in out, out
    with pytest.raises(recckpt.errors.CorruptCheckpointError, match="truncated"):
        recckpt.open(c1).lookup("user", [1, 2])
    code, out = _cli(capsys, "verify", c1)
    assert code == 1 and str(shard) in out, out


def test_a_missing_file_no_load_reads_in_an_older_link_does_not_make_an_increment_damaged(tmp_path, capsys):
    """An older link's dense file is not read by a load of a later link (its dense state is whole there):
    with it gone, the load works, but inspect and diff called the increment damaged and unloadable and
    left its objects out. The older link itself is still reported damaged."""
    m = torch.nn.Module()
    m.user = recckpt.HashTable("user", 4, track_changes=True)
    m.lin = torch.nn.Linear(2, 1)
    m.user(torch.arange(20))
    s = Saver(m, output_dir=str(tmp_path / "run"), options=FAST, max_keep=None)
    s.register_for_checkpointing("note", {"epoch": 3})
    s.save("b")
    m.user.write_rows("embedding", m.user.lookup(torch.tensor([3])), torch.ones(1, 4))
    s.save("i1", incremental=True)
    m.user.write_rows("embedding", m.user.lookup(torch.tensor([4])), torch.ones(1, 4))
    s.save("i2", incremental=True)
    (tmp_path / "run" / "i1" / "dense.safetensors").unlink()
    i2 = str(tmp_path / "run" / "i2")
    m2 = torch.nn.Module()
    m2.user = recckpt.HashTable("user", 4)
    m2.lin = torch.nn.Linear(2, 1)
    s2 = Saver(m2, output_dir=str(tmp_path / "run"))
    s2.register_for_checkpointing("note", {"epoch": 0})
    s2.load(ckpt_id="i2")   # the load is fine
    code, out = _cli(capsys, "inspect", i2)
    assert code == 0 and "damaged" not in out and "note" in out, out
    code, out = _cli(capsys, "diff", i2, i2)
    assert code == 0 and "damaged" not in out, out
    code, out = _cli(capsys, "inspect", str(tmp_path / "run" / "i1"))
    assert code == 1 and "! damaged:" in out and "dense.safetensors" in out, out


def test_diff_values_overrules_a_wrong_recorded_digest(tmp_path, capsys):
    """A manifest whose recorded digest of a slot is wrong (edited, re-signed): `diff --values` printed both
    "rows differ" (the digests) and "0 changed" (the values). The rows decide: the table is reported as
    equal by value with digests that disagree, and the two are not called the same."""
    from helpers.hostile import read_json, write_json
    rows = table_rows(300)
    _save(tmp_path, "a", rows)
    _save(tmp_path, "b", rows)
    m = read_json(str(tmp_path / "b"), "manifest.json")
    d = m["digests"]["tables"]["user"]["slots"]["embedding"]
    m["digests"]["tables"]["user"]["slots"]["embedding"] = ("0" if d[0] != "0" else "1") + d[1:]
    write_json(str(tmp_path / "b"), "manifest.json", m)
    code, out = _cli(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and "~ slot user.embedding: rows differ" in out, out
    code, out = _cli(capsys, "diff", "--values", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and ": rows differ" not in out and "equal by value" in out and "0 changed" in out, out
    assert "checkpoints differ" not in out and "recorded digests disagree" in out, out
    r = recckpt.diff(str(tmp_path / "a"), str(tmp_path / "b"), values=True)
    assert not r.same and not r.differs and list(r.digests_disagree) == ["user"], r


def test_workers_that_saved_at_one_step_are_layout_not_content(tmp_path, capsys):
    """The step each worker saved at is compared only where it can pick a copy (steps differ): the same
    rows saved at step 100 by 2 and by 4 workers are the same (a review of the worker_steps comparison)."""
    rows = table_rows(60)
    for name, workers in (("two", 2), ("four", 4)):
        for w in range(workers):
            sel = np.arange(len(rows["ids"]))[w::workers]
            t = DictTable("user", SPEC)
            t.set_rows(torch.from_numpy(rows["ids"][sel]), {k: torch.from_numpy(rows[k][sel]) for k in SPEC})
            torch.manual_seed(0)   # one dense state
            Saver(Model(t), output_dir=str(tmp_path), options=FAST, max_keep=None).save(
                name, shard_id=w, shard_num=workers, step=100)
    r = recckpt.diff(str(tmp_path / "two"), str(tmp_path / "four"))
    assert r.same and r.layout["workers"] == (2, 4) and not r.metadata, r


def _save_repeated_id(out, ckpt_id, values, steps):
    """Two workers that both stored id 5 (ids routed inconsistently), worker w holding `values[w]`."""
    spec = {"embedding": SPEC["embedding"]}
    for w in (0, 1):
        t = DictTable("user", spec)
        t.set_rows(torch.tensor([5]), {"embedding": torch.full((1, *spec["embedding"].shape), values[w])})
        Saver(Model(t), output_dir=str(out), options=FAST, max_keep=None).save(
            ckpt_id, shard_id=w, shard_num=2, step=steps[w])
    return str(out / ckpt_id)


def test_an_id_stored_twice_is_not_compared_as_if_it_were_one_row(tmp_path, capsys):
    """The digests sum the stored copies of a repeated id, so they cannot show which worker holds which;
    the step each worker saved at (which decides the copy a load keeps) is compared, and --values refuses
    a table with no one value an id, naming it, instead of a raw IndexError (a helper's attack)."""
    a = _save_repeated_id(tmp_path, "a", (1.0, 2.0), (10, 11))
    c = _save_repeated_id(tmp_path, "c", (1.0, 2.0), (11, 10))
    r = recckpt.diff(a, c)
    assert r.differs and r.metadata == {"worker_steps": ({0: 10, 1: 11}, {0: 11, 1: 10})}, r
    code, out = _cli(capsys, "diff", a, c)
    assert code == 1 and "~ worker_steps: {0: 10, 1: 11} -> {0: 11, 1: 10}" in out, out
    with pytest.raises(recckpt.errors.DuplicateIdsError, match="table 'user' stores id 5 more than once") as e:
        recckpt.diff(a, c, values=True)
    assert e.value.table == "user" and "duplicates" in str(e.value)
    assert cli_main(["diff", a, c, "--values"]) == 1
    err = capsys.readouterr().err
    assert "stores id 5 more than once" in err and "IndexError" not in err, err
