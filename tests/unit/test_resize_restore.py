"""restore() of a checkpoint another number of workers saved, in one process (the checkpoint's two
shards saved from here, the restore on one worker): resize_policy's refusal and its RNG seeding."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from recckpt import CheckpointManager, HashTable, Saver
from recckpt.errors import IncompatibleCheckpointError


class Reader:
    def __init__(self):
        self.position = 0

    def dump_io_state(self):
        return {"position": self.position}

    def load_io_state(self, state):
        self.position = state["position"]


def _model():
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    m.lin = torch.nn.Linear(2, 2)
    return m


def _saved_by_two_workers(out):
    """ckpt_5, saved as 2 workers' shards (each with its reader's position and RNG state)."""
    m = _model()   # (its table empty: each worker's shard would need its own ids)
    s = Saver(m, output_dir=str(out))
    CheckpointManager(s, save_interval=5).register_io_state("reader", Reader())
    for rank in range(2):
        s.save("ckpt_5", step=5, shard_id=rank, shard_num=2)
    assert s.checkpoints() == ["ckpt_5"]


def _draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])


def test_resize_policy_error_refuses_with_advice_a_manager_can_follow(tmp_path):
    """The loader's refusal advised load_conf {'io_state_on_resize': 'drop'}, which a manager overrides
    from resize_policy: following it gave the same error."""
    _saved_by_two_workers(tmp_path)
    m = _model()
    before = [p.clone() for p in m.parameters()]
    mgr = CheckpointManager(Saver(m, output_dir=str(tmp_path)), save_interval=5, resize_policy="error")
    mgr.register_io_state("reader", Reader())
    for conf in (None, {"io_state_on_resize": "drop"}):
        with pytest.raises(IncompatibleCheckpointError, match=r"saved by 2 worker\(s\) and is restored on 1.*"
                                                              r"resize_policy='reseed'"):
            mgr.restore(load_conf=conf)
    assert mgr.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_a_resized_restore_that_leaves_out_io_state_still_seeds_the_rngs_from_step_and_rank(tmp_path):
    """load_conf excluding 'io_state' kept the RNG state out of io_state_dropped, so 'reseed' skipped the
    seeding: two restores of one checkpoint then drew different numbers."""
    _saved_by_two_workers(tmp_path)
    got = []
    for seed in (1, 2):   # the processes' generators differ before the restore
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        mgr = CheckpointManager(Saver(_model(), output_dir=str(tmp_path)), save_interval=5)
        mgr.register_io_state("reader", Reader())
        with pytest.warns(UserWarning, match=r"seeded from \(step 5, rank 0\)"):
            assert mgr.restore(load_conf={"exclude": ["io_state"]}) == 5
        got.append(_draws())
    assert got[0] == got[1]
    with warnings.catch_warnings():   # the default restore (IO state dropped) seeds them alike
        warnings.simplefilter("ignore")
        mgr = CheckpointManager(Saver(_model(), output_dir=str(tmp_path)), save_interval=5)
        mgr.register_io_state("reader", Reader())
        assert mgr.restore() == 5
    assert _draws() == got[0]
