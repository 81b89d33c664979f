"""Tables sharded on TorchRec's "dense" compute kernel (`row_wise(compute_kernel="dense")`, what
`construct_module_sharding_plan` picks for a table without an in-backward optimizer): an ordinary
parameter, stepped by the user's dense optimizer. A helper found two silent failures there:
- increments held only the rows looked up since the parent, but the dense optimizer moves other rows too
  (momentum, weight decay): a loaded chain differed from the model. Such a table is now saved whole in
  every increment, as a data-parallel one is;
- the dense optimizer's state for it is sharded per rank, but was saved as rank 0's alone, so every rank
  restored rank 0's shard of it. recckpt cannot map that state into the table's slots yet: a save (and a
  load) with such state now refuses, naming the table, the kernel and what to do.
Real DMP sharding on 2 gloo ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .harness import ROOT, free_port, needs_torchrec, run_jobs

pytestmark = needs_torchrec

LOOP_CHILD = os.path.join(ROOT, "tests", "helpers", "torchrec_loop_child.py")


def test_a_dense_kernel_table_with_optimizer_state_is_refused_naming_it(tmp_path):
    tables = [["a", 40, 8, "fp32"], ["k", 30, 8, "fp32"]]
    base = {"kind": "ebc", "plan": {"a": "tw", "k": "rwdense"}, "opt": "adagrad", "tables": tables}
    ck = str(tmp_path / "ck")
    res = run_jobs(str(tmp_path), 2, [
        dict(base, name="save", train_steps=2, save=ck, expect_error=True),
        # SGD without momentum keeps no state: nothing per rank to lose, the save goes on
        dict(base, name="sgd", opt="sgd", train_steps=2, save=str(tmp_path / "ck_sgd"), expect_error=True)])
    for r in res:
        err = r[0]["error"]
        assert err is not None and "coll.embedding_bags.k" in err and "'dense' compute kernel" in err, err
        assert "apply_optimizer_in_backward" in err and "KeyedOptimizerWrapper" in err, err
        assert r[1]["error"] is None, r[1]
    assert not os.path.exists(os.path.join(ck, "ckpt_1"))


def test_increments_hold_a_dense_kernel_table_whole(tmp_path):
    """c1's rows are the looked-up rows of the fused table plus every row of the dense-kernel one."""
    out = str(tmp_path / "train")
    os.makedirs(out)
    job = {"name": "d", "opt": "adagrad", "tables": [["a", 40, 12], ["k", 30, 12]], "dir": str(tmp_path / "ck"),
           "dump": str(tmp_path / "dump"), "plan": {"a": "rw", "k": "rwdense"}}
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"world": 2, "port": free_port(), "out": out, "phase": "train", "jobs": [job]}, f)
    proc = subprocess.run([sys.executable, LOOP_CHILD, spec], capture_output=True, text=True, timeout=300)
    errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error_")]
    assert not errors, "\n".join(errors)
    done = json.load(open(os.path.join(out, "done_0.json")))["d"]
    assert done["c1"]["parent"] == "c0", done
    assert done["c1"]["rows"] == done["c1"]["fed"]["a"] + 30, (done, proc.stderr[-2000:])
