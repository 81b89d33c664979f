"""docs/FORMAT.md is a complete contract: checkpoints written by recckpt are read back and fully
verified by tests/spec/independent_reader.py, a pure-numpy reader written only from the spec."""
import collections
import math
import os
import shutil

import numpy as np
import pytest

from spec import independent_reader as R

torch = pytest.importorskip("torch", reason="the library under test needs torch")
recckpt = pytest.importorskip("recckpt", reason="recckpt (and its C++ extension) is not importable")
from helpers.hostile import flip_byte  # noqa: E402
from recckpt import HashTable, Saver, SparseAdam  # noqa: E402

I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1


# --------------------------------------------------------------------------- reader self-tests

def _crc_bitwise(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_crc32c_reference_values():
    assert R.crc32c(b"123456789") == 0xE3069283
    assert R.crc32c(b"") == 0
    assert R.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4 test vectors
    assert R.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert R.crc32c(bytes(range(32))) == 0x46DD794E
    rng = np.random.default_rng(0)
    for n in (1, 7, 255, 4095, 4096, 4097, 70001):
        d = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ref = _crc_bitwise(d)
        assert R.crc32c(d) == ref
        assert R.crc32c(np.frombuffer(d, np.uint8)) == ref
        k = n // 3
        assert R.crc32c(d[k:], R.crc32c(d[:k])) == ref
        for c in (1, 64, 100, 4096):
            assert R.crc32c_chunks(d, c) == [_crc_bitwise(d[j:j + c]) for j in range(0, n, c)]


def _mix64_ref(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_mix64_and_buckets():
    assert R.mix64(np.array([0], np.int64))[0] == 0xE220A8397B1DCDAF  # splitmix64(seed 0), 1st output
    ids = [0, 1, -1, 5, -5, I64_MAX, I64_MIN, 123456789012345]
    got = R.mix64(np.array(ids, np.int64))
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [_mix64_ref(i % (1 << 64)) for i in ids]
    assert [int(b) for b in R.bucket_of(np.array(ids, np.int64), 97)] == \
        [_mix64_ref(i % (1 << 64)) % 97 for i in ids]
    assert R.owner_range(0, 3, 64) == (0, 21) and R.owner_range(2, 3, 64) == (42, 64)


def test_checked_json_roundtrip(tmp_path):
    body = {"b": [1, {"z": "é\u2603\U0001F600", "a": None}], "a": True}
    p = tmp_path / "x.json"
    p.write_bytes(b'{ "crc32c": %d, "a": true,\n "b": [1, {"a": null, "z": "\\u00e9\xe2\x98\x83\\ud83d\\ude00"}]}'
                  % R.crc32c(R.canonical_json(body)))
    assert R.read_checked_json(str(p)) == body
    p.write_bytes(p.read_bytes().replace(b"true", b"false"))
    with pytest.raises(R.CorruptError, match="self-checksum"):
        R.read_checked_json(str(p))


# --------------------------------------------------------------------------------- helpers

class Model(torch.nn.Module):
    def __init__(self, item_dtype=torch.bfloat16):
        super().__init__()
        self.user = HashTable("user", dim=8)
        self.item = HashTable("item", dim=4, dtype=item_dtype)
        self.mlp = torch.nn.Linear(12, 1)


def _train_step(m, opt, user_ids, item_ids):
    u = m.user(torch.as_tensor(user_ids, dtype=torch.int64))
    i = m.item(torch.as_tensor(item_ids, dtype=torch.int64))
    n = min(u.shape[0], i.shape[0])
    x = torch.cat([u[:n].float(), i[:n].float()], dim=1)
    loss = (m.mlp(x) ** 2).sum() + u.float().pow(2).sum() + i.float().pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _options(**kw):
    kw.setdefault("num_buckets", 64)
    kw.setdefault("chunk_bytes", 256)
    kw.setdefault("fsync", False)
    return recckpt.SaveOptions(**kw)


def _np_of(t: "torch.Tensor") -> np.ndarray:
    """Exact numpy image of a tensor; bf16 as its raw uint16 bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _reader_np(a: np.ndarray, dtype_name: str) -> np.ndarray:
    return R.bf16_bits(a) if dtype_name == "BF16" else a


def _assert_table_equal(got: dict, table: HashTable, manifest: dict):
    ids = table.ids().numpy()
    assert got["ids"].dtype == np.int64
    assert sorted(got["ids"].tolist()) == sorted(ids.tolist())
    assert len(got["ids"]) == len(table)
    specs = dict((s, sp) for s, sp in manifest["tables"][table.name]["slots"])
    assert list(got["slots"]) == table.slot_names == list(specs)
    order_lib = np.argsort(ids, kind="stable")
    order_got = np.argsort(got["ids"], kind="stable")
    for s in table.slot_names:
        want = _np_of(table.slot(s))[order_lib]
        have = _reader_np(got["slots"][s], specs[s]["dtype"])[order_got]
        assert have.shape == want.shape, s
        assert have.dtype == want.dtype, s
        # bit-exact (also distinguishes -0.0 / NaN payloads)
        assert have.tobytes() == want.tobytes(), f"table {table.name!r} slot {s!r} differs"


def _dense_of(m):
    return {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def _build(tmp_path, n_user=4, n_item=100, seed=0, **saver_kw):
    torch.manual_seed(seed)
    m = Model()
    user_ids = [1, -5, I64_MAX, I64_MIN] + list(range(1000, 1000 + max(0, n_user - 4)))
    m.user(torch.tensor(user_ids[:n_user], dtype=torch.int64))
    m.item(torch.arange(n_item, dtype=torch.int64) * 7919 - 31)
    opt = SparseAdam(m, lr=0.1)
    # one step so the embedding and both Adam slots hold non-trivial values
    _train_step(m, opt, user_ids[:n_user][:50], (torch.arange(min(n_item, 50)) * 7919 - 31).tolist())
    kw = dict(max_keep=2, concurrency=2, options=_options())
    kw.update(saver_kw)
    saver = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), **kw)
    return m, opt, saver


# ----------------------------------------------------------------------------------- tests

def test_full_read_matches_model(tmp_path):
    m, opt, saver = _build(tmp_path)
    saver.register_for_checkpointing("step", {"global_step": 7})
    saver.save("ckpt_1")
    ck = R.read_checkpoint(str(tmp_path / "ckpt_1"))
    man = ck["manifest"]
    assert man["format"] == "recckpt" and man["format_version"] == 5 and man["ckpt_id"] == "ckpt_1"
    assert man["num_buckets"] == 64 and man["chunk_bytes"] == 256
    assert set(ck["tables"]) == {"user", "item"}
    assert man["tables"]["item"]["slots"][0][1]["dtype"] == "BF16"
    _assert_table_equal(ck["tables"]["user"], m.user, man)
    _assert_table_equal(ck["tables"]["item"], m.item, man)
    assert set(ck["tables"]["user"]["ids"].tolist()) >= {I64_MIN, I64_MAX, -5, 1}
    # adam slots really were compared (non-zero after the step)
    assert np.any(ck["tables"]["user"]["slots"]["adam.v"] != 0)
    # bf16="bits" returns the raw pattern directly
    bits = R.read_checkpoint(str(tmp_path / "ckpt_1"), bf16="bits")["tables"]["item"]["slots"]["embedding"]
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, R.bf16_bits(ck["tables"]["item"]["slots"]["embedding"]))

    dense = _dense_of(m)
    assert set(ck["dense"]) == set(dense)
    for k, v in dense.items():
        assert ck["dense"][k].tobytes() == _np_of(v).tobytes(), k
        assert ck["dense"][k].shape == tuple(v.shape)

    objs = ck["extras"]["objects"]
    assert objs["step"] == {"kind": "value", "state": {"global_step": 7}}
    assert ck["extras"]["sparse_optimizer"] is not None
    assert R.list_committed(str(tmp_path)) == ["ckpt_1"] == saver.checkpoints()


def _range_read_bound(d, table, lo, hi):
    """Bytes a bucket-range read needs at most (docs/FORMAT.md, what a loading rank reads): nothing of a
    segment outside the range; of the others, the bucket directory plus per column the exact rows
    widened by < 1 checksum step on each side."""
    ix = R.read_index(d)
    B = ix["raw"]["num_buckets"]
    total = 0
    for seg in ix["tables"][table]:
        if seg["last"] < lo or seg["first"] >= hi:
            continue
        b = R.segment_offsets(d, ix, seg, B)
        total += seg["buckets"]["length"]
        n = int(b[hi] - b[lo])
        for col in seg["columns"]:
            if n:
                rb = col["length"] // seg["rows"]
                total += min(col["length"], n * rb + 2 * (col["step"] - 1))
    return total


def test_bucket_ranges_partition_and_read_little(tmp_path):
    m, opt, saver = _build(tmp_path, n_user=3000, n_item=2000)
    saver.save("c")
    d = str(tmp_path / "c")
    full = R.read_checkpoint(d)
    B = full["manifest"]["num_buckets"]
    total = R.shard_bytes_total(d)
    W = 3
    for t, table in (("user", m.user), ("item", m.item)):
        seen = []
        for r in range(W):
            lo, hi = R.owner_range(r, W, B)
            part = R.read_bucket_range(d, t, lo, hi)
            assert set(R.bucket_of(part["ids"], B).tolist()) <= set(range(lo, hi))
            seen.extend(part["ids"].tolist())
            # same rows as the full read, row by row
            pos = {int(i): k for k, i in enumerate(full["tables"][t]["ids"])}
            idx = np.array([pos[int(i)] for i in part["ids"]], dtype=np.int64)
            for s, a in part["slots"].items():
                assert a.tobytes() == full["tables"][t]["slots"][s][idx].tobytes()
            assert part["bytes_read"] < 0.5 * total, (t, r, part["bytes_read"], total)
            assert part["bytes_read"] <= _range_read_bound(d, t, lo, hi), (t, r)
        assert sorted(seen) == sorted(table.ids().tolist())  # exact partition: no loss, no duplicate
    # an empty range reads only bucket blocks
    empty = R.read_bucket_range(d, "user", 5, 5)
    assert empty["ids"].size == 0 and empty["slots"]["embedding"].shape == (0, 8)


def test_many_segments_and_shard_files(tmp_path):
    m, opt, saver = _build(tmp_path, n_user=5000, n_item=3000, concurrency=3,
                           options=_options(segment_bytes=4096))
    saver.register_for_checkpointing("step", {"global_step": 7})
    saver.save("multi")
    d = str(tmp_path / "multi")
    ix = R.read_index(d)
    assert len(ix["files"]) >= 2, ix["files"]
    for t in ("user", "item"):
        assert len(ix["tables"][t]) > 1
    # Writer threads take segments from a shared queue, so which file holds which table's segments
    # depends on scheduling (one table in one file happened on a loaded machine); together they span files.
    assert len({s["file"] for t in ("user", "item") for s in ix["tables"][t]}) >= 2
    ck = R.read_checkpoint(d)
    _assert_table_equal(ck["tables"]["user"], m.user, ck["manifest"])
    _assert_table_equal(ck["tables"]["item"], m.item, ck["manifest"])
    seen = []
    for r in range(3):
        lo, hi = R.owner_range(r, 3, 64)
        seen.extend(R.read_bucket_range(d, "user", lo, hi)["ids"].tolist())
    assert sorted(seen) == sorted(m.user.ids().tolist())


def test_empty_table(tmp_path):
    torch.manual_seed(0)
    m = Model()
    m.user(torch.tensor([3, 4], dtype=torch.int64))  # item stays empty
    opt = SparseAdam(m, lr=0.1)
    saver = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), concurrency=2, options=_options())
    saver.save("e")
    ck = R.read_checkpoint(str(tmp_path / "e"))
    assert ck["manifest"]["tables"]["item"]["rows"] == 0
    item = ck["tables"]["item"]
    assert item["ids"].shape == (0,)
    assert set(item["slots"]) == {"embedding", "adam.m", "adam.v"}
    assert item["slots"]["embedding"].shape == (0, 4)
    _assert_table_equal(ck["tables"]["user"], m.user, ck["manifest"])
    for r in range(3):
        assert R.read_bucket_range(str(tmp_path / "e"), "item", *R.owner_range(r, 3, 64))["ids"].size == 0


def test_no_tables(tmp_path):
    lin = torch.nn.Linear(3, 2)
    saver = Saver(lin, output_dir=str(tmp_path), options=_options())
    saver.save("dense_only")
    ck = R.read_checkpoint(str(tmp_path / "dense_only"))
    assert ck["manifest"]["index"] is None and ck["tables"] == {}
    for k, v in lin.state_dict().items():
        assert ck["dense"][k].tobytes() == v.numpy().tobytes()


class _IO:
    def __init__(self, state):
        self.state = state

    def dump_io_state(self):
        return self.state

    def load_io_state(self, s):
        self.state = s


def test_two_workers_concatenated_index_and_io_state(tmp_path):
    models = []
    for w in range(2):
        torch.manual_seed(w)
        m = Model()
        m.user(torch.arange(w * 1000, w * 1000 + 300, dtype=torch.int64))
        m.item(torch.arange(w * 1000, w * 1000 + 120, dtype=torch.int64))
        opt = SparseAdam(m, lr=0.1)
        s = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), concurrency=2,
                  options=_options(segment_bytes=2048))
        s.register_io_state("reader", _IO({"offset": 100 + w, "files": ("a", w)}))
        models.append((m, s))
    for w, (m, s) in enumerate(models):
        s.save("two", shard_id=w, shard_num=2)
    d = str(tmp_path / "two")
    ck = R.read_checkpoint(d)  # also checks index.json == concatenation of the worker indexes
    assert ck["manifest"]["shard_num"] == 2
    for t in ("user", "item"):
        want = sorted(sum((getattr(m, t).ids().tolist() for m, _ in models), []))
        assert sorted(ck["tables"][t]["ids"].tolist()) == want
        for m, _ in models:
            table = getattr(m, t)
            pos = {int(i): k for k, i in enumerate(ck["tables"][t]["ids"])}
            idx = np.array([pos[int(i)] for i in table.ids()], dtype=np.int64)
            for s in table.slot_names:
                spec = dict(ck["manifest"]["tables"][t]["slots"])[s]
                have = _reader_np(ck["tables"][t]["slots"][s][idx], spec["dtype"])
                assert have.tobytes() == _np_of(table.slot(s)).tobytes()
    assert ck["io_state"] == {0: {"reader": {"offset": 100, "files": ("a", 0)}},
                              1: {"reader": {"offset": 101, "files": ("a", 1)}}}


def test_state_tree_encodings(tmp_path):
    lin = torch.nn.Linear(2, 2)
    saver = Saver(lin, output_dir=str(tmp_path), options=_options())
    value = {
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "nd": np.arange(4, dtype=np.int16),
        "tup": (1, "x", None, True),
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "f": 0.1,
        "big": 2 ** 70, "neg_big": -(2 ** 64), "u64": 2 ** 64 - 1,
        "bytes": b"\x00\xffab",
        "intkeys": {1: "one", (2, 3): "pair"},
        "__dunder": 1,
        "dtype": torch.float16,
        "np64": np.float64(2.5), "npi": np.int32(-3),
        "nested": [[], {}, ()],
        "counter": collections.Counter({2: 1, 4: 2}),
        "odict": collections.OrderedDict([("b", 1), ("a", 2)]),
    }
    saver.register_for_checkpointing("v", value)
    saver.register_for_checkpointing("opt", torch.optim.SGD(lin.parameters(), lr=0.5, momentum=0.9))
    saver.save("tree")
    ck = R.read_checkpoint(str(tmp_path / "tree"))
    got = ck["extras"]["objects"]["v"]
    assert got["kind"] == "value"
    g = got["state"]
    assert isinstance(g["t"], R.TensorValue) and g["t"].dtype == np.float32
    np.testing.assert_array_equal(g["t"], value["t"].numpy())
    assert isinstance(g["bf"], R.TensorValue)
    assert R.bf16_bits(g["bf"]).tolist() == _np_of(value["bf"]).tolist()
    assert type(g["nd"]) is np.ndarray and g["nd"].dtype == np.int16
    np.testing.assert_array_equal(g["nd"], value["nd"])
    assert g["tup"] == (1, "x", None, True) and isinstance(g["tup"], tuple)
    assert math.isnan(g["nan"]) and g["inf"] == math.inf and g["ninf"] == -math.inf and g["f"] == 0.1
    assert g["big"] == 2 ** 70 and g["neg_big"] == -(2 ** 64) and g["u64"] == 2 ** 64 - 1
    assert g["bytes"] == b"\x00\xffab"
    assert g["intkeys"] == {1: "one", (2, 3): "pair"}
    assert g["__dunder"] == 1
    assert isinstance(g["dtype"], R.DTypeName) and g["dtype"] == "F16"
    # np.float64 subclasses float: the writer stores it as a plain JSON number (read back as float)
    assert g["np64"] == 2.5
    assert isinstance(g["npi"], np.int32) and g["npi"] == -3
    assert g["nested"] == [[], {}, ()]
    assert type(g["counter"]) is collections.Counter and g["counter"] == collections.Counter({2: 1, 4: 2})
    assert type(g["odict"]) is collections.OrderedDict and list(g["odict"].items()) == [("b", 1), ("a", 2)]
    o = ck["extras"]["objects"]["opt"]
    assert o["kind"] == "state_dict"
    assert o["state"]["param_groups"][0]["lr"] == 0.5


def test_retention_and_listing(tmp_path):
    m, opt, saver = _build(tmp_path)
    for i in range(3):
        saver.save(f"s{i}")
    assert R.list_committed(str(tmp_path)) == ["s1", "s2"] == saver.checkpoints()
    # the version file is advisory: without it, directories are listed
    os.remove(tmp_path / "checkpoint")
    assert R.list_committed(str(tmp_path)) == ["s1", "s2"]
    # a directory without a verifying manifest is not committed
    shutil.copytree(tmp_path / "s2", tmp_path / "s3")
    mp = tmp_path / "s3" / "manifest.json"
    mp.write_bytes(mp.read_bytes().replace(b'"s2"', b'"s3"'))
    assert R.list_committed(str(tmp_path)) == ["s1", "s2"]
    os.remove(mp)
    assert R.list_committed(str(tmp_path)) == ["s1", "s2"]
    with pytest.raises(R.NotFoundError):
        R.read_checkpoint(str(tmp_path / "s3"))


def test_manifest_may_be_reformatted(tmp_path):
    m, opt, saver = _build(tmp_path)
    saver.save("c")
    mp = tmp_path / "c" / "manifest.json"
    import json
    obj = json.loads(mp.read_bytes())
    mp.write_text(json.dumps(obj, indent=7, sort_keys=False))  # "may be formatted any way"
    R.read_checkpoint(str(tmp_path / "c"))
    obj["metadata"] = {"k": "v"}  # changes the content -> self-checksum fails
    mp.write_text(json.dumps(obj))
    with pytest.raises(R.CorruptError, match="self-checksum"):
        R.read_checkpoint(str(tmp_path / "c"))


def _segment_offsets(d):
    ix = R.read_index(d)
    seg = ix["tables"]["user"][0]
    path = os.path.join(d, ix["files"][seg["file"]][0])
    return path, seg


@pytest.mark.parametrize("where", ["buckets", "ids", "embedding", "adam.v_last_byte"])
def test_flipped_shard_byte_is_detected(tmp_path, where):
    m, opt, saver = _build(tmp_path, n_user=200)
    saver.save("c")
    d = str(tmp_path / "c")
    R.read_checkpoint(d)  # clean first
    path, seg = _segment_offsets(d)
    if where == "buckets":
        off = seg["buckets"]["offset"] + seg["buckets"]["length"] // 2
    elif where == "ids":
        off = seg["columns"][0]["offset"] + 3
    elif where == "embedding":
        off = seg["columns"][1]["offset"] + seg["columns"][1]["length"] // 2
    else:
        off = seg["columns"][3]["offset"] + seg["columns"][3]["length"] - 1
    flip_byte(path, off)
    with pytest.raises(R.CorruptError, match="CRC mismatch"):
        R.read_checkpoint(d)
    # the ranged reader also verifies what it reads: the full range covers the flipped byte
    with pytest.raises(R.CorruptError, match="CRC mismatch"):
        R.read_bucket_range(d, "user", 0, 64)


def test_truncated_or_grown_shard_is_detected(tmp_path):
    m, opt, saver = _build(tmp_path)
    saver.save("c")
    d = str(tmp_path / "c")
    path, _ = _segment_offsets(d)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(R.CorruptError, match="bytes, index says"):
        R.read_checkpoint(d)


@pytest.mark.parametrize("rel", ["dense.safetensors", "extras.safetensors"])
def test_flipped_covered_file_is_detected(tmp_path, rel):
    m, opt, saver = _build(tmp_path)
    saver.register_for_checkpointing("step", {"global_step": 7})
    saver.save("c")
    p = tmp_path / "c" / rel
    flip_byte(p, os.path.getsize(p) - 1)
    with pytest.raises(R.CorruptError, match="CRC mismatch"):
        R.read_checkpoint(str(tmp_path / "c"))


def test_unknown_format_version_is_incompatible(tmp_path):
    m, opt, saver = _build(tmp_path)
    saver.save("c")
    mp = tmp_path / "c" / "manifest.json"
    import json
    obj = json.loads(mp.read_bytes())
    obj.pop("crc32c")
    obj["format_version"] = 6
    obj["crc32c"] = R.crc32c(R.canonical_json(obj))
    mp.write_text(json.dumps(obj))
    with pytest.raises(R.IncompatibleError):
        R.read_checkpoint(str(tmp_path / "c"))


# ------------------------------------------- semantic checks run (CRCs re-computed after tampering)

def _write_checked(path, body):
    import json
    obj = dict(body)
    obj["crc32c"] = R.crc32c(R.canonical_json(body))
    data = json.dumps(obj, sort_keys=True).encode("ascii")
    with open(path, "wb") as f:
        f.write(data)
    return data


def _resign(d, index_body, also_worker=True):
    """Write a modified index.json (and the single worker index), fix the manifest's file entries. A
    version 4 index has no self-checksum: the manifest's entry is its checksum."""
    import json
    man = R.read_checked_json(os.path.join(d, "manifest.json"))
    rels = ["index.json"] + (["sparse/worker-00000.index.json"] if also_worker else [])
    for rel in rels:
        if index_body["format_version"] >= 4:
            data = json.dumps(index_body, sort_keys=True).encode("ascii")
            with open(os.path.join(d, rel), "wb") as f:
                f.write(data)
        else:
            data = _write_checked(os.path.join(d, rel), index_body)
        man["files"][rel] = {"size": len(data), "crc32c": R.crc32c(data)}
    _write_checked(os.path.join(d, "manifest.json"), man)


def _recrc(d, raw_ix, table):
    """Recompute every CRC of `table`'s segments from the shard bytes (as an attacker would), into the
    version 4 index body `raw_ix`; positions come from the reader's normalised view of that body."""
    man, mv = R.read_manifest(d)
    norm = R.validate_index(raw_ix, "index.json", mv, man, None)
    hexes = []
    for seg in norm["tables"][table]:
        data = open(os.path.join(d, norm["files"][seg["file"]][0]), "rb").read()
        bk = seg["buckets"]
        crcs = [R.crc32c(data[bk["offset"]:bk["offset"] + bk["length"]])]
        for col in seg["columns"]:
            crcs += R.crc32c_chunks(data[col["offset"]:col["offset"] + col["length"]], col["step"])
        hexes.append("".join(f"{c:08x}" for c in crcs))
    raw_ix["tables"][table]["segments"]["crc32c"] = "".join(hexes)


def _saved(tmp_path, n_user=300):
    import json
    m, opt, saver = _build(tmp_path, n_user=n_user)
    saver.save("c")
    d = str(tmp_path / "c")
    R.read_checkpoint(d)
    raw = json.loads(open(os.path.join(d, "index.json"), "rb").read())
    seg = R.read_index(d)["tables"]["user"][0]
    return d, raw, seg, os.path.join(d, raw["files"][seg["file"]]["path"])


def test_resigned_but_unsorted_ids_are_detected(tmp_path):
    d, ix, seg, path = _saved(tmp_path)
    col = seg["columns"][0]
    raw = bytearray(open(path, "rb").read())
    ids = np.frombuffer(bytes(raw[col["offset"]:col["offset"] + col["length"]]), "<i8").copy()
    assert R.bucket_of(ids[:1], 64)[0] != R.bucket_of(ids[-1:], 64)[0]
    ids[[0, -1]] = ids[[-1, 0]]
    raw[col["offset"]:col["offset"] + col["length"]] = ids.tobytes()
    open(path, "wb").write(bytes(raw))
    _recrc(d, ix, "user")
    _resign(d, ix)
    with pytest.raises(R.CorruptError, match="has bucket"):
        R.read_checkpoint(d)
    with pytest.raises(R.CorruptError, match="has bucket"):
        R.read_bucket_range(d, "user", 0, 64)


def test_resigned_bad_bucket_directory_is_detected(tmp_path):
    d, ix, seg, path = _saved(tmp_path)
    bk = seg["buckets"]
    raw = bytearray(open(path, "rb").read())
    k = seg["dir"]
    dirs = np.frombuffer(bytes(raw[bk["offset"]:bk["offset"] + bk["length"]]), "<u4").copy()
    assert k >= 3
    dirs[k + 1], dirs[k + 2] = dirs[k + 2], dirs[k + 1]   # row starts no longer increasing
    raw[bk["offset"]:bk["offset"] + bk["length"]] = dirs.tobytes()
    open(path, "wb").write(bytes(raw))
    _recrc(d, ix, "user")
    _resign(d, ix)
    with pytest.raises(R.CorruptError, match="not a partition"):
        R.read_checkpoint(d)


def test_resigned_merged_index_must_match_worker_index(tmp_path):
    d, ix, seg, path = _saved(tmp_path, n_user=5)
    ix["files"].append({"path": "sparse/shard-00000-009.bin", "size": 0})
    open(os.path.join(d, "sparse/shard-00000-009.bin"), "wb").close()
    _resign(d, ix, also_worker=False)  # a valid index on its own, but not the concatenation of the workers'
    with pytest.raises(R.CorruptError, match="concatenation"):
        R.read_checkpoint(d)


def test_resigned_row_count_mismatch_is_detected(tmp_path):
    d, ix, seg, path = _saved(tmp_path)
    man = R.read_checked_json(os.path.join(d, "manifest.json"))
    man["tables"]["user"]["rows"] += 1
    _write_checked(os.path.join(d, "manifest.json"), man)
    with pytest.raises(R.CorruptError, match="manifest says"):
        R.read_checkpoint(d)


def test_old_format_fixtures_read_exactly(tmp_path):
    """tests/fixtures (versions 1, 2, 3 and a version 3 chain) read by the independent reader."""
    import shutil
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
    shutil.copytree(src, tmp_path / "f")
    ids = np.arange(40, dtype=np.int64) * 7919 - 100_000
    emb = (ids[:, None] % 1000).astype(np.float32) / 8 + np.arange(4, dtype=np.float32)
    for rel, version in (("v1/ckpt", 1), ("v2/ckpt", 2), ("v3/out/base", 3)):
        ck = R.read_checkpoint(str(tmp_path / "f" / rel))
        assert ck["manifest"]["format_version"] == version
        t = ck["tables"]["user"]
        o = np.argsort(t["ids"])
        np.testing.assert_array_equal(t["ids"][o], ids)
        np.testing.assert_array_equal(t["slots"]["embedding"][o], emb)
    chain = R.read_chain(str(tmp_path / "f" / "v3" / "out"), "inc")
    assert chain["links"] == ["base", "inc"] and len(chain["tables"]["user"]["ids"]) == 40


def test_unlisted_file_in_checkpoint_is_rejected(tmp_path):
    d, ix, seg, path = _saved(tmp_path, n_user=5)
    open(os.path.join(d, "sparse", "stray.bin"), "wb").close()
    with pytest.raises(R.CorruptError, match="listed nowhere"):
        R.read_checkpoint(d)


# ------------------------------------------------------------------------------ incremental chains

def _chain_model():
    m = torch.nn.Module()
    m.emb = HashTable("emb", 4)
    opt = SparseAdam([m.emb], lr=0.1)
    return m, opt


def _step(m, opt, ids):
    m.emb(torch.tensor(ids, dtype=torch.int64)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_chain_read_by_the_independent_reader_equals_the_model(tmp_path):
    m, opt = _chain_model()
    saver = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), max_keep=None, options=_options())
    _step(m, opt, list(range(-50, 50)) + [I64_MIN, I64_MAX])
    saver.save("c0")
    for k in range(1, 4):
        _step(m, opt, list(range(30 * k, 30 * k + 40)))
        m.emb.remove_ids(torch.tensor([k, -k, I64_MIN if k == 2 else 7]))
        saver.save(f"c{k}", incremental=True)
    newest = R.read_checkpoint(str(tmp_path / "c3"))
    assert newest["manifest"]["parent"]["ckpt_id"] == "c2"
    # 7 left the table in c1 already: only ids present at c2 count as removed in c3
    assert newest["tables"]["emb"]["changes"] and sorted(newest["tables"]["emb"]["removed"].tolist()) == [-3, 3]
    ck = R.read_chain(str(tmp_path), "c3")
    assert ck["links"] == ["c0", "c1", "c2", "c3"]
    _assert_table_equal(ck["tables"]["emb"], m.emb, ck["newest"]["manifest"])


def test_independent_reader_refuses_an_altered_link(tmp_path):
    import json
    m, opt = _chain_model()
    saver = Saver(m, sparse_optim=opt, output_dir=str(tmp_path), max_keep=None, options=_options())
    _step(m, opt, list(range(20)))
    saver.save("c0")
    _step(m, opt, list(range(5)))
    saver.save("c1", incremental=True)
    mp = tmp_path / "c0" / "manifest.json"
    obj = json.loads(mp.read_bytes())
    obj.pop("crc32c")
    obj["metadata"]["note"] = "changed"
    obj["crc32c"] = R.crc32c(R.canonical_json(obj))
    mp.write_text(json.dumps(obj))
    R.read_checkpoint(str(tmp_path / "c0"))          # still a valid checkpoint on its own
    with pytest.raises(R.CorruptError, match="SHA-256"):
        R.read_chain(str(tmp_path), "c1")
