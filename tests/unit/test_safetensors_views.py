"""safetensors_io.read_views, the dense-load parser: tensors that view one buffer, and the same rules
as the safetensors library (each broken rule is refused naming the file)."""
from __future__ import annotations

import io
import json
import struct

import pytest
import torch

from recckpt import Saver
from recckpt.errors import CorruptCheckpointError
from recckpt.format import checkpoint, safetensors_io
from recckpt.format.checkpoint import CheckpointReader
from recckpt.storage import open_storage

# In name order: "a" (8 bytes) leaves "b" aligned; the 3 bytes of "d" misalign "e" and "w".
TENSORS = {"a": torch.arange(8, dtype=torch.uint8), "b": torch.randn(4, 5), "c": torch.zeros(0, 3),
           "d": torch.tensor([True, False, True]), "e": torch.arange(6, dtype=torch.int64).view(2, 3),
           "w": torch.randn(8, 4)}


def encoded(tensors=TENSORS, meta=None) -> bytearray:
    f = io.BytesIO()
    safetensors_io.write(f, tensors, meta)
    return bytearray(f.getvalue())


def with_header(raw: bytearray, edit) -> bytearray:
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    edit(header)
    head = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_written_entries_are_all_aligned_so_all_are_views():
    buf = encoded()
    ours, _ = safetensors_io.read_views(buf, "f")
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert {k for k, t in ours.items() if t.numel() and base <= t.data_ptr() < base + len(buf)} == \
        {k for k, t in TENSORS.items() if t.numel()}


def by_name(tensors, meta=None) -> bytearray:
    """A file laid out as older writers did: entries in name order, so some are misaligned."""
    raw = encoded(tensors, meta)
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    parts, offset = [], 0
    for k in sorted(tensors):
        s, e = header[k]["data_offsets"]
        parts.append(bytes(raw[8 + n + s:8 + n + e]))
        header[k]["data_offsets"] = [offset, offset + e - s]
        offset += e - s
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return bytearray(struct.pack("<Q", len(head)) + head + b"".join(parts))


def test_values_match_the_library_and_aligned_tensors_view_the_buffer():
    buf = by_name(TENSORS, meta={"k": "v"})
    ours, meta = safetensors_io.read_views(buf, "f")
    lib, lib_meta = safetensors_io.read(bytes(buf), "f")
    assert meta == lib_meta == {"k": "v"} and ours.keys() == lib.keys() == TENSORS.keys()
    for k, t in TENSORS.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t) and torch.equal(lib[k], t)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    inside = {k for k, t in ours.items() if t.numel() and base <= t.data_ptr() < base + len(buf)}
    assert inside == {"a", "b", "d"}  # "e" and "w" are misaligned, so copied
    for k in ("e", "w"):
        assert torch.equal(ours[k], TENSORS[k])
    ours["b"].mul_(0)  # a view: the write goes to the buffer
    assert not safetensors_io.read_views(buf, "f")[0]["b"].any()


@pytest.mark.parametrize("edit,why", [
    (lambda h: h["b"].update(dtype="F99"), "unknown dtype"),
    (lambda h: h["b"].update(shape=[4, -5]), "shape"),
    (lambda h: h["b"].update(shape=[4, 6]), "bytes for shape"),
    (lambda h: h["b"].update(data_offsets=[3, 10 ** 9]), "data section"),
    (lambda h: h["b"].update(data_offsets=[4, 84]), "starts at"),
    (lambda h: h.pop("d"), "cover"),  # the last entry in the file (1-byte elements come last)
    (lambda h: h["b"].pop("shape"), "lacks one of dtype, shape, data_offsets"),
    (lambda h: h.update(__metadata__={"k": 1}), "__metadata__"),
])
def test_each_broken_rule_is_refused_like_the_library_does(edit, why):
    raw = with_header(encoded(), edit)
    with pytest.raises(CorruptCheckpointError, match="f.safetensors"):
        safetensors_io.read(bytes(raw), "f.safetensors")
    with pytest.raises(CorruptCheckpointError, match=why):
        safetensors_io.read_views(raw, "f.safetensors")


@pytest.mark.parametrize("raw", [b"", b"\x01", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 2) + b"[]",
                                 struct.pack("<Q", 2) + b"\xff\xfe"])
def test_bad_header_bytes_are_refused(raw):
    with pytest.raises(CorruptCheckpointError, match="f.safetensors"):
        safetensors_io.read_views(bytearray(raw), "f.safetensors")


def test_a_checkpoints_dense_state_is_read_into_one_buffer(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    Saver(model, output_dir=str(tmp_path)).save("c")
    reader = CheckpointReader(open_storage(str(tmp_path)), "c")
    dense = reader.dense()
    size = reader.manifest.files[reader.manifest.dense].size
    lo = min(t.data_ptr() for t in dense.values())
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in dense.values())
    assert hi - lo <= size  # all of them inside one file-sized buffer: no per-tensor copies
    for k, t in model.state_dict().items():
        assert torch.equal(dense[k], t)


def raw_file(header) -> bytearray:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(head)) + head)


ZERO = {"dtype": "F32", "data_offsets": [0, 0]}


@pytest.mark.parametrize("header", [
    {"x": {**ZERO, "shape": [2 ** 40, 2 ** 40, 0]}},     # the product passes 64 bits before the 0
    {"x": {**ZERO, "shape": [2 ** 63, 0]}},
    b"[" * 200_000,                                       # nesting deeper than the parser's recursion
    {"__metadata__": []},
    {"__metadata__": {"k": "v"}, "x": {**ZERO, "shape": [0]}, "y": {**ZERO, "shape": [0], "z": float("nan")}},
    b'{"__metadata__": {}, "__metadata__": {"a": "b"}}',   # a key twice
    b'{"\\ud800": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}',  # a lone surrogate
])
def test_hostile_headers_are_refused_as_the_library_refuses_them(header):
    raw = raw_file(header)
    with pytest.raises(CorruptCheckpointError):
        safetensors_io.read(bytes(raw), "f.safetensors")
    with pytest.raises(CorruptCheckpointError, match="f.safetensors"):
        safetensors_io.read_views(raw, "f.safetensors")


def test_a_large_zero_size_shape_both_accept():
    raw = raw_file({"x": {**ZERO, "shape": [2 ** 31, 2 ** 31, 0]}})
    assert safetensors_io.read_views(raw, "f")[0]["x"].shape == safetensors_io.read(bytes(raw), "f")[0]["x"].shape


def test_a_file_that_grew_after_its_size_was_checked_is_refused(tmp_path, monkeypatch):
    model = torch.nn.Linear(8, 4)
    Saver(model, output_dir=str(tmp_path)).save("c")
    storage = open_storage(str(tmp_path))
    reader = CheckpointReader(storage, "c")
    real = checkpoint.catalog.check_inside

    def grown(storage, path, *args):  # the file gains bytes right after its size was checked
        if path.endswith("dense.safetensors"):
            with open(storage.local_path(path), "ab") as f:
                f.write(b"x")
        return real(storage, path, *args)

    monkeypatch.setattr(checkpoint.catalog, "check_inside", grown)
    with pytest.raises(CorruptCheckpointError, match="dense.safetensors.*changed while it was read"):
        reader.dense()
