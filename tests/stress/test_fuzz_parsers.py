"""Bounded fuzzing (hypothesis) of every parser that reads checkpoint bytes: checked JSON, manifest and
index validation, safetensors parsing, the state-tree decoder, the extras tree and the version file.
Each may only return a value or raise the documented errors; anything else (KeyError, TypeError,
RecursionError, MemoryError, a hang) is a bug. RECCKPT_SLOW=1 runs 20x more examples (conftest.py)."""
from __future__ import annotations

import copy
import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import stress_harness as h
from recckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from recckpt.format import catalog, checked_json, dtypes, extras, safetensors_io, tree_codec
from recckpt.format.index_parse import index_from_json
from recckpt.format.manifest_parse import manifest_from_json
from recckpt.storage import open_storage

FUZZ = settings()  # example count, deadline and health checks: the "recckpt" profile in conftest.py
DOCUMENTED = (CorruptCheckpointError, IncompatibleCheckpointError)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=12)
    | st.sampled_from(["F32", "I64", "sparse", "index.json", "../x", "/abs", "a\x00b", "recckpt", 1 << 62, -1]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    ckpt = h.build_template(str(tmp_path_factory.mktemp("fuzz")))
    read = lambda rel: open(os.path.join(ckpt, rel), "rb").read()  # noqa: E731
    return {"manifest": checked_json.loads(read("manifest.json"), "m", 1 << 30),
            "index": checked_json.loads_unchecked(read("index.json"), "i", 1 << 30),
            "dense": read("dense.safetensors"), "extras": read("extras.safetensors")}


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, data):
    """Replace, delete or retype one node of a copy of obj."""
    obj = copy.deepcopy(obj)
    paths = [p for p in _paths(obj) if p]
    path = data.draw(st.sampled_from(paths))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    action = data.draw(st.sampled_from(["replace", "delete", "replace"]))
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    return obj


@FUZZ
@given(raw=st.binary(max_size=300))
def test_checked_json_random_bytes(raw):
    try:
        assert isinstance(checked_json.loads(raw, "f", 1 << 20), dict)
    except CorruptCheckpointError:
        pass


@FUZZ
@given(data=st.data())
def test_manifest_validation(template, data):
    obj = _mutate(template["manifest"], data)
    try:
        manifest_from_json(obj, "manifest.json")
    except DOCUMENTED:
        pass


@FUZZ
@given(data=st.data())
def test_index_validation(template, data):
    m = manifest_from_json(template["manifest"], "manifest.json")
    obj = _mutate(template["index"], data)
    try:
        index_from_json(obj, "index.json", m)
    except DOCUMENTED:
        pass
    try:
        index_from_json(obj, "index.json")
    except DOCUMENTED:
        pass


@FUZZ
@given(data=st.data())
def test_safetensors_parsing(template, data):
    raw = bytearray(data.draw(st.sampled_from([template["dense"], template["extras"]])))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "header_len", "header_json", "entry_field"]))
        if kind == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            raw = raw[:data.draw(st.integers(0, len(raw)))]
        elif kind == "header_len" and len(raw) >= 8:
            raw[:8] = struct.pack("<Q", data.draw(st.integers(0, (1 << 64) - 1)))
        elif kind == "header_json":
            head = json.dumps(data.draw(json_values)).encode()
            raw = bytearray(struct.pack("<Q", len(head)) + head + bytes(raw[8:]))
        elif kind == "entry_field" and len(raw) >= 8:
            # One field of one entry (or the metadata) changed, the rest of the file kept: well-formed
            # enough to reach the per-entry rules.
            (n,) = struct.unpack_from("<Q", raw)
            try:
                header = json.loads(bytes(raw[8:8 + n]))
            except ValueError:
                continue
            if not isinstance(header, dict) or not header:
                continue
            key = data.draw(st.sampled_from(sorted(header)))
            ints = st.integers(-2, 1 << 65) | st.sampled_from([0, 1, 2 ** 31, 2 ** 63, 2 ** 64])
            value = data.draw(st.one_of(json_values, st.lists(ints, max_size=4),
                                        st.sampled_from(["F32", "U8", "BOOL", "F8_E4M3", "X"])))
            if isinstance(header[key], dict) and header[key]:
                header[key][data.draw(st.sampled_from(sorted(header[key]) + ["extra"]))] = value
            else:
                header[key] = value
            head = json.dumps(header).encode()
            raw = bytearray(struct.pack("<Q", len(head)) + head + bytes(raw[8 + n:]))
    try:
        lib = safetensors_io.read(bytes(raw), "f.safetensors")
        assert isinstance(lib[1], dict) and all(isinstance(t, torch.Tensor) for t in lib[0].values())
    except CorruptCheckpointError:
        lib = None
    try:  # our own validation (dense loads) accepts only what the library accepts, with equal values
        ours = safetensors_io.read_views(bytearray(raw), "f.safetensors")
    except CorruptCheckpointError:
        ours = None
    if ours is not None:
        assert lib is not None and ours[1] == lib[1] and ours[0].keys() == lib[0].keys()
        for k, t in ours[0].items():
            assert t.dtype == lib[0][k].dtype and t.shape == lib[0][k].shape
            assert torch.equal(t.view(torch.uint8), lib[0][k].view(torch.uint8)) if t.numel() else True
    elif lib is not None:
        known = {dtypes.torch_dtype(n) for n in dtypes.names()}
        assert not all(t.dtype in known for t in lib[0].values()), \
            "the library accepted a file our validation refused"


tree_nodes = st.recursive(
    json_values,
    lambda inner: st.one_of(
        st.fixed_dictionaries({"__tensor__": st.sampled_from(["t0", "nope", 3])}),
        st.fixed_dictionaries({"__ndarray__": st.sampled_from(["t0", "t1"])}),
        st.fixed_dictionaries({"__npscalar__": st.sampled_from(["<f4", "<i8", "V100000000000", "O", "|b1", "x", 5]),
                               "value": inner}),
        st.fixed_dictionaries({"__float__": st.sampled_from(["nan", "inf", "1e999", "x", 3])}),
        st.fixed_dictionaries({"__bigint__": st.sampled_from(["12", "9" * 5000, "x", 1])}),
        st.fixed_dictionaries({"__bytes__": st.sampled_from(["AAAA", "!!", 3])}),
        st.fixed_dictionaries({"__dtype__": st.sampled_from(["F32", "F99", 1])}),
        st.fixed_dictionaries({"__tuple__": inner}),
        st.fixed_dictionaries({"__dict__": st.lists(st.lists(inner, max_size=3), max_size=3)}),
    ), max_leaves=10)


@FUZZ
@given(node=tree_nodes)
def test_tree_decode(node):
    tensors = {"t0": torch.arange(3), "t1": torch.ones(2, dtype=torch.bfloat16)}
    try:
        tree_codec.decode(json.dumps(node), tensors, "f")
    except CorruptCheckpointError:
        pass


@FUZZ
@given(text=st.text(max_size=200) | st.sampled_from(["[" * 100000, '{"a":' * 50000]))
def test_tree_decode_raw_text(text):
    try:
        tree_codec.decode(text, {}, "f")
    except CorruptCheckpointError:
        pass


@FUZZ
@given(tree=json_values)
def test_extras_tree(tree):
    try:
        t = extras.validate(tree, "f")
        extras.unpickle_allowed(t, {k: True for k in t["objects"]}, "f")
    except DOCUMENTED:
        pass


@settings(max_examples=max(1, settings.default.max_examples // 2))
@given(raw=st.binary(max_size=200) | st.lists(st.text(max_size=30), max_size=5).map(lambda x: "\n".join(x).encode()))
def test_version_file(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("vf")
    (d / "checkpoint").write_bytes(raw)
    ids = catalog.read_version_file(open_storage(str(d)))
    assert ids is None or all(isinstance(i, str) and "/" not in i and ".." not in i for i in ids)


# ------------------------------------------------------------------- the one bounded JSON parser
json_texts = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 3000).map(lambda d: b'{"a":' * d + b"1" + b"}" * d),
    st.integers(1, 6000).map(lambda n: b'{"x":' + b"9" * n + b"}"),
    st.sampled_from([b'{"a":1,"a":2}', b'{"a":"\\ud800"}', b'["\\udfff"]', b"NaN", b"[Infinity]",
                     b"1e999", b"-0", b"1.5", b'"\xff"', b"\xef\xbb\xbf{}", b"[" * 200000]),
)


@FUZZ
@given(raw=json_texts, floats=st.booleans())
def test_bounded_parse_closed_errors_and_round_trip(raw, floats):
    """Only CorruptCheckpointError escapes; what parses re-serialises and parses back to itself."""
    limits = checked_json.JsonLimits(1 << 20, floats=floats)
    try:
        obj = checked_json.parse(raw, "f.json", limits)
    except CorruptCheckpointError as e:
        assert e.path == "f.json" and "f.json" in str(e)
        return
    again = checked_json.parse(json.dumps(obj).encode(), "f.json", limits)
    assert again == obj or obj != obj  # NaN cannot appear (no constants), so equality must hold
    checked_json.check_tree(obj)  # the writer's rules accept what the reader accepted


@FUZZ
@given(obj=json_values.filter(lambda v: isinstance(v, dict) and "crc32c" not in v))
def test_checked_file_round_trip(obj):
    """dumps → loads is the identity for every dict the writer accepts (integers, strings, nesting)."""
    try:
        data = checked_json.dumps(obj)
    except (ValueError, TypeError):
        return  # the writer refuses (e.g. a lone surrogate); then there is nothing to read back
    assert checked_json.loads(data, "f", 1 << 20) == obj


@pytest.mark.parametrize("raw, why", [
    (b"[" * 1000 + b"]" * 1000, "deep"),
    (b'{"a":' * 250 + b"1" + b"}" * 250, "deep"),
    (b'{"a":' + b"1" * 5000 + b"}", "number"),
    (b'{"a":1,"a":1}', "twice"),
    (b'{"\\ud800":1}', "surrogate"),
])
def test_bounded_parse_refuses(raw, why):
    with pytest.raises(CorruptCheckpointError, match=why):
        checked_json.parse(raw, "f.json", checked_json.JsonLimits(1 << 20))


def test_checked_loads_deep_nesting_no_recursion_error():
    """Nested ~1000 deep with a valid checksum: refused by the depth rule, never a RecursionError from
    the canonical re-serialisation."""
    body = b'{"x":' + b"[" * 990 + b"1" + b"]" * 990 + b"}"   # canonical form, built without recursion
    from recckpt import _C
    raw = body[:-1] + b',"crc32c":' + str(_C.crc32c(body)).encode() + b"}"
    with pytest.raises(CorruptCheckpointError, match="deep"):
        checked_json.loads(raw, "m.json", 1 << 20)
    deep: object = 1
    for _ in range(checked_json.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ValueError, match="deep"):
        checked_json.dumps({"x": deep})


def test_tree_encode_refuses_what_decode_would():
    deep: object = 1
    for _ in range(checked_json.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ValueError, match="deep"):
        tree_codec.encode(deep, "extras")


@settings(max_examples=max(1, settings.default.max_examples // 4))
@given(data=st.data())
def test_listing_survives_any_manifest(template, tmp_path_factory, data):
    """Listing an output directory never raises, whatever a (validly self-checksummed) manifest holds:
    the bad checkpoint is skipped and the good one stays listed."""
    out = tmp_path_factory.mktemp("list")
    good, bad = out / "a", out / "b"
    good.mkdir()
    bad.mkdir()
    (good / "manifest.json").write_bytes(checked_json.dumps(template["manifest"]))
    obj = _mutate(template["manifest"], data)
    try:
        raw = checked_json.dumps(obj)
    except ValueError:
        return   # not even writable (e.g. too deep): nothing to list
    (bad / "manifest.json").write_bytes(raw)
    ids = [i for i, _ in catalog.committed(open_storage(str(out)))]
    assert "a" in ids
