"""Serving export: a checkpoint's embedding rows to Parquet, safetensors or .npy files, streamed.

    recckpt.export("/runs/a/ckpt_1000", "/serve/v1", ExportOptions(format="parquet", dtype="fp16"))

Every output file holds the ids beside the rows (same order). Rows stream from `CheckpointView.iter_rows`
in chunks, so memory stays bounded whatever the table size: Parquet writes each chunk as a row group;
safetensors and .npy hold one output file (`shard_rows` rows) at a time. `export.json`, written last,
lists every file and row count; an output directory without it is an interrupted export.

Values: `fp32`/`fp16`/`bf16` convert float slots (other slots are written as they are); Parquet and .npy
have no bfloat16, so bf16 values are written there as float32 numbers already rounded to bf16. `int8`
quantizes each row of a float slot on its own (docs/CLI.md states the error bound):

    scale = (max(row) - min(row)) / 255,  offset = min(row)
    q = round((x - offset) / scale) - 128          (int8; all -128 when scale is 0)
    x' = (q + 128) * scale + offset,  |x - x'| <= scale / 2   (plus float32 rounding)

with `<slot>.scale` and `<slot>.offset` (float32, one per row) stored beside the slot.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, raw_os_errors_named
from ..format import dtypes
from ..storage import location
from .reader import DEFAULT_CHUNK_ROWS, CheckpointView, open as open_checkpoint

FORMATS = ("parquet", "safetensors", "npy")
DTYPES = ("fp32", "fp16", "bf16", "int8")
#: Counter slots the min_freq / seen_since_step filters read (docs/SPARSE_STATE.md names them).
FREQ_SLOT, LAST_STEP_SLOT = "freq", "last_step"
#: Formats that buffer one output file in memory get at most this many bytes of rows per file by default.
DEFAULT_BUFFERED_FILE_BYTES = 64 << 20
EXPORT_MANIFEST = "export.json"

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}")
Predicate = Callable[[np.ndarray, Mapping[str, np.ndarray]], np.ndarray]


def _positive_int_or_none(what: str, v) -> None:
    if v is not None and (type(v) is not int or v < 1):
        raise InvalidArgumentError(f"{what}={v!r}: expected an integer >= 1")


@dataclass(frozen=True)
class ExportOptions:
    """What to export and how. Validated on construction; table and slot names against the checkpoint."""
    format: str = "parquet"
    tables: tuple[str, ...] | None = None       # None: every table
    slots: tuple[str, ...] = ("embedding",)
    dtype: str = "fp32"
    shard_rows: int | None = None               # rows per output file; None: one Parquet file per table,
    #                                             DEFAULT_BUFFERED_FILE_BYTES of rows for safetensors/.npy
    min_freq: int | None = None                 # keep rows whose `freq` counter is >= this
    seen_since_step: int | None = None          # keep rows whose `last_step` counter is >= this
    predicate: Predicate | None = field(default=None, compare=False)
    """API only: predicate(ids, {slot: array}) -> bool mask of rows to keep (the arrays are reused for the
    next chunk: do not keep them); it sees the exported slots
    and the counter slots the table has (as numpy, BF16 as float32)."""
    chunk_rows: int = DEFAULT_CHUNK_ROWS

    def __post_init__(self):
        if self.format not in FORMATS:
            raise InvalidArgumentError(f"format={self.format!r}: choose one of {', '.join(FORMATS)}")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        for what, names in (("tables", self.tables), ("slots", self.slots)):
            if names is None:
                continue
            if isinstance(names, str) or not all(isinstance(n, str) for n in names) or not names:
                raise InvalidArgumentError(f"{what}={names!r}: expected a non-empty list of names")
            object.__setattr__(self, what, tuple(names))
        _positive_int_or_none("shard_rows", self.shard_rows)
        _positive_int_or_none("chunk_rows", self.chunk_rows)
        for what in ("min_freq", "seen_since_step"):
            v = getattr(self, what)
            if v is not None and type(v) is not int:
                raise InvalidArgumentError(f"{what}={v!r}: expected an integer")
        if self.predicate is not None and not callable(self.predicate):
            raise InvalidArgumentError("predicate must be callable(ids, cols) -> bool mask")


@dataclass
class ExportResult:
    out_dir: str
    tables: dict[str, dict] = field(default_factory=dict)   # name -> {"rows", "files", "slots"}
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return sum(t["rows"] for t in self.tables.values())


# ------------------------------------------------------------------------------------------ values
def _float32_rows(x: np.ndarray) -> np.ndarray:
    """`x` [n, ...] as the float32 [n, k] rows int8 quantizes (a float64 beyond float32's range becomes
    infinity there, which int8 refuses)."""
    with np.errstate(over="ignore"):
        return x.reshape(x.shape[0], int(np.prod(x.shape[1:]))).astype(np.float32, copy=False)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise int8: (q int8[n, ...], scale float32[n], offset float32[n]); see the module docstring."""
    n = x.shape[0]
    flat = _float32_rows(x)
    if flat.size and not np.isfinite(flat).all():
        raise InvalidArgumentError("dtype=int8: a row holds NaN or infinity, which int8 cannot represent; "
                                   "export it as fp32/fp16/bf16 instead")
    lo = flat.min(axis=1) if flat.shape[1] else np.zeros(n, np.float32)
    hi = flat.max(axis=1) if flat.shape[1] else np.zeros(n, np.float32)
    scale = ((hi.astype(np.float64) - lo) / 255.0).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint((flat - lo[:, None]) / safe[:, None])
    np.clip(q, 0, 255, out=q)
    q = np.where(scale[:, None] > 0, q, 0) - 128
    return q.astype(np.int8).reshape(x.shape), scale, lo.astype(np.float32)


def dequantize_int8(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    n = q.shape[0]
    flat = (q.reshape(n, int(np.prod(q.shape[1:]))).astype(np.float32) + 128) * scale[:, None] + offset[:, None]
    return flat.reshape(q.shape)


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


def _convert(name: str, a: np.ndarray, dtype: str, fmt: str) -> dict[str, Any]:
    """Columns for one slot of a chunk: {column name: numpy array or torch tensor (bf16 safetensors)}."""
    if not _is_float(a):
        return {name: a}
    if dtype == "fp32":
        return {name: a.astype(np.float32, copy=False)}
    # torch only for what numpy cannot do well: fp16 (torch converts with the CPU's F16C instructions;
    # numpy's loop is several times slower) and bf16 (numpy has no bfloat16). fp32/int8 exports of
    # Parquet and .npy never import it.
    if dtype == "fp16":
        import torch
        return {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.float16).numpy()}
    if dtype == "bf16":
        import torch
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
        return {name: t if fmt == "safetensors" else t.float().numpy()}
    q, scale, offset = quantize_int8(a)
    return {name: q, f"{name}.scale": scale, f"{name}.offset": offset}


# ----------------------------------------------------------------------------------------- writers
def _arrow(a: np.ndarray):
    """A flat Arrow array over `a`'s buffer, without a copy (and without pa.array's probe for pandas, which
    imports pandas on first use: seconds and ~100 MB)."""
    import pyarrow as pa
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.dtype == np.bool_:  # Arrow packs booleans into bits
        return pa.array(flat, type=pa.bool_())
    return pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), len(flat), [None, pa.py_buffer(flat)])


class _ParquetSink:
    """One Parquet file per shard: `id` int64 and one fixed-size-list column per slot column, written
    row group by row group (memory: one chunk)."""
    suffix = ".parquet"

    def __init__(self, path: str):
        self.path, self._w = path, None

    def write(self, ids: np.ndarray, cols: dict[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        arrays, fields = [_arrow(ids.astype("<i8", copy=False))], [pa.field(ID_COLUMN, pa.int64(), nullable=False)]
        for name, a in cols.items():
            if a.ndim == 1:
                arr = _arrow(a)
            else:
                arr = pa.FixedSizeListArray.from_arrays(_arrow(a), int(np.prod(a.shape[1:])))
            meta = {b"recckpt.row_shape": json.dumps(list(a.shape[1:])).encode()}
            arrays.append(arr)
            fields.append(pa.field(name, arr.type, nullable=False, metadata=meta))
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        if self._w is None:
            # Dictionary pages and min/max statistics of embedding values cost most of the write time and
            # help no reader (the values are near-unique floats); the id column keeps its statistics.
            self._w = pq.ParquetWriter(self.path, table.schema, use_dictionary=False, write_statistics=["id"])
        self._w.write_table(table)

    def close(self) -> list[str]:
        if self._w is None:
            return []
        self._w.close()
        return [self.path]


def _torch_cat(parts):
    import torch  # only bf16 columns for safetensors are tensors
    return torch.cat(parts)


class _BufferedSink:
    """safetensors / .npy: a file's rows are collected, then written at once (at most shard_rows rows)."""

    def __init__(self, path: str, fmt: str):
        self.path, self.fmt = path, fmt
        self._ids, self._cols = [], {}

    def write(self, ids: np.ndarray, cols: dict[str, Any]) -> None:
        # Copies: the arrays may be views of the reader's reused chunk buffer.
        self._ids.append(np.array(ids))
        for k, a in cols.items():
            self._cols.setdefault(k, []).append(np.array(a) if isinstance(a, np.ndarray) else a.clone())

    def close(self) -> list[str]:
        if not self._ids:
            return []
        ids = np.concatenate(self._ids)
        cols = {k: (np.concatenate(v) if isinstance(v[0], np.ndarray) else _torch_cat(v))
                for k, v in self._cols.items()}
        self._ids, self._cols = [], {}
        if self.fmt == "safetensors":
            import torch  # the safetensors writer takes tensors (bf16 has no numpy dtype)
            from safetensors.torch import save_file
            tensors = {ID_COLUMN: torch.from_numpy(ids)}
            tensors.update({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
                            for k, v in cols.items()})
            save_file(tensors, self.path + ".safetensors", metadata={"format": "recckpt-export"})
            return [self.path + ".safetensors"]
        written = []
        for k, a in {ID_COLUMN: ids, **cols}.items():
            p = f"{self.path}.{k}.npy"
            np.save(p, a, allow_pickle=False)
            written.append(p)
        return written


class _Parts:
    """A table's output files `part-NNNNN.*` in `folder`, each of at most `per_file` rows (None: one)."""

    def __init__(self, folder: str, fmt: str, per_file: int | None):
        self.folder, self.fmt, self.per_file = folder, fmt, per_file
        self.files: list[str] = []
        self.rows = self.in_part = self.count = 0
        self.sink = None

    def room(self, n: int) -> int:
        """How many of `n` rows go into the current file (one is opened if needed)."""
        if self.sink is None:
            base = os.path.join(self.folder, f"part-{self.count:05d}")
            self.sink = _ParquetSink(base + ".parquet") if self.fmt == "parquet" else _BufferedSink(base, self.fmt)
            self.count, self.in_part = self.count + 1, 0
        return n if self.per_file is None else min(n, self.per_file - self.in_part)

    def write(self, ids: np.ndarray, cols: dict[str, Any]) -> None:
        self.sink.write(ids, cols)
        self.in_part += len(ids)
        self.rows += len(ids)
        if self.per_file is not None and self.in_part == self.per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self.sink is not None:
            self.files.extend(self.sink.close())
            self.sink = None

    def close(self) -> tuple[list[str], int]:
        self._close_file()
        return self.files, self.rows


# ------------------------------------------------------------------------------------------ export
def _safe_name(what: str, name: str) -> str:
    """Table and slot names become file names: a checkpoint from elsewhere must not write outside `out`,
    and a table directory must not take the name of the file that says the export is complete."""
    if not _SAFE_NAME.fullmatch(name) or ".." in name:
        skip = " (leave it out with --tables / ExportOptions.tables)" if what == "table" else \
            " (leave it out with --slots / ExportOptions.slots)"
        raise InvalidArgumentError(f"{what} {name!r} cannot be used as a file name (1 to 200 of the ASCII letters, "
                                   f"digits and '_.=+-', the first a letter, digit or '_', no '..'), so it cannot be exported{skip}")
    if what == "table" and name == EXPORT_MANIFEST:
        raise InvalidArgumentError(f"table {name!r} would take the name of the export's own {EXPORT_MANIFEST}, "
                                   f"so it cannot be exported (leave it out with --tables / ExportOptions.tables)")
    return name


ID_COLUMN = "id"


def output_columns(slots: list[tuple[str, str]], dtype: str) -> list[tuple[str, str]]:
    """(column name, what it holds) of every output column, in order, for `slots` ((name, format dtype
    name), as asked for): the ids, then each slot, with `<slot>.scale` and `<slot>.offset` after an int8 float slot. The
    names are the Parquet fields, the safetensors keys and the .npy file names alike."""
    cols = [(ID_COLUMN, "the ids")]
    for s, dt in slots:
        cols.append((s, f"slot {s!r}"))
        if dtype == "int8" and dt in dtypes.FLOAT_NAMES:
            cols += [(f"{s}.scale", f"the int8 scale of slot {s!r}"), (f"{s}.offset", f"the int8 offset of slot {s!r}")]
    return cols


def _check_columns(view: CheckpointView, table: str, opts: ExportOptions) -> None:
    """Refuse, before any byte is written, two things that would share one column name (one would
    silently overwrite the other, or a Parquet file would hold two fields of one name)."""
    have = view.tables[table].slots
    seen: dict[str, str] = {}
    for name, what in output_columns([(s, have[s].dtype) for s in opts.slots], opts.dtype):
        if name in seen:
            raise InvalidArgumentError(
                f"--slots: table {table!r} of {view.path}: {what} and {seen[name]} would both be written as "
                f"column {name!r}; export them separately (e.g. --slots {name!r} alone, or without --dtype int8)"
                f" or leave one out")
        seen[name] = what


def _plan(view: CheckpointView, opts: ExportOptions) -> dict[str, tuple[list[str], list[str]]]:
    """table -> (exported slots, slots read only for filtering)."""
    tables = list(view.tables) if opts.tables is None else list(opts.tables)
    plan = {}
    for t in tables:
        if t not in view.tables:
            raise InvalidArgumentError(f"ExportOptions.tables (--tables): {view.path} has no table {t!r}; it has {sorted(view.tables)}")
        have = view.tables[t].slots
        missing = [s for s in opts.slots if s not in have]
        if missing:
            raise InvalidArgumentError(f"ExportOptions.slots (--slots): table {t!r} of {view.path} has no slot(s) {missing}; it has "
                                       f"{list(have)}")
        for what, slot, v in (("ExportOptions.min_freq (--min-freq)", FREQ_SLOT, opts.min_freq),
                              ("ExportOptions.seen_since_step (--seen-since-step)", LAST_STEP_SLOT,
                               opts.seen_since_step)):
            if v is not None and slot not in have:
                raise InvalidArgumentError(f"{what}: table {t!r} of {view.path} has no {slot!r} counter slot; "
                                           f"drop the option or export only tables that count (it needs that slot)")
        _safe_name("table", t)
        for s in opts.slots:
            _safe_name("slot", s)
            if opts.format == "parquet" and 0 in tuple(have[s].shape):
                raise InvalidArgumentError(
                    f"ExportOptions.slots (--slots): slot {s!r} of table {t!r} of {view.path} has no values per "
                    f"row (shape {tuple(have[s].shape)}), which Parquet's fixed-size lists cannot hold; export it "
                    f"with format npy or safetensors, or leave it out")
        _check_columns(view, t, opts)
        extra = [s for s in (FREQ_SLOT, LAST_STEP_SLOT) if s in have and s not in opts.slots
                 and (opts.predicate is not None or (s == FREQ_SLOT and opts.min_freq is not None)
                      or (s == LAST_STEP_SLOT and opts.seen_since_step is not None))]
        plan[t] = (list(opts.slots), extra)
    return plan


def _keep_mask(ids, cols, opts: ExportOptions) -> np.ndarray | None:
    mask = None
    if opts.min_freq is not None:
        mask = cols[FREQ_SLOT] >= opts.min_freq
    if opts.seen_since_step is not None:
        m = cols[LAST_STEP_SLOT] >= opts.seen_since_step
        mask = m if mask is None else mask & m
    if opts.predicate is not None:
        p = np.asarray(opts.predicate(ids, cols))
        if p.dtype != np.bool_ or p.shape != ids.shape:
            raise InvalidArgumentError(f"predicate returned {p.dtype} {p.shape}; it must return a bool mask of "
                                       f"shape {ids.shape}")
        mask = p if mask is None else mask & p
    return mask


def _shard_rows(view: CheckpointView, table: str, slots: list[str], opts: ExportOptions) -> int | None:
    if opts.shard_rows is not None or opts.format == "parquet":
        return opts.shard_rows
    row = 8 + sum(view.tables[table].slots[s].row_bytes for s in slots)
    return max(1, DEFAULT_BUFFERED_FILE_BYTES // row)


@raw_os_errors_named("export")
def export(source: str | os.PathLike | CheckpointView, out_dir: str | os.PathLike,
           options: ExportOptions | None = None, *, progress: Callable[[int], None] | None = None,
           storage_options: Mapping[str, Any] | None = None) -> ExportResult:
    """Export `source` (a checkpoint path/URL or an open view) into the local directory `out_dir`, which
    must not exist or be empty. `progress(rows)` is called after each chunk with the rows it read."""
    opts = options or ExportOptions()
    view = source if isinstance(source, CheckpointView) else open_checkpoint(source, storage_options)
    plan = _plan(view, opts)
    out_dir = location(out_dir)
    if "://" in out_dir:
        raise InvalidArgumentError(f"out_dir (--out) {out_dir}: export writes to a local directory; export locally, "
                                   f"then copy the files to the store")
    if not out_dir:
        raise InvalidArgumentError("out_dir (--out) is empty; name a new or empty local directory")
    _refuse_inside_source(view, out_dir)   # first: the hint below must never be to remove a checkpoint
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        interrupted = _partial_export(out_dir)
        raise InvalidArgumentError(
            f"out_dir (--out) {out_dir}: exists and is not an empty directory; choose a new directory (an export "
            f"never overwrites files)" + (f". It has no {EXPORT_MANIFEST}: if it is an export that was killed, "
                                          f"remove it and run the export again" if interrupted else ""))
    t0 = time.perf_counter()
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        return _export_into(view, plan, opts, out_dir, progress, t0)
    except BaseException:
        # out_dir was empty or absent: everything in it is this export's, and a retry must find it empty
        _remove_partial(out_dir, created)
        raise


def _partial_export(out_dir: str) -> bool:
    """Whether `out_dir` looks like what a killed export leaves: no export.json, and nothing but table
    directories of `part-*` files (so never an output directory of checkpoints, nor `.`)."""
    try:
        entries = os.listdir(out_dir)
        return bool(entries) and EXPORT_MANIFEST not in entries and all(
            os.path.isdir(os.path.join(out_dir, e)) and not os.path.islink(os.path.join(out_dir, e))
            and all(f.startswith("part-") for f in os.listdir(os.path.join(out_dir, e))) for e in entries)
    except OSError:
        return False


def _refuse_inside_source(view: CheckpointView, out_dir: str) -> None:
    """A checkpoint is never written after its commit, and retention deletes it whole: an export inside it
    (or inside a link of its chain) would make verify report files it does not list, and go with it."""
    target = os.path.realpath(out_dir)
    for path in view.local_dirs():
        root = os.path.realpath(path)
        if target == root or target.startswith(root + os.sep):
            raise InvalidArgumentError(
                f"out_dir (--out) {out_dir} is inside checkpoint {path}, which is never written after its commit "
                f"and is deleted whole by retention; export to a directory outside it")


def _remove_partial(out_dir: str, created: bool) -> None:
    import shutil
    try:
        if created:
            shutil.rmtree(out_dir)
        else:
            for name in os.listdir(out_dir):
                path = os.path.join(out_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    except OSError:
        pass   # the original error is what the caller needs


def _first_bad_id(ids: np.ndarray, values: np.ndarray) -> str:
    """", id N" for the first row of `values` holding NaN or infinity (what int8 refuses), else ""."""
    if values.dtype.kind != "f":
        return ""
    bad = ~np.isfinite(_float32_rows(values)).all(axis=1)
    return f", id {int(ids[np.argmax(bad)])}" if bad.any() else ""


def _converted_empty(view: CheckpointView, table: str, slots: list[str], opts: ExportOptions) -> dict[str, Any]:
    """The exported columns of no rows of `table`, typed as a chunk of its rows would be."""
    out = {}
    for s in slots:
        info = view.tables[table].slots[s]
        empty = np.empty((0, *info.shape), dtype=dtypes.numpy_dtype(info.dtype) or np.float32)  # BF16: as read
        out.update(_convert(s, empty, opts.dtype, opts.format))
    return out


def _export_into(view: CheckpointView, plan, opts: ExportOptions, out_dir: str,
                 progress: Callable[[int], None] | None, t0: float) -> ExportResult:
    result = ExportResult(out_dir)
    for table, (slots, extra) in plan.items():
        os.makedirs(os.path.join(out_dir, table), exist_ok=True)
        parts = _Parts(os.path.join(out_dir, table), opts.format, _shard_rows(view, table, slots, opts))
        for ids, cols in view.iter_rows(table, slots + extra, chunk_rows=opts.chunk_rows, reuse=True):
            n_read = len(ids)
            mask = _keep_mask(ids, cols, opts)
            if mask is not None:
                ids = ids[mask]
                cols = {k: v[mask] for k, v in cols.items()}
            pos = 0
            while pos < len(ids):
                take = parts.room(len(ids) - pos)
                out_cols = {}
                for s in slots:
                    try:
                        out_cols.update(_convert(s, cols[s][pos:pos + take], opts.dtype, opts.format))
                    except InvalidArgumentError as e:
                        where = _first_bad_id(ids[pos:pos + take], cols[s][pos:pos + take])
                        raise InvalidArgumentError(f"table {table!r}, slot {s!r}{where}: {e}") from None
                parts.write(ids[pos:pos + take], out_cols)
                pos += take
            if progress is not None:
                progress(n_read)
        if parts.rows == 0 and opts.format == "parquet":
            # a Parquet reader of the table's directory (pyarrow, DuckDB, Spark) needs one file for its schema
            parts.room(0)
            parts.write(np.empty(0, dtype="<i8"), _converted_empty(view, table, slots, opts))
        files, rows = parts.close()
        result.tables[table] = {"rows": rows, "files": [os.path.relpath(f, out_dir) for f in files],
                                "slots": {s: {"dtype": view.tables[table].slots[s].dtype,
                                              "shape": list(view.tables[table].slots[s].shape)} for s in slots}}
    result.seconds = time.perf_counter() - t0
    doc = {"source": view.path, "ckpt_id": view.ckpt_id, "step": view.step, "format": opts.format,
           "dtype": opts.dtype, "min_freq": opts.min_freq, "seen_since_step": opts.seen_since_step,
           "filtered_by_predicate": opts.predicate is not None, "tables": result.tables}
    with open(os.path.join(out_dir, EXPORT_MANIFEST), "w") as f:
        json.dump(doc, f, indent=1)
    return result


__all__ = ["DTYPES", "FORMATS", "ExportOptions", "ExportResult", "dequantize_int8", "export", "quantize_int8"]
