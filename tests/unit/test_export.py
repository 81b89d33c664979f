"""recckpt.export on real checkpoints: every format and dtype, read back by pyarrow, pandas, DuckDB,
safetensors and numpy, compared row by row with the table (exact for fp32, within the documented bound
for fp16, bf16 and int8); filters, file sharding, memory:// sources and bad options."""
from __future__ import annotations

import glob
import json
import os
import uuid

import numpy as np
import pytest
import torch

import recckpt
from helpers.checkpoints import DIM, make_checkpoint, table_rows
from recckpt import ExportOptions
from recckpt.errors import InvalidArgumentError
from recckpt.tools.exporter import dequantize_int8, quantize_int8

ROWS = table_rows(1200, seed=5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    make_checkpoint(str(root / "one"), "c", ROWS, workers=1)
    make_checkpoint(str(root / "three"), "c", ROWS, workers=3)
    return {1: str(root / "one" / "c"), 3: str(root / "three" / "c")}


# ---------------------------------------------------------------------------------------- readers
def _parquet(out, reader):
    files = sorted(glob.glob(os.path.join(out, "user", "*.parquet")))
    assert files
    if reader == "pyarrow":
        import pyarrow as pa
        import pyarrow.parquet as pq
        t = pa.concat_tables([pq.read_table(f) for f in files])
        assert t.schema.field("id").type == pa.int64()
        return {c: np.asarray(t.column(c).combine_chunks().flatten() if pa.types.is_fixed_size_list(t.schema.field(c).type)
                              else t.column(c).to_numpy()).reshape(t.num_rows, -1)
                for c in t.column_names}
    if reader == "pandas":
        import pandas as pd
        df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        return {c: np.stack(df[c].to_numpy()).reshape(len(df), -1) for c in df.columns}
    import duckdb
    con = duckdb.connect()
    rel = con.sql(f"select * from read_parquet({files!r})")
    cols = rel.columns
    rows = rel.fetchall()
    return {c: np.array([r[i] for r in rows]).reshape(len(rows), -1) for i, c in enumerate(cols)}


def _safetensors(out):
    from safetensors.torch import load_file
    parts = [load_file(f) for f in sorted(glob.glob(os.path.join(out, "user", "*.safetensors")))]
    return {k: torch.cat([p[k] for p in parts]).float().numpy().reshape(sum(len(p["id"]) for p in parts), -1)
            if k != "id" else torch.cat([p[k] for p in parts]).numpy().reshape(-1, 1) for k in parts[0]}


def _npy(out):
    parts = sorted({os.path.basename(f).split(".")[0] for f in glob.glob(os.path.join(out, "user", "*.npy"))})
    cols = {}
    for p in parts:
        for f in glob.glob(os.path.join(out, "user", f"{p}.*.npy")):
            k = os.path.basename(f)[len(p) + 1:-4]
            a = np.load(f, allow_pickle=False)
            cols.setdefault(k, []).append(a.reshape(len(a), -1))
    return {k: np.concatenate(v) for k, v in cols.items()}


def _values(cols: dict, slot: str, dtype: str) -> np.ndarray:
    if dtype == "int8":
        return dequantize_int8(cols[slot].astype(np.int8), cols[f"{slot}.scale"].reshape(-1),
                               cols[f"{slot}.offset"].reshape(-1))
    return cols[slot].astype(np.float32)


def _check_rows(cols, dtype, keep=None, slot="embedding"):
    """Per row: the exported values against the table, within the bound of `dtype` (docs/CLI.md)."""
    ids = cols["id"].reshape(-1)
    sel = np.ones(len(ROWS["ids"]), bool) if keep is None else keep
    want_ids = ROWS["ids"][sel]
    order = np.argsort(ids)
    assert np.array_equal(ids[order], want_ids)
    got = _values(cols, slot, dtype)[order]
    want = ROWS[slot][sel].reshape(len(want_ids), -1)
    err = np.abs(got.astype(np.float64) - want)
    mag = np.abs(want.astype(np.float64))
    if dtype == "fp32":
        assert np.array_equal(got, want)
        return
    if dtype == "fp16":
        bound = mag * 2.0 ** -11 + 2.0 ** -25
    elif dtype == "bf16":
        bound = mag * 2.0 ** -8 + 2.0 ** -134
    else:
        scale = cols[f"{slot}.scale"].reshape(-1)[order].astype(np.float64)[:, None]
        bound = scale / 2 + 4 * np.finfo(np.float32).eps * (want.max(axis=1, keepdims=True).__abs__()
                                                             + np.abs(want.min(axis=1, keepdims=True)) + 255 * scale)
        assert np.array_equal(got[0], want[0])       # the constant row comes back exactly
    bad = np.nonzero((err > bound).any(axis=1))[0]
    assert bad.size == 0, f"{dtype}: rows {bad[:5]} off by {err[bad[:5]].max(axis=1)}"


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("reader", ["pyarrow", "pandas", "duckdb"])
def test_parquet_read_back_by_each_reader(ckpts, tmp_path, workers, dtype, reader):
    out = tmp_path / "out"
    res = recckpt.export(ckpts[workers], out, ExportOptions(format="parquet", dtype=dtype, chunk_rows=300))
    assert res.rows == len(ROWS["ids"])
    cols = _parquet(str(out), reader)
    assert list(cols)[:2] == ["id", "embedding"]
    _check_rows(cols, dtype)


def test_parquet_schema(ckpts, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    recckpt.export(ckpts[1], tmp_path / "o", ExportOptions(dtype="fp16", slots=("embedding", "freq")))
    schema = pq.read_schema(tmp_path / "o" / "user" / "part-00000.parquet")
    assert schema.field("id").type == pa.int64()
    assert schema.field("embedding").type == pa.list_(pa.float16(), DIM)
    assert schema.field("freq").type == pa.int64()
    doc = json.loads((tmp_path / "o" / "export.json").read_text())
    assert doc["tables"]["user"]["rows"] == len(ROWS["ids"]) and doc["dtype"] == "fp16"


@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_safetensors_and_npy(ckpts, tmp_path, fmt, dtype):
    out = tmp_path / "out"
    recckpt.export(ckpts[3], out, ExportOptions(format=fmt, dtype=dtype, shard_rows=500))
    cols = _safetensors(str(out)) if fmt == "safetensors" else _npy(str(out))
    _check_rows(cols, dtype)
    if fmt == "safetensors" and dtype == "bf16":
        from safetensors import safe_open
        with safe_open(glob.glob(str(out / "user" / "*.safetensors"))[0], "pt") as f:
            assert f.get_tensor("embedding").dtype == torch.bfloat16


def test_shard_rows_bounds_every_file(ckpts, tmp_path):
    import pyarrow.parquet as pq
    res = recckpt.export(ckpts[3], tmp_path / "o", ExportOptions(shard_rows=250, chunk_rows=100))
    files = res.tables["user"]["files"]
    counts = [pq.read_metadata(tmp_path / "o" / f).num_rows for f in files]
    assert len(files) == -(-len(ROWS["ids"]) // 250) and max(counts) == 250 and sum(counts) == len(ROWS["ids"])


def test_filters_on_counters_and_predicate(ckpts, tmp_path):
    res = recckpt.export(ckpts[3], tmp_path / "a", ExportOptions(min_freq=10, seen_since_step=50))
    keep = (ROWS["freq"] >= 10) & (ROWS["last_step"] >= 50)
    assert 0 < res.rows == keep.sum() < len(ROWS["ids"])
    _check_rows(_parquet(str(tmp_path / "a"), "pyarrow"), "fp32", keep)

    def pred(ids, cols):
        assert set(cols) >= {"embedding", "freq", "last_step"}
        return (ids % 2 == 0) & (cols["freq"] > 3)
    recckpt.export(ckpts[1], tmp_path / "b", ExportOptions(format="npy", predicate=pred, min_freq=5))
    keep = (ROWS["ids"] % 2 == 0) & (ROWS["freq"] > 3) & (ROWS["freq"] >= 5)
    _check_rows(_npy(str(tmp_path / "b")), "fp32", keep)


def test_memory_source(tmp_path):
    url = f"memory://h17exp-{uuid.uuid4().hex}"
    make_checkpoint(url, "c", ROWS, workers=2)
    recckpt.export(f"{url}/c", tmp_path / "o", ExportOptions(dtype="int8"))
    _check_rows(_parquet(str(tmp_path / "o"), "pyarrow"), "int8")


def test_quantize_bound_and_edge_rows():
    g = np.random.default_rng(1)
    x = np.concatenate([g.standard_normal((100, 16)).astype(np.float32) * 100,
                        np.full((1, 16), 7.5, np.float32), np.zeros((1, 16), np.float32)])
    q, scale, offset = quantize_int8(x)
    assert q.dtype == np.int8 and q.min() >= -128 and q.max() <= 127
    back = dequantize_int8(q, scale, offset)
    assert np.array_equal(back[-2:], x[-2:])
    err = np.abs(back - x).max(axis=1)
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-4).all()
    with pytest.raises(InvalidArgumentError, match="NaN"):
        quantize_int8(np.array([[1.0, np.nan]], np.float32))
    for shape in ((0, 5), (0, 2, 3), (3, 0)):   # a file of zero rows (a table filtered empty), rows of no values
        empty = np.zeros(shape, np.float32)
        back = dequantize_int8(*quantize_int8(empty))
        assert back.shape == shape and back.dtype == np.float32


def test_bad_options(ckpts, tmp_path):
    for kw, match in [(dict(format="csv"), "format"), (dict(dtype="int4"), "dtype"),
                      (dict(shard_rows=0), "shard_rows"), (dict(slots="embedding"), "slots"),
                      (dict(min_freq=1.5), "min_freq"), (dict(predicate=3), "predicate")]:
        with pytest.raises(InvalidArgumentError, match=match):
            ExportOptions(**kw)
    with pytest.raises(InvalidArgumentError, match="no table 'item'"):
        recckpt.export(ckpts[1], tmp_path / "a", ExportOptions(tables=("item",)))
    with pytest.raises(InvalidArgumentError, match="no slot"):
        recckpt.export(ckpts[1], tmp_path / "a", ExportOptions(slots=("adam.m",)))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not an empty directory"):
        recckpt.export(ckpts[1], tmp_path / "full", ExportOptions())
    assert (tmp_path / "full" / "x").read_text() == "mine"
    with pytest.raises(InvalidArgumentError, match="local directory"):
        recckpt.export(ckpts[1], "memory://somewhere", ExportOptions())
    with pytest.raises(InvalidArgumentError, match="bool mask"):
        recckpt.export(ckpts[1], tmp_path / "b", ExportOptions(predicate=lambda ids, cols: ids))


def test_missing_counter_is_named(tmp_path):
    from helpers.tables import DictTable
    from recckpt.state.protocol import SlotSpec
    t = DictTable("item", {"embedding": SlotSpec(torch.float32, (4,), "sparse")})
    t.set_rows(torch.arange(10), {"embedding": torch.randn(10, 4)})
    recckpt.Saver(torch.nn.ModuleDict({"item": t}), output_dir=tmp_path / "run",
                  options=recckpt.SaveOptions(fsync=False)).save("c")
    with pytest.raises(InvalidArgumentError, match=r"ExportOptions.min_freq \(--min-freq\): table 'item' .* no 'freq' counter"):
        recckpt.export(tmp_path / "run" / "c", tmp_path / "o", ExportOptions(min_freq=2))


def test_hostile_table_name_cannot_write_outside_out(tmp_path):
    """A checkpoint from elsewhere whose table is named '../../x' (manifest and index rewritten, index CRC
    fixed up so that every check passes) is refused before any file is written."""
    from helpers.hostile import read_json, write_json
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(30))
    ck = tmp_path / "run" / "c"
    evil = "../../escaped"
    idx = read_json(str(ck), "index.json")
    idx["tables"] = {evil: idx["tables"]["user"]}
    write_json(str(ck), "index.json", idx)
    man = read_json(str(ck), "manifest.json")
    man["tables"] = {evil: man["tables"]["user"]}
    man["digests"]["tables"] = {evil: man["digests"]["tables"]["user"]}
    write_json(str(ck), "manifest.json", man)
    assert recckpt.open(ck).tables[evil].rows == 30
    with pytest.raises(InvalidArgumentError, match="cannot be used as a file name"):
        recckpt.export(ck, tmp_path / "out" / "a" / "b", ExportOptions())
    assert not (tmp_path / "out" / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_python_api_errors_name_the_python_options(tmp_path):
    """Issue 29 item 7: a Python caller was told about `--out`/`--tables`, flags it never passed; the
    message now names the argument first, the command-line flag after it."""
    make_checkpoint(str(tmp_path / "run"), "c", table_rows(30))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidArgumentError, match=r"^out_dir \(--out\) .*full: exists and is not an empty"):
        recckpt.export(tmp_path / "run" / "c", tmp_path / "full")
    with pytest.raises(InvalidArgumentError, match=r"^ExportOptions\.tables \(--tables\): .* no table 'nope'"):
        recckpt.export(tmp_path / "run" / "c", tmp_path / "o", ExportOptions(tables=["nope"]))
    with pytest.raises(InvalidArgumentError, match=r"^ExportOptions\.slots \(--slots\): "):
        recckpt.export(tmp_path / "run" / "c", tmp_path / "o", ExportOptions(slots=["nope"]))
    with pytest.raises(InvalidArgumentError, match=r"^prune: keep=0"):
        recckpt.prune(str(tmp_path / "run"), 0)


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_export_leaves_out_empty_so_a_retry_is_accepted(tmp_path, existed):
    """A shard with a flipped byte fails the export (exit 1, naming the shard), which is right; but the
    output directory kept the table folders it had made, so the retry with the same --out was refused as
    "exists and is not an empty directory"."""
    import shutil
    src = str(tmp_path / "src")
    shutil.copytree(os.path.dirname(make_checkpoint_dir(tmp_path)), src)
    shard = sorted(glob.glob(os.path.join(src, "c", "sparse", "*.bin")))[0]
    data = bytearray(open(shard, "rb").read())
    for i in range(len(data) // 3, len(data) - 64, 97):   # whatever the rows read cover
        data[i] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    out = tmp_path / "out"
    if existed:
        out.mkdir()
    with pytest.raises(recckpt.errors.CorruptCheckpointError, match="shard"):
        recckpt.export(os.path.join(src, "c"), str(out))
    assert (os.listdir(out) == []) if existed else not out.exists()
    shutil.copy(os.path.join(make_checkpoint_dir(tmp_path), "sparse", os.path.basename(shard)), shard)
    assert recckpt.export(os.path.join(src, "c"), str(out)).tables["user"]["rows"] == len(ROWS["ids"])


def make_checkpoint_dir(tmp_path) -> str:
    """A one-worker checkpoint of ROWS under tmp_path/orig (made once per test), returned as its path."""
    path = str(tmp_path / "orig")
    if not os.path.exists(path):
        make_checkpoint(path, "c", ROWS, workers=1)
    return os.path.join(path, "c")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_a_parquet_export_of_no_rows_writes_a_file_with_the_schema(tmp_path, dtype):
    """An empty table (or one whose rows the filters all leave out) was exported as no file at all: a
    Parquet reader of its directory (pyarrow, DuckDB, Spark) found no schema, not even the id column. Now
    it gets one file of zero rows whose columns are those a table with rows gets."""
    import pyarrow.parquet as pq
    m = torch.nn.Module()
    m.full = recckpt.HashTable("full", 4)
    m.empty = recckpt.HashTable("empty", 4)
    m.full(torch.arange(10))
    recckpt.SparseAdam(m, lr=0.1)
    recckpt.Saver(m, output_dir=str(tmp_path / "run")).save("c")
    src = str(tmp_path / "run" / "c")
    res = recckpt.export(src, str(tmp_path / "out"), ExportOptions(dtype=dtype))
    assert res.tables["empty"]["rows"] == 0 and len(res.tables["empty"]["files"]) == 1, res.tables
    empty = pq.read_table(str(tmp_path / "out" / "empty"))
    full = pq.read_table(str(tmp_path / "out" / "full"))
    assert empty.num_rows == 0 and full.num_rows == 10
    assert empty.schema.names == full.schema.names and "id" in empty.schema.names, (empty.schema, full.schema)
    assert empty.schema.types == full.schema.types, (empty.schema, full.schema)
    # every row filtered out: the same
    res = recckpt.export(src, str(tmp_path / "out2"), ExportOptions(dtype=dtype, tables=["full"],
                                                                    predicate=lambda ids, cols: ids < 0))
    got = pq.read_table(str(tmp_path / "out2" / "full"))
    assert res.tables["full"]["rows"] == 0 and got.num_rows == 0 and got.schema.types == full.schema.types
