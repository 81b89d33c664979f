"""The metadata of many tables read in a few passes (issue 26 item 3), with the same answers as the
per-table rules: a version 4 index validated for all tables at once (index_parse._segs_v4_all), the JSON
rules checked on the text by the engine (checked_json), a compact checked file's CRC taken from its bytes."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from recckpt import _C, HashTable, SaveOptions, Saver, SparseAdam
from recckpt.errors import CorruptCheckpointError
from recckpt.format import checked_json, index_parse, manifest_parse, names
from recckpt.format.checkpoint import CheckpointReader, parse_index_bytes
from recckpt.format.field_checks import Fields
from recckpt.format.index_parse import _phase1_by_table, _segments_from, index_from_json
from recckpt.format.schema import IndexDoc
from recckpt.storage import open_storage


def _checkpoint(tmp_path, tables=12, incremental=False):
    m = torch.nn.Module()
    for t in range(tables):
        m.add_module(f"t{t}", HashTable(f"t{t}", dim=4 + t % 3))   # three slot shapes
    SparseAdam(m, lr=0.1)
    with torch.no_grad():
        for t, tab in enumerate(m.children()):
            if t % 5:
                tab(torch.arange(1 + 37 * t) * 13 - 50)
    out = str(tmp_path / "out")
    saver = Saver(m, output_dir=out, options=SaveOptions(fsync=False, segment_bytes=4096))
    saver.save("a")
    if not incremental:
        return out, "a"
    with torch.no_grad():
        m.t1(torch.arange(5) + 10_000)
    m.t2.remove_ids(m.t2.ids()[::2].clone())   # an increment records removed ids
    saver.save("b", incremental=True)
    return out, "b"


def _read(out, ckpt):
    r = CheckpointReader(open_storage(out), ckpt)
    obj = parse_index_bytes(r.read_file(r.manifest.index), "index.json", r.manifest.format_version)
    return r.manifest, obj


def _keys(doc):
    return ({k: (s, [x.key() for x in segs]) for k, (s, segs) in doc.tables.items()},
            {k: [x.key() for x in segs] for k, segs in doc.removed.items()}, sorted(doc.blocked), doc.files,
            {k: doc.geometry_of(k) for k in doc.tables})


def _by_table(m, obj):
    """The index as the per-table functions build it (the reference)."""
    v = Fields("index.json")
    doc = IndexDoc(obj["num_buckets"], obj["chunk_bytes"], format_version=obj["format_version"])
    doc.files = [(f["path"], f["size"]) for f in obj["files"]]
    for name, slots, segs, removed, blocked in _phase1_by_table(v, obj["tables"], doc, m, False):
        doc.tables[name] = (slots, _segments_from(v, doc, segs))
        if removed is not None:
            doc.removed[name] = _segments_from(v, doc, removed)
        if blocked:
            doc.blocked.add(name)
    return doc


@pytest.mark.parametrize("incremental", [False, True])
def test_batched_index_equals_the_per_table_reading(tmp_path, incremental):
    m, obj = _read(*_checkpoint(tmp_path, incremental=incremental))
    if incremental:   # removed-id segments beside changed rows
        assert any(len(t.get("removed", {}).get("file", [])) for t in obj["tables"].values())
    else:             # tables of several segments
        assert sum(len(t["segments"]["file"]) for t in obj["tables"].values()) > len(obj["tables"])
    got = index_from_json(copy.deepcopy(obj), "index.json", m)
    assert _keys(got) == _keys(_by_table(m, obj))


def test_batched_phase1_declines_anything_out_of_order(tmp_path):
    m, obj = _read(*_checkpoint(tmp_path))
    doc = IndexDoc(obj["num_buckets"], obj["chunk_bytes"], format_version=obj["format_version"])
    doc.files = [(f["path"], f["size"]) for f in obj["files"]]

    def items(o):
        out = []
        for name, t in o["tables"].items():
            info = m.tables[name]
            geo = info.geometry(doc.format_version)
            out.append(index_parse._SegsInput(name, t["segments"], [geo.widths(0)], [geo.begins_slot(0)], True, False))
        return out
    assert index_parse._segs_v4_all(items(obj), doc) is not None
    for key, value in [("rows", 0), ("first", 5000), ("dir", 10**6), ("packed", 2), ("file", 7), ("offset", -1),
                       ("rows", True), ("offset", 1.5), ("rows", 1 << 64), ("block", 0)]:
        bad = copy.deepcopy(obj)
        segs = bad["tables"]["t3"]["segments"]
        if key in segs:
            segs[key][-1] = value
        else:
            segs[key] = [value] * len(segs["file"])
        assert index_parse._segs_v4_all(items(bad), doc) is None, key


@pytest.mark.parametrize("field,value,words", [
    ("rows", 0, "segments.rows[0]: expected 1 <= rows < 2**32"),
    ("crc32c", "zz", "segments.crc32c: expected"),
    ("last", 4096, "segments.first[0]: expected 0 <= first <= last < B"),
])
def test_a_bad_table_is_named_as_the_per_table_rules_name_it(tmp_path, field, value, words):
    m, obj = _read(*_checkpoint(tmp_path))
    segs = obj["tables"]["t7"]["segments"]
    if isinstance(segs[field], list):
        segs[field][0] = value
    else:
        segs[field] = value
    with pytest.raises(CorruptCheckpointError) as e:
        index_from_json(obj, "index.json", m)
    assert "tables['t7']" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("text,ok", [
    (b'{"a":[1,2,{"b":"x"}]}', True),
    (b'{"a":"\\ud83d\\ude00"}', True),          # a surrogate pair is one character
    (b'{"a":"\\ud800"}', False),                  # a high surrogate alone
    (b'{"a":"\\udc00x"}', False),                 # a low surrogate alone
    (b'{"a":"\\ud800\\u0041"}', False),           # a high one followed by something else
    (b'{"a":"\\\\ud800"}', True),                 # an escaped backslash, then the letters "ud800"
    (b'[' * 3 + b']' * 3, True),
    (b'[' * 4 + b']' * 4, False),                 # deeper than 3
    (b'{"a":"[[[[[["}', True),                    # brackets inside a string do not nest
    (b'[' + b'9' * 40 + b']', True),
    (b'[-' + b'9' * 41 + b']', False),            # 41 digits
    (b'["' + b'9' * 60 + b'"]', True),            # digits inside a string are text
    ('["é"]'.encode(), False),                    # raw non-ASCII text: the walk looks at it
])
def test_engine_text_rules_are_conservative(text, ok):
    assert _C.json_follows_rules(text, 3, 40) is ok
    if not ok and b"9" * 41 not in text and b"[[[[" not in text:
        # where the engine says "look closer", the walk decides: valid text still parses
        try:
            checked_json.parse(text, "f", checked_json.JsonLimits(1 << 20, max_depth=3))
        except CorruptCheckpointError as e:
            assert "lone surrogate" in str(e)


@pytest.mark.parametrize("text,why", [
    (b'{"a":"\\ud800"}', "lone surrogate"),
    (b'[[[[[1]]]]]', "nested more than 3 deep"),
    (b'[' + b'1' * 41 + b']', "more than 40 digits"),
])
def test_parse_still_refuses_with_the_same_words(text, why):
    with pytest.raises(CorruptCheckpointError, match=why):
        checked_json.parse(text, "f", checked_json.JsonLimits(1 << 20, max_depth=3))


@pytest.mark.parametrize("text,verdict", [
    (b'{"a":1,"b":{"a":2},"c":[{"a":3},{"a":4}]}', "follows"),  # one key per object, names reused apart
    (b'{"a":"b","b":"a"}', "follows"),                         # values are not keys
    (b'{"a":1,"b":2,"a":3}', "keys"),                          # twice in one object, not next to each other
    (b'[{"x":{"k":1,"k":2}}]', "keys"),                        # twice in a nested object
    (b'{"\\u0061":1,"a":2}', "keys"),                          # an escaped key is not compared raw
    (b'{"a":1,"b":2}}]', "keys"),                              # more closing than opening: not JSON
    (b'{"a":[[[[1]]]],"a":2}', "closer"),                      # the depth rule first
])
def test_engine_verdict_on_keys(text, verdict):
    want = {"follows": _C.JSON_FOLLOWS, "keys": _C.JSON_KEYS_UNKNOWN, "closer": _C.JSON_LOOK_CLOSER}[verdict]
    assert _C.json_rules_verdict(text, 3, 40) == want


@pytest.mark.parametrize("text", [b'{"a":1,"b":2,"a":3}', b'{"t":{"x":{"k":1,"k":2}}}', b'{"\\u0061":1,"a":2}',
                                  b'{"a":1,"b":[{"\\u00e9":1,"\\u00e9":2}]}'])
def test_a_key_twice_is_refused_whether_or_not_the_engine_saw_it(text):
    with pytest.raises(CorruptCheckpointError, match="appears twice in one object"):
        checked_json.parse(text, "f.json", checked_json.JsonLimits(1 << 20))


def test_keys_past_the_engines_bound_are_left_to_the_decoder():
    # more keys open at once than the engine is allowed to hold: it does not claim they are unique
    text = ("{" + ",".join(f'"k{i}":{{"a":0,"b":1}}' for i in range(50)) + "}").encode()
    assert _C.json_rules_verdict(text, 3, 40) == _C.JSON_FOLLOWS
    # the last inner object's two keys are open beside the outer object's 50
    assert _C.json_rules_verdict(text, 3, 40, max_open_keys=52) == _C.JSON_FOLLOWS
    assert _C.json_rules_verdict(text, 3, 40, max_open_keys=51) == _C.JSON_KEYS_UNKNOWN
    assert _C.json_rules_verdict(b'{"a":{"b":1,"c":2},"d":3}', 3, 40, max_open_keys=2) == _C.JSON_KEYS_UNKNOWN


def test_the_key_pass_holds_bounded_memory_on_hostile_brackets():
    # unmatched closers, then openers: once the keys are unknown the pass holds nothing (a review found
    # 16 bytes kept per bracket: 255 MiB for this 32 MiB text); measured in a fresh process
    code = ("import resource\nfrom recckpt import _C\nfrom recckpt.format.checked_json import parse, JsonLimits\n"
            "from recckpt.errors import CorruptCheckpointError\n"
            "n = 16 << 20\ndata = b']' * n + b'[' * n\nr0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "v = _C.json_rules_verdict(data, 1 << 40, 40)\n"
            "try:\n    parse(data, 'index.json', JsonLimits(1 << 30, max_depth=200))\nexcept CorruptCheckpointError:\n    pass\n"
            "print(v, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) >> 10)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    verdict, grew_mib = map(int, out.stdout.split())
    assert verdict == _C.JSON_KEYS_UNKNOWN
    assert grew_mib < 16, f"the pass and parse of a 32 MiB text grew the process by {grew_mib} MiB"


def test_compact_checked_file_crc_from_its_bytes_and_any_flip_refused():
    obj = {"tables": {f"t{i}": {"rows": i, "name": "x" * 20} for i in range(3000)}, "files": {"a": {"crc32c": 5}}}
    data = checked_json.dumps(obj)
    assert len(data) > checked_json.INDENT_BELOW and b"\n" not in data   # written compact
    want = json.loads(data)
    assert checked_json._crc_of_compact(data, want["crc32c"]) == want["crc32c"]
    assert checked_json.loads(data, "m", 1 << 30) == obj
    small = checked_json.dumps({"a": 1})   # indented: checked against its canonical form
    assert checked_json._crc_of_compact(small, json.loads(small)["crc32c"]) != json.loads(small)["crc32c"]
    assert checked_json.loads(small, "m", 1 << 20) == {"a": 1}
    for pos in (10, len(data) // 2, len(data) - 10):
        flipped = bytearray(data)
        flipped[pos] = ord("7") if flipped[pos] != ord("7") else ord("8")
        with pytest.raises(CorruptCheckpointError):
            checked_json.loads(bytes(flipped), "m", 1 << 30)


def test_a_manifest_round_trips_through_the_fast_checks(tmp_path):
    out, ckpt = _checkpoint(tmp_path)
    data = open(os.path.join(out, ckpt, names.MANIFEST), "rb").read()
    parsed = checked_json.loads(data, "m", names.MAX_MANIFEST_BYTES)
    assert _C.json_follows_rules(data, checked_json.MAX_DEPTH, checked_json.MAX_NUMBER_CHARS)
    assert parsed["ckpt_id"] == ckpt and len(parsed["tables"]) == 12


def _manifest_obj(tmp_path, incremental=False):
    out, ckpt = _checkpoint(tmp_path, incremental=incremental)
    data = open(os.path.join(out, ckpt, names.MANIFEST), "rb").read()
    return checked_json.loads(data, "manifest.json", names.MAX_MANIFEST_BYTES)


@pytest.mark.parametrize("incremental", [False, True])
def test_manifest_tables_and_digests_read_as_the_rules_read_them(tmp_path, incremental):
    from recckpt.format.manifest_parse import _digests_from_json, _table_from_json, manifest_from_json
    obj = _manifest_obj(tmp_path, incremental)
    m = manifest_from_json(copy.deepcopy(obj), "manifest.json")
    v = Fields("manifest.json")
    want = {n: _table_from_json(v, n, t, m.format_version) for n, t in obj["tables"].items()}
    assert m.tables == want
    assert all(manifest_parse._table_info_fast(n, t, m.format_version, manifest_parse._SlotLayouts()) is not None
               for n, t in obj["tables"].items())   # the fast path read them
    if not incremental:
        assert manifest_parse._table_digests_fast(obj["digests"]["tables"], m.tables) is not None
    slow = _digests_from_json(v, dict(obj["digests"]), want)
    assert m.digests.to_json() == slow.to_json()


@pytest.mark.parametrize("edit,words", [
    (lambda t: t["slots"][1][1].update(dtype="F99"), "tables['t4'].adam.m.dtype: unknown dtype"),
    (lambda t: t["slots"][0][1].update(shape=[4, -1]), "tables['t4'].embedding.shape"),
    (lambda t: t.update(rows=-3), "tables['t4'].rows"),
    (lambda t: t.update(removed=2), "tables['t4'].removed: removed ids in a table that is not saved as changes"),
    (lambda t: t.update(bucket_fn="row_range"), "tables['t4'].num_rows: missing"),
    (lambda t: t["slots"].append(t["slots"][0]), "slot 'embedding' listed twice"),
])
def test_a_bad_manifest_table_is_worded_by_the_rules(tmp_path, edit, words):
    from recckpt.format.manifest_parse import manifest_from_json
    obj = _manifest_obj(tmp_path)
    edit(obj["tables"]["t4"])
    with pytest.raises(CorruptCheckpointError, match=re_escape(words)):
        manifest_from_json(obj, "manifest.json")


def test_a_bad_digest_is_worded_by_the_rules(tmp_path):
    from recckpt.format.manifest_parse import manifest_from_json
    obj = _manifest_obj(tmp_path)
    obj["digests"]["tables"]["t6"]["slots"]["adam.v"] = "A" * 32
    with pytest.raises(CorruptCheckpointError, match=re_escape("digests.tables['t6'].slots['adam.v']")):
        manifest_from_json(obj, "manifest.json")
    obj = _manifest_obj(tmp_path / "again")
    obj["digests"]["tables"]["t6"]["rows"] += 1
    with pytest.raises(CorruptCheckpointError, match=re_escape("digests.tables['t6'].rows")):
        manifest_from_json(obj, "manifest.json")


def re_escape(s):
    import re
    return re.escape(s)



def _v5_checkpoint(tmp_path):
    from helpers.fake_tables import FixedRows
    m = torch.nn.Module()
    for t in range(6):
        m.add_module(f"t{t}", HashTable(f"t{t}", dim=4 + t % 3))
    m.add_module("f0", FixedRows("f0", n=3000, d=12))
    m.add_module("f1", FixedRows("f1", n=700, d=8))
    with torch.no_grad():
        for t in range(6):
            getattr(m, f"t{t}")(torch.arange(1 + 37 * t) * 13 - 50)
    out = str(tmp_path / "out")
    Saver(m, output_dir=out, options=SaveOptions(fsync=False, segment_bytes=16384)).save("a")
    return _read(out, "a")


def test_a_version_5_index_batches_row_runs_and_column_groups_with_the_hash_tables(tmp_path, monkeypatch):
    """Format version 5: fixed-size (row_range) tables' segments are row runs (id0, no ids, no directory) of
    column groups. They are checked in the same batched pass as the hash tables (a model of hundreds of
    TorchRec tables parsed them one by one, a millisecond and a half each), and the index read equals the
    per-table reading (row runs, groups and geometry included)."""
    man, obj = _v5_checkpoint(tmp_path)
    assert obj["format_version"] == 5 and "id0" in obj["tables"]["f0"]["segments"]
    batched = []
    real = index_parse._segs_v4_all
    monkeypatch.setattr(index_parse, "_segs_v4_all", lambda items, doc: batched.append([i.where for i in items])
                        or real(items, doc))
    from_text = []
    real_segments = index_parse._segments_from
    monkeypatch.setattr(index_parse, "_segments_from", lambda *a: from_text.append(a) or real_segments(*a))
    got = index_from_json(copy.deepcopy(obj), "index.json", man)
    assert len(batched) == 1 and len(batched[0]) == 8 and any("'f1'" in w for w in batched[0])
    assert not from_text   # phase 2 at once too
    assert _keys(got) == _keys(_by_table(man, obj))
    segs = got.tables["f0"][1]
    assert all(s.is_run for s in segs) and len(segs) > 1 and got.geometry_of("f0").grouped


_I63 = (1 << 63) - 1


@pytest.mark.parametrize("edit,words", [
    (lambda s: s["id0"].__setitem__(-1, 699), r"id0\[\d+\]: the row run passes the table's 700 rows"),
    # id0 + rows wraps in int64: still past the table's rows
    (lambda s: s["id0"].__setitem__(-1, _I63 - 5), r"id0\[\d+\]: the row run passes the table's 700 rows"),
    # not a run (id0 < 0) yet holding no directory: the first rule it breaks is the directory's
    (lambda s: s["id0"].__setitem__(-2, -2), r"dir\[\d+\]: expected 1 <= dir <= min\(rows, B\)"),
    (lambda s: s["dir"].__setitem__(0, 1), r"dir\[0\]: a row run \(id0 >= 0\) has no directory"),
    (lambda s: [s[k].__setitem__(1, s[k][0]) for k in ("id0", "rows", "first", "last")],
     r"id0\[1\]: row runs of one column block overlap"),
    (lambda s: s["last"].__setitem__(0, s["last"][0] + 1), r"first\[0\]: a row run's first and last buckets"),
])
def test_a_bad_row_run_is_declined_by_the_batch_and_worded_by_the_rules(tmp_path, monkeypatch, edit, words):
    man, obj = _v5_checkpoint(tmp_path)
    segs = obj["tables"]["f1"]["segments"]
    assert len(segs["id0"]) >= 2 and min(segs["id0"]) >= 0
    edit(segs)
    answers = []
    real = index_parse._segs_v4_all
    monkeypatch.setattr(index_parse, "_segs_v4_all", lambda items, doc: answers.append(real(items, doc)) or answers[-1])
    with pytest.raises(CorruptCheckpointError, match=r"tables\['f1'\]\.segments\." + words):
        index_from_json(obj, "index.json", man)
    assert answers == [None]
