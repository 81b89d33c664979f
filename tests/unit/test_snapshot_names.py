"""Async snapshots must keep every captured part in its own host buffer, whatever the names are."""
import torch

from helpers.tables import DictTable, assert_tables_equal
from recckpt import SaveOptions, Saver
from recckpt.state.protocol import SlotSpec
from recckpt.train.snapshot import HostBuffers, copy_snapshot

OPTS = SaveOptions(num_buckets=16, fsync=False)


class Holder(torch.nn.Module):
    def __init__(self, *tables):
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)


def test_a_slot_named_ids_does_not_share_the_id_buffer(tmp_path):
    spec = {"embedding": SlotSpec(torch.float32, (2,), "sparse"), "ids": SlotSpec(torch.int32, (), "sparse")}
    t = DictTable("t/x", spec)          # a '/' in the table name too
    ids = torch.arange(1000, 1100)
    t.set_rows(ids, {"embedding": torch.randn(100, 2), "ids": torch.full((100,), 7, dtype=torch.int32)})
    saver = Saver(Holder(t), output_dir=tmp_path, options=OPTS)
    saver.write("c", copy_snapshot(saver.capture(), HostBuffers()))
    back = DictTable("t/x", spec)
    Saver(Holder(back), output_dir=tmp_path).load()
    assert_tables_equal(t, back)


def test_extras_keys_that_print_alike_keep_their_own_tensors(tmp_path):
    saver = Saver(Holder(), output_dir=tmp_path, options=OPTS)
    value = {1: torch.ones(2), "1": torch.full((2,), 2.0), "a/b": torch.full((2,), 3.0),
             "a": {"b": torch.full((2,), 4.0)}}
    saver.register_for_checkpointing("v", value)
    saver.write("c", copy_snapshot(saver.capture(), HostBuffers()))
    s2 = Saver(Holder(), output_dir=tmp_path)
    s2.register_for_checkpointing("v", {})
    s2.load()
    got = s2.extra("v")
    assert torch.equal(got[1], value[1]) and torch.equal(got["1"], value["1"])
    assert torch.equal(got["a/b"], value["a/b"]) and torch.equal(got["a"]["b"], value["a"]["b"])
