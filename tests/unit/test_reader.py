"""recckpt.open: the model-free reader on real checkpoints (one and several workers, local and memory://)."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

import recckpt
from helpers.checkpoints import DIM, by_id, make_checkpoint, table_rows
from recckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from recckpt.format import names
from recckpt.format.hashing import bucket_of, bucket_range


@pytest.fixture(params=["local", "memory"])
def out(request, tmp_path):
    return str(tmp_path) if request.param == "local" else f"memory://h17-{uuid.uuid4().hex}"


def _all(view, table="user", **kw):
    chunks = list(view.iter_rows(table, **kw))
    ids = np.concatenate([c[0] for c in chunks])
    cols = {k: np.concatenate([c[1][k] for c in chunks]) for k in chunks[0][1]}
    return chunks, by_id(ids, cols)


@pytest.mark.parametrize("workers", [1, 3])
def test_metadata_and_all_rows(out, workers):
    rows = table_rows(1500)
    make_checkpoint(out, "ckpt_7", rows, workers=workers, extras={"note": "hi", "step": 7})
    v = recckpt.open(f"{out}/ckpt_7")
    assert (v.ckpt_id, v.workers, v.num_buckets, v.format_version, v.kind) == ("ckpt_7", workers, 4096, names.FORMAT_VERSION, "full")
    assert v.parent is None and v.created.year >= 2024
    t = v.tables["user"]
    assert t.rows == len(rows["ids"])
    assert [(s.name, s.dtype, s.shape) for s in t.slots.values()] == [
        ("embedding", "F32", (DIM,)), ("adagrad.acc", "F32", (DIM,)), ("freq", "I64", ()), ("last_step", "I64", ())]
    assert {k: (d.dtype, d.shape) for k, d in v.dense.items()} == {"lin.weight": ("F32", (3, 4)),
                                                                  "lin.bias": ("F32", (3,))}
    assert torch.equal(v.dense_tensors(["lin.bias"])["lin.bias"], torch.full((3,), 0.5))
    objs = v.objects()["objects"]
    assert objs["note"] == {"kind": "value", "state": "hi"} and objs["step"]["state"] == 7
    assert v.io_state_workers == list(range(workers))
    assert [v.io_state(w)["reader"]["pos"] for w in range(workers)] == [100 + w for w in range(workers)]
    chunks, got = _all(v, chunk_rows=256)
    assert all(len(c[0]) <= 256 for c in chunks) and sum(len(c[0]) == 256 for c in chunks) >= len(chunks) - workers * 2
    for k in ("ids", "embedding", "adagrad.acc", "freq", "last_step"):
        assert np.array_equal(got[k], rows[k]), k
    assert got["embedding"].dtype == np.float32 and got["freq"].dtype == np.int64


def test_slots_shard_buckets_and_torch(out):
    rows = table_rows(2000, seed=3)
    make_checkpoint(out, "c", rows, workers=2)
    v = recckpt.open(f"{out}/c")
    seen = []
    for r in range(3):
        lo, hi = bucket_range(r, 3, v.num_buckets)
        _, got = _all(v, slots=["freq"], shard=(r, 3))
        assert list(got) == ["ids", "freq"]
        b = bucket_of(got["ids"], v.num_buckets)
        assert ((b >= lo) & (b < hi)).all()
        seen.append(got["ids"])
    assert np.array_equal(np.sort(np.concatenate(seen)), rows["ids"])
    _, got = _all(v, slots=["embedding"], buckets=(10, 2000))
    b = bucket_of(rows["ids"], v.num_buckets)
    assert np.array_equal(got["ids"], rows["ids"][(b >= 10) & (b < 2000)])
    assert list(v.iter_rows("user", buckets=(5, 5))) == []
    ids, cols = next(v.iter_rows("user", slots=["embedding"], as_torch=True, chunk_rows=10**9))
    assert ids.dtype == torch.int64 and cols["embedding"].dtype == torch.float32 and len(ids) == len(rows["ids"])


def test_bf16_slot_is_exact_as_float32_and_native_in_torch(tmp_path):
    from helpers.tables import DictTable
    from recckpt import SaveOptions, Saver
    from recckpt.state.protocol import SlotSpec
    t = DictTable("w", {"embedding": SlotSpec(torch.bfloat16, (2, 3), "sparse")})
    vals = torch.randn(50, 2, 3).bfloat16()
    t.set_rows(torch.arange(50), {"embedding": vals})
    Saver(torch.nn.ModuleDict({"w": t}), output_dir=tmp_path, options=SaveOptions(fsync=False)).save("c")
    v = recckpt.open(tmp_path / "c")
    _, got = _all(v, table="w")
    assert got["embedding"].dtype == np.float32 and got["embedding"].shape == (50, 2, 3)
    assert np.array_equal(got["embedding"], vals.float().numpy())
    ids, cols = next(v.iter_rows("w", as_torch=True))
    assert torch.equal(cols["embedding"][ids.argsort()], vals)


def test_bad_arguments_name_what_to_do(tmp_path):
    make_checkpoint(str(tmp_path), "c", table_rows(50))
    v = recckpt.open(tmp_path / "c")
    with pytest.raises(InvalidArgumentError, match="no table 'nope'; it has \\['user'\\]"):
        list(v.iter_rows("nope"))
    with pytest.raises(InvalidArgumentError, match="slots"):
        list(v.iter_rows("user", slots=["embedding", "x"]))
    with pytest.raises(InvalidArgumentError, match="chunk_rows"):
        list(v.iter_rows("user", chunk_rows=0))
    with pytest.raises(InvalidArgumentError, match="shard"):
        list(v.iter_rows("user", shard=(3, 3)))
    with pytest.raises(InvalidArgumentError, match="buckets"):
        list(v.iter_rows("user", buckets=(0, 5000)))
    with pytest.raises(InvalidArgumentError, match="not both"):
        list(v.iter_rows("user", shard=(0, 1), buckets=(0, 1)))
    with pytest.raises(InvalidArgumentError, match="worker must be an integer in .*got 4"):
        v.io_state(4)
    with pytest.raises(InvalidArgumentError, match="dense keys"):
        v.dense_tensors(["x"])


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="missing does not exist"):
        recckpt.open(tmp_path / "missing")
    make_checkpoint(str(tmp_path), "c1", table_rows(20))
    with pytest.raises(CheckpointNotFoundError, match=r"output directory.*c1"):
        recckpt.open(tmp_path)


def test_corrupt_shard_is_refused_naming_the_file(tmp_path):
    make_checkpoint(str(tmp_path), "c", table_rows(500))
    shard = tmp_path / "c" / "sparse" / "shard-00000-000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    v = recckpt.open(tmp_path / "c")
    with pytest.raises(CorruptCheckpointError, match="shard-00000-000.bin"):
        list(v.iter_rows("user"))


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_rows_are_not_read_from_a_checkpoint_whose_worker_index_a_load_refuses(tmp_path, damage):
    """A load checks every worker's index (the merged index.json is what it reads); export and lookup read
    rows through this view and used to succeed, exit 0, on a checkpoint verify and load call damaged."""
    import subprocess
    import sys
    make_checkpoint(str(tmp_path), "c", table_rows(300), workers=2)
    index = tmp_path / "c" / "sparse" / "worker-00001.index.json"
    if damage == "missing":
        index.unlink()
    else:
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0x01
        index.write_bytes(bytes(data))
    report = recckpt.verify(tmp_path / "c")   # one problem, naming the file (not also "do not cover workers")
    assert len(report.problems) == 1 and "worker-00001.index.json" in report.problems[0], report.problems
    v = recckpt.open(tmp_path / "c")
    with pytest.raises(CorruptCheckpointError, match="worker-00001.index.json"):
        list(v.iter_rows("user"))
    with pytest.raises(CorruptCheckpointError, match="worker-00001.index.json"):
        recckpt.open(tmp_path / "c").lookup("user", [1, 2])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "recckpt", "export", str(tmp_path / "c"), "--out",
                        str(tmp_path / "exp"), "--format", "npy"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 1 and "worker-00001.index.json" in p.stderr, (p.returncode, p.stderr)


def test_corrupt_extras_and_manifest(tmp_path):
    make_checkpoint(str(tmp_path), "c", table_rows(20), extras={"x": 1})
    p = tmp_path / "c" / "extras.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="extras.safetensors"):
        recckpt.open(tmp_path / "c").objects()
    (tmp_path / "c" / "manifest.json").write_text("{garbage")
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        recckpt.open(tmp_path / "c")


def test_pickled_objects_are_shown_as_bytes_never_unpickled(tmp_path):
    import fractions

    from helpers.checkpoints import FAST, SPEC, Model
    from helpers.tables import DictTable
    s = recckpt.Saver(Model(DictTable("user", SPEC)), output_dir=tmp_path, options=FAST)
    s.register_for_checkpointing("frac", {"f": fractions.Fraction(1, 3)}, allow_pickle=True)
    with torch.serialization.safe_globals([fractions.Fraction]):   # (a save refuses what no load could read)
        s.save("c")
    e = recckpt.open(tmp_path / "c").objects()["objects"]["frac"]
    assert e["kind"] == "pickled_value" and e["state"].dtype == torch.uint8


def test_storage_options_are_refused_or_passed_on(tmp_path):
    make_checkpoint(str(tmp_path), "c", table_rows(20))
    import inspect

    from recckpt.storage import open_storage
    if "storage_options" in inspect.signature(open_storage).parameters:
        assert recckpt.open(tmp_path / "c", storage_options={}).ckpt_id == "c"
    else:
        with pytest.raises(InvalidArgumentError, match="storage_options"):
            recckpt.open(tmp_path / "c", storage_options={"anon": True})
    assert os.path.isdir(tmp_path / "c")


def test_small_windows_read_every_row_once(tmp_path, monkeypatch):
    """iter_rows reads a table window of buckets at a time (what bounds its memory); with tiny windows the
    rows, of a bucket range too, are still every row exactly once."""
    import recckpt.tools.reader as reader_mod
    rows = table_rows(3000, seed=9)
    make_checkpoint(str(tmp_path), "c", rows, workers=2)
    v = recckpt.open(tmp_path / "c")
    monkeypatch.setattr(reader_mod, "WINDOW_BYTES", 4096)
    _, got = _all(v, chunk_rows=1000)
    assert np.array_equal(got["ids"], rows["ids"]) and np.array_equal(got["embedding"], rows["embedding"])
    _, got = _all(v, slots=["freq"], buckets=(100, 3000))
    b = bucket_of(rows["ids"], v.num_buckets)
    assert np.array_equal(got["ids"], rows["ids"][(b >= 100) & (b < 3000)])


def test_reuse_gives_the_same_rows_in_one_buffer(tmp_path):
    rows = table_rows(2000, seed=4)
    make_checkpoint(str(tmp_path), "c", rows, workers=2)
    v = recckpt.open(tmp_path / "c")
    ids, embs, bufs = [], [], set()
    for i, c in v.iter_rows("user", slots=["embedding"], chunk_rows=300, reuse=True):
        ids.append(i.copy())
        embs.append(c["embedding"].copy())
        bufs.add(c["embedding"].__array_interface__["data"][0])
    got = by_id(np.concatenate(ids), {"embedding": np.concatenate(embs)})
    assert np.array_equal(got["ids"], rows["ids"]) and np.array_equal(got["embedding"], rows["embedding"])
    assert len(embs) > 5 and len(bufs) == 1
