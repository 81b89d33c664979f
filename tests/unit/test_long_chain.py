"""A chain of 100 increments (issue 26 item 5, at test size): it loads exactly, and verify names the one
broken link among them."""
import os

import pytest
import torch

import recckpt
from helpers.hostile import flip_byte
from recckpt import HashTable, SaveOptions, Saver

ROWS, LINKS, K = 2000, 100, 20


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = HashTable("emb", 4, capacity=ROWS)


def rows_of(table):
    return table.read_rows("embedding", table.lookup(torch.arange(ROWS)))


def build(out):
    gen = torch.Generator().manual_seed(3)
    m = Model()
    with torch.no_grad():
        m.emb(torch.arange(ROWS))
    s = Saver(m, output_dir=out, max_keep=None, options=SaveOptions(fsync=False, num_buckets=64))
    s.save("base")
    for i in range(1, LINKS + 1):
        rows = torch.randperm(ROWS, generator=gen)[:K]
        m.emb.write_rows("embedding", rows, torch.randn(K, 4, generator=gen))
        s.save(f"i{i:03d}", incremental=True)
    return m


def test_a_100_link_chain_loads_exactly_and_verify_names_the_broken_link(tmp_path):
    out = str(tmp_path / "run")
    m = build(out)
    m2 = Model()
    Saver(m2, output_dir=out).load()
    assert torch.equal(rows_of(m2.emb), rows_of(m.emb))
    assert recckpt.verify(os.path.join(out, f"i{LINKS:03d}")).ok
    # flip one byte of a shard file in the middle of the chain
    shard_dir = os.path.join(out, "i057", "sparse")
    shard = sorted(f for f in os.listdir(shard_dir) if f.endswith(".bin"))[0]
    flip_byte(os.path.join(shard_dir, shard), os.path.getsize(os.path.join(shard_dir, shard)) - 1, 0xFF)
    report = recckpt.verify(os.path.join(out, f"i{LINKS:03d}"))
    assert not report.ok
    text = "\n".join(report.problems)
    assert "i057" in text and "i056" not in text and "i058" not in text, text


@pytest.mark.parametrize("where", ["ids", "rows"])
def test_a_damaged_link_in_the_middle_is_named_by_the_load(tmp_path, where):
    """The links are read together (one engine call for all their ids, batches of rows spanning links):
    a flipped byte of one link's ids or rows still fails the load naming that link, and a damaged id
    leaves the model as it was (ids are all read before the table is touched)."""
    from recckpt.errors import CorruptCheckpointError
    from recckpt.format.checkpoint import CheckpointReader
    from recckpt.storage import open_storage

    out = str(tmp_path / "run")
    build(out)
    idx = CheckpointReader(open_storage(os.path.join(out, "i057")), "").index
    seg = idx.tables["emb"][1][0]
    col = seg.columns[0] if where == "ids" else seg.columns[1]
    flip_byte(os.path.join(out, "i057", idx.files[seg.file][0]), col.offset + col.length - 1, 0xFF)
    m2 = Model()
    with torch.no_grad():
        m2.emb(torch.arange(5))
    five = lambda: m2.emb.read_rows("embedding", m2.emb.lookup(torch.arange(5)))  # noqa: E731
    before = five()
    with pytest.raises(CorruptCheckpointError) as e:
        Saver(m2, output_dir=out).load()
    text = str(e.value)
    assert "i057" in text and "i056" not in text and "i058" not in text, text
    if where == "ids":
        assert len(m2.emb) == 5 and torch.equal(five(), before)


def test_a_chain_with_more_files_than_the_process_may_open_loads(tmp_path):
    """A chain's links were read in one engine call that kept every link's shard files open: a chain of a few
    hundred links failed under the usual `ulimit -n 1024` (here 60 links under a limit of 40), and the error
    called an intact file corrupt ("open error: Too many open files"), so restore() skipped back past every
    such link. Now a call opens at most a quarter of the limit's files, and running out of descriptors is a
    StorageError (EMFILE) that says the checkpoint is not known to be damaged."""
    import errno
    import json
    import subprocess
    import sys

    out = str(tmp_path / "run")
    m = torch.nn.Module()
    m.t = HashTable("t", 4, track_changes=True)
    m.t(torch.arange(50))
    s = Saver(m, output_dir=out, max_keep=None, options=SaveOptions(fsync=False))
    s.save("c000")
    for i in range(1, 60):
        m.t.write_rows("embedding", m.t.lookup(torch.tensor([i % 50])), torch.full((1, 4), float(i)))
        s.save(f"c{i:03d}", incremental=True)
    helper = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "fd_limited_load.py")

    def load(mode):
        p = subprocess.run([sys.executable, helper, out, "40", mode], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert load("chunked") == {"value": 59.0}
    got = load("one_call")
    assert got["error"] == "StorageError" and got["errno"] == errno.EMFILE, got
    assert "not known to be damaged" in got["message"] and "ulimit -n" in got["message"], got
