"""A restore from an output directory the ranks do not share (a node-local path given to a multi-node job)
is refused on every rank before anything is loaded. Before, each rank found a "ckpt_1" on its own disk,
the ranks agreed on that name, and each restored its own disk's state: two ranks of one job with different
models, and no error until the next save. Two real gloo ranks, each with its own directory."""
from __future__ import annotations

import os

from helpers import rank_scenarios as sc
from helpers.ranks import Holder, all_ids, ok, owned_table, run_ranks
from recckpt import CheckpointManager, Saver


def test_ranks_that_see_different_checkpoints_under_one_name_restore_nothing(tmp_path):
    base = str(tmp_path / "disks")
    for node in range(2):   # each node's disk: its own run, saved alone, different rows and dense values
        saver = Saver(Holder(owned_table(0, 1, all_ids(300 + 100 * node), salt=float(node)), dense_value=node),
                      output_dir=os.path.join(base, f"node{node}"), options=sc.OPTS)
        CheckpointManager(saver, 1, save_rng=False).step()
        assert saver.checkpoints() == ["ckpt_1"]
    rep = ok(run_ranks(2, sc.unshared_restore, base, out_dir=str(tmp_path / "r")))
    for rank, got in enumerate(rep):
        assert "error" in got, f"rank {rank} restored its own disk's checkpoint: {got}"
        e = got["error"]
        assert e.startswith("CoordinationError") and f"rank {rank}:" in e, e
        assert "not shared between the ranks" in e and "Nothing was loaded" in e and "ckpt_1" in e, e
        assert got["unchanged"], f"rank {rank}'s model changed"


def test_ranks_that_share_the_directory_restore(tmp_path):
    """The control: the same two disks made one (both ranks see node0's checkpoint) restore on both."""
    base = str(tmp_path / "disks")
    saver = Saver(Holder(owned_table(0, 1, all_ids(300))), output_dir=os.path.join(base, "node0"), options=sc.OPTS)
    CheckpointManager(saver, 1, save_rng=False).step()
    os.symlink(os.path.join(base, "node0"), os.path.join(base, "node1"))
    rep = ok(run_ranks(2, sc.unshared_restore, base, out_dir=str(tmp_path / "r")))
    for got in rep:
        assert got.get("restored") == 1 and not got["unchanged"], got
