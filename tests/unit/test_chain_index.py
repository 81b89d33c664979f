"""A chain's link indexes validated together (recckpt.format.chain_index): the same indexes as each link
validated alone, in one validation pass, and a link whose index is wrong in a way only the merge could
hide is still refused with its own message, naming it."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from helpers import hostile
from recckpt import HashTable, SaveOptions, Saver
from recckpt.errors import CorruptCheckpointError
from recckpt.format import chain_index, index_parse
from recckpt.format.chain import open_chain, walk_chain
from recckpt.format.checkpoint import CheckpointReader
from recckpt.storage import open_storage

# several shard files per link (file positions > 0 to re-point) and two segments per file
OPTS = SaveOptions(num_buckets=32, chunk_bytes=512, segment_bytes=2048, fsync=False)
LINKS = 6


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = HashTable("a", 4)
        self.b = HashTable("b", 2)


def build(out: str) -> Model:
    gen = torch.Generator().manual_seed(0)
    m = Model()
    with torch.no_grad():
        m.a(torch.arange(400))
        m.b(torch.arange(100))
    s = Saver(m, output_dir=out, max_keep=None, options=OPTS)
    s.save("base")
    for i in range(1, LINKS + 1):
        rows = torch.randperm(400, generator=gen)[:300]
        m.a.write_rows("embedding", rows, torch.randn(300, 4, generator=gen))
        m.b.remove_ids(torch.tensor([i, 50 + i]))   # removed ids in every increment
        s.save(f"i{i}", incremental=True)
    return m


def _reader(out, ckpt):
    return CheckpointReader(open_storage(out), ckpt)


def _key(doc):
    return (doc.format_version, doc.num_buckets, doc.chunk_bytes, doc.files, sorted(doc.blocked),
            {n: (slots, [s.key() for s in segs]) for n, (slots, segs) in doc.tables.items()},
            {n: [s.key() for s in segs] for n, segs in doc.removed.items()})


def test_links_validated_together_get_the_indexes_each_gets_alone(tmp_path, monkeypatch):
    out = str(tmp_path)
    build(out)
    calls = []
    real = chain_index.index_from_json
    monkeypatch.setattr(chain_index, "index_from_json", lambda *a, **k: calls.append(1) or real(*a, **k))
    links = walk_chain(_reader(out, f"i{LINKS}"))
    chain_index.parse_indexes(links)
    assert len(calls) == 1                           # the six increments in one pass (the base alone later)
    assert not links[0].index_parsed and all(link.index_parsed for link in links[1:])
    for link in links[1:]:
        alone = _reader(out, link.manifest.ckpt_id).parsed_index()
        assert any(seg.file > 0 for seg in alone.tables["a"][1]) and alone.removed["b"]
        assert _key(link.parsed_index()) == _key(alone)
    assert all(link.segments for link in open_chain(_reader(out, f"i{LINKS}")))


def _repin(out: str, k: int) -> None:
    """After link i<k>'s manifest changed: record each later link's parent hash anew, up to the newest."""
    for j in range(k + 1, LINKS + 1):
        parent = os.path.join(out, f"i{j - 1}", "manifest.json")
        sha = hashlib.sha256(open(parent, "rb").read()).hexdigest()
        m = hostile.read_json(os.path.join(out, f"i{j}"), "manifest.json")
        m["parent"]["manifest_sha256"] = sha
        hostile.write_json(os.path.join(out, f"i{j}"), "manifest.json", m)


def _edit_index(out: str, k: int, fn) -> None:
    ckpt = os.path.join(out, f"i{k}")
    idx = hostile.read_json(ckpt, "index.json")
    fn(idx)
    hostile.write_json(ckpt, "index.json", idx)
    for rel in list(hostile.read_json(ckpt, "manifest.json")["files"]):
        if rel.endswith(".index.json"):   # the one worker's index is the merged one, byte for byte
            hostile.write_json(ckpt, rel, idx)
    _repin(out, k)


def _edit_manifest(out: str, k: int, fn) -> None:
    ckpt = os.path.join(out, f"i{k}")
    m = hostile.read_json(ckpt, "manifest.json")
    fn(m)
    hostile.write_json(ckpt, "manifest.json", m)
    _repin(out, k)


def _shift_crcs(out: str) -> None:
    """Link i3's table 'a' loses its last CRC and link i4's gains one: together they hold as many."""
    def cut(idx):
        t = idx["tables"]["a"]["segments"]
        t["crc32c"] = t["crc32c"][:-8]
    _edit_index(out, 3, cut)

    def grow(idx):
        t = idx["tables"]["a"]["segments"]
        t["crc32c"] = "0" * 8 + t["crc32c"]
    _edit_index(out, 4, grow)


ATTACKS = {
    # a segment naming the file just past its own link's files (in the merge: the next link's first)
    "file_past_its_own": lambda out: _edit_index(
        out, 3, lambda idx: idx["tables"]["a"]["segments"]["file"].__setitem__(0, len(idx["files"]))),
    "crcs_shifted_between_links": _shift_crcs,
    # a field missing from an empty SEGS that the other links' SEGS have
    "field_missing_in_empty_removed": lambda out: _edit_index(
        out, 3, lambda idx: idx["tables"]["a"]["removed"].pop("offset")),
    # what a worker index is not checked for (the merge is validated as one): the manifest's counts
    "manifest_rows": lambda out: _edit_manifest(out, 3, lambda m: m["tables"]["a"].update(rows=m["tables"]["a"]["rows"] + 1)),
    "manifest_removed": lambda out: _edit_manifest(out, 3, lambda m: m["tables"]["b"].update(removed=3)),
    "manifest_shard_bytes": lambda out: _edit_manifest(out, 3, lambda m: m.update(shard_bytes=m["shard_bytes"] - 1)),
    "file_negative": lambda out: _edit_index(out, 3, lambda idx: idx["tables"]["a"]["segments"]["file"].__setitem__(0, -1)),
    "table_missing": lambda out: _edit_index(out, 3, lambda idx: idx["tables"].pop("b")),
    "removed_part_missing": lambda out: _edit_index(out, 3, lambda idx: idx["tables"]["b"].pop("removed")),
    "unknown_field": lambda out: _edit_index(out, 3, lambda idx: idx["tables"]["b"]["removed"].update(zzz=[])),
    # rows moved between two segments of the link: the table's total holds, the layout does not
    "rows_moved": lambda out: _edit_index(out, 3, lambda idx: (
        idx["tables"]["a"]["segments"]["rows"].__setitem__(0, idx["tables"]["a"]["segments"]["rows"][0] + 1),
        idx["tables"]["a"]["segments"]["rows"].__setitem__(1, idx["tables"]["a"]["segments"]["rows"][1] - 1))),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_link_the_merge_would_hide_is_refused_with_its_own_message(tmp_path, attack):
    out = str(tmp_path)
    build(out)
    ATTACKS[attack](out)
    with pytest.raises(CorruptCheckpointError) as alone:
        _reader(out, "i3").parsed_index()
    assert "i3" in str(alone.value)
    m2 = Model()
    with torch.no_grad():
        m2.a(torch.arange(3))
    before = m2.a.read_rows("embedding", m2.a.lookup(torch.arange(3)))
    with pytest.raises(CorruptCheckpointError) as e:
        Saver(m2, output_dir=out, options=OPTS).load()
    assert str(e.value) == str(alone.value)
    assert len(m2.a) == 3 and torch.equal(m2.a.read_rows("embedding", m2.a.lookup(torch.arange(3))), before)


def test_every_gate_is_needed_the_merge_alone_accepts_the_crc_shift(tmp_path):
    """The CRC strings shifted between two links pass the merged validation (the concatenation is
    well formed): only the per-link count after it refuses them."""
    out = str(tmp_path)
    build(out)
    _shift_crcs(out)
    links = walk_chain(_reader(out, f"i{LINKS}"))
    merged, spans = chain_index._merge([(link, link.index_object()) for link in links[1:]])
    assert len(spans) == LINKS
    doc = index_parse.index_from_json(merged, "merged", links[1].manifest, worker=True)
    assert [chain_index._cut(doc, span) is None for span in spans] == [False, False, True, True, False, False]


# Not refused by the rules (an index may carry fields it does not use), but not v4-shaped: a later format
# version's fields could mean anything, so the merge leaves the link to its own validation.
GATE_ONLY = {"unknown_top_level_field": lambda out: _edit_index(out, 3, lambda idx: idx.update(extra={"x": 1}))}


@pytest.mark.parametrize("attack", ["file_past_its_own", "file_negative", "manifest_rows", "manifest_removed",
                                    "manifest_shard_bytes", "field_missing_in_empty_removed", "unknown_field",
                                    "table_missing", "removed_part_missing", "unknown_top_level_field"])
def test_the_merge_leaves_out_a_link_whose_own_index_it_could_not_vouch_for(tmp_path, attack):
    out = str(tmp_path)
    build(out)
    {**ATTACKS, **GATE_ONLY}[attack](out)
    links = walk_chain(_reader(out, f"i{LINKS}"))
    _, spans = chain_index._merge([(link, link.index_object()) for link in links[1:]])
    assert [s.link.manifest.ckpt_id for s in spans] == [f"i{k}" for k in range(1, LINKS + 1) if k != 3]


def test_links_whose_segments_all_carry_a_later_field_are_validated_alone(tmp_path):
    """Every link's SEGS with the same extra field (version 5's row-run starts, `id0`): consistent across
    links, so only the version 4 field list keeps them out of the merge."""
    out = str(tmp_path)
    build(out)
    for k in range(1, LINKS + 1):
        _edit_index(out, k, lambda idx: idx["tables"]["a"]["segments"].update(
            id0=[-1] * len(idx["tables"]["a"]["segments"]["file"])))
    links = walk_chain(_reader(out, f"i{LINKS}"))
    _, spans = chain_index._merge([(link, link.index_object()) for link in links[1:]])
    assert spans == []


def test_links_of_a_later_format_version_are_validated_alone(tmp_path):
    from dataclasses import replace
    out = str(tmp_path)
    build(out)
    links = walk_chain(_reader(out, f"i{LINKS}"))
    for link in links[1:4]:
        link.manifest = replace(link.manifest, format_version=max(chain_index.MERGED_VERSIONS) + 1)
    chain_index.parse_indexes(links)
    assert [link.index_parsed for link in links] == [False] * 4 + [True] * (LINKS - 3)


def test_version_5_links_with_row_runs_are_validated_alone(tmp_path):
    """Format version 5: a link holding a fixed-size table (row runs: `id0` in its SEGS, rules across
    segments) is validated on its own; the same chain's indexes read alone and after parse_indexes agree."""
    from helpers.fake_tables import FixedRows
    m = Model()
    m.add_module("f", FixedRows("f", n=300, d=8))
    with torch.no_grad():
        m.a(torch.arange(400))
        m.b(torch.arange(100))
    s = Saver(m, output_dir=str(tmp_path), max_keep=None, options=OPTS)
    s.save("base")
    for i in range(1, 4):
        m.b.remove_ids(torch.tensor([i]))
        s.save(f"i{i}", incremental=True)
    links = walk_chain(_reader(str(tmp_path), "i3"))
    assert all(link.manifest.format_version == 5 for link in links)
    chain_index.parse_indexes(links)
    assert not any(link.index_parsed for link in links)   # each left to its own validation
    for link in links:
        idx = link.index
        assert all(seg.is_run for seg in idx.tables["f"][1])
        assert _key(idx) == _key(_reader(str(tmp_path), link.manifest.ckpt_id).parsed_index())
