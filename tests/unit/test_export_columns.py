"""Export never writes a wrong column (issue 30 item 3): names that would share an output column (a slot
named `id`, a slot named like another's int8 `.scale`/`.offset` companion, a slot listed twice) are
refused before any byte is written, in every format; and every format's output, read back with its own
library, holds exactly the expected columns with the right values."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.tables import DictTable
from recckpt import SaveOptions, Saver
from recckpt.errors import InvalidArgumentError
from recckpt.state.protocol import SlotSpec
from recckpt.tools.exporter import ExportOptions, dequantize_int8, export

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, D = 300, 6
SPEC = {"embedding": SlotSpec(torch.float32, (D,), "sparse"),
        "embedding.scale": SlotSpec(torch.float32, (D,), "sparse"),
        "id": SlotSpec(torch.float32, (D,), "sparse"),
        "acc": SlotSpec(torch.float32, (D,), "sparse_opt"),
        "freq": SlotSpec(torch.int64, (), "sparse")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("export_cols")
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(10 * N, generator=g)[:N] - 5 * N
    cols = {k: (torch.randn((N, *s.shape), generator=g) * 3 if s.dtype == torch.float32
                else torch.randint(0, 50, (N,), generator=g)) for k, s in SPEC.items()}
    t = DictTable("t", SPEC)
    t.set_rows(ids, cols)
    Saver(torch.nn.ModuleDict({"t": t}), output_dir=str(d / "out"), options=SaveOptions(fsync=False)).save("c1")
    return str(d / "out" / "c1"), ids.numpy(), {k: v.numpy() for k, v in cols.items()}


COLLISIONS = [(("embedding", "id"), "fp32", "'id'"),
              (("embedding", "embedding.scale"), "int8", "'embedding.scale'"),
              (("embedding", "embedding"), "fp32", "'embedding'")]


@pytest.mark.parametrize("fmt", ["parquet", "safetensors", "npy"])
@pytest.mark.parametrize("slots,dtype,column", COLLISIONS, ids=["id", "scale", "twice"])
def test_colliding_columns_are_refused_before_any_byte(ckpt, tmp_path, fmt, slots, dtype, column):
    src, _, _ = ckpt
    out = tmp_path / "exp"
    with pytest.raises(InvalidArgumentError) as ei:
        export(src, str(out), ExportOptions(format=fmt, slots=slots, dtype=dtype))
    assert column in str(ei.value) and "'t'" in str(ei.value)
    assert not out.exists()


def test_cli_names_both_columns_in_one_line(ckpt, tmp_path):
    src, _, _ = ckpt
    p = subprocess.run([sys.executable, "-m", "recckpt", "export", src, "--out", str(tmp_path / "e"), "--format", "npy",
                        "--slots", "embedding,embedding.scale", "--dtype", "int8"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "slot 'embedding.scale'" in lines[0] and "int8 scale of slot 'embedding'" in lines[0], lines[0]
    assert not (tmp_path / "e").exists()


def read_back(out, fmt):
    """{column: array} of table 't' as each format's own reader gives it, all parts concatenated."""
    folder = os.path.join(out, "t")
    parts = sorted({f.split(".")[0] for f in os.listdir(folder)})
    got: dict[str, list] = {}
    for part in parts:
        if fmt == "parquet":
            import pyarrow.parquet as pq
            tab = pq.read_table(os.path.join(folder, part + ".parquet"))
            assert len(set(tab.column_names)) == len(tab.column_names), tab.column_names
            cols = {}
            for name in tab.column_names:
                col = tab.column(name).combine_chunks()
                cols[name] = (np.asarray(col.flatten()).reshape(len(col), -1) if hasattr(col, "flatten")
                              else np.asarray(col))
        elif fmt == "safetensors":
            from safetensors.numpy import load_file
            cols = load_file(os.path.join(folder, part + ".safetensors"))
        else:
            cols = {f[len(part) + 1:-len(".npy")]: np.load(os.path.join(folder, f), allow_pickle=False)
                    for f in os.listdir(folder) if f.startswith(part + ".")}
        for k, v in cols.items():
            got.setdefault(k, []).append(v)
    return {k: np.concatenate(v) for k, v in got.items()}


@pytest.mark.parametrize("fmt", ["parquet", "safetensors", "npy"])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_every_format_reads_back_with_the_right_columns(ckpt, tmp_path, fmt, dtype):
    src, ids, cols = ckpt
    slots = ("embedding", "embedding.scale", "acc", "freq") if dtype == "fp32" else ("embedding", "acc", "freq")
    out = str(tmp_path / "exp")
    export(src, out, ExportOptions(format=fmt, slots=slots, dtype=dtype, shard_rows=128))
    got = read_back(out, fmt)
    expect = {"id"} | set(slots) | ({f"{s}.{c}" for s in ("embedding", "acc") for c in ("scale", "offset")}
                                   if dtype == "int8" else set())
    assert set(got) == expect
    order = np.argsort(ids)
    pos = np.searchsorted(ids[order], got["id"])
    assert (ids[order][pos] == got["id"]).all() and len(got["id"]) == N
    rows = order[pos]                                   # the checkpoint row of each exported row
    assert (got["freq"].reshape(-1) == cols["freq"][rows]).all()
    for s in ("embedding", "acc") + (("embedding.scale",) if dtype == "fp32" else ()):
        want = cols[s][rows]
        if dtype == "fp32":
            assert np.array_equal(got[s].reshape(N, D), want), s
        else:
            x = dequantize_int8(got[s].reshape(N, D), got[f"{s}.scale"].reshape(N), got[f"{s}.offset"].reshape(N))
            assert np.abs(x - want).max() <= got[f"{s}.scale"].max() / 2 + 1e-5, s
