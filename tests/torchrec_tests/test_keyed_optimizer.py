"""TorchRec's KeyedOptimizer loaded before its first step (issue 27): its Adam state is created lazily and
its load_state_dict refuses empty state ("Different parameter count: 0 vs N"), so a restore() at start-up
initialises the state first, as KeyedOptimizer.init_state does, without moving any parameter (AdamW with
weight decay: a zero-gradient step at the real learning rate would shrink every weight). Run in a child
process (the test process never imports torchrec); the example's bit-for-bit resume (test_loop_example.py)
covers the same path under DMP."""
from __future__ import annotations

import json

from .harness import needs_torchrec, run_script

pytestmark = needs_torchrec

CHILD = r'''
import json, sys, warnings
import torch
warnings.filterwarnings("ignore")
import recckpt
from torchrec.optim.keyed import KeyedOptimizerWrapper

def build(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    o = KeyedOptimizerWrapper(dict(m.named_parameters()),
                              lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.5))
    return m, o

out, res = sys.argv[1], {}
m, o = build(0)
for _ in range(3):
    o.zero_grad()
    m(torch.randn(8, 6)).sum().backward()
    o.step()
s = recckpt.Saver(m, output_dir=out + "/ck")
s.register_for_checkpointing("opt", o)
s.save("c")
saved = {n: {k: v.clone() for k, v in o.state[p].items()} for n, p in m.named_parameters()}

for conf in (None, {"exclude": ["dense"]}):
    m2, o2 = build(1)     # other weights: a load of the dense part must be visible, its absence too
    before = {n: p.detach().clone() for n, p in m2.named_parameters()}
    s2 = recckpt.Saver(m2, output_dir=out + "/ck")
    s2.register_for_checkpointing("opt", o2)
    key = "all" if conf is None else "no_dense"
    try:
        s2.load(load_conf=conf)
    except Exception as e:
        res[key] = {"error": f"{type(e).__name__}: {e}"}
        continue
    res[key] = {
        "state_equal": all(k in o2.state[p] and torch.equal(o2.state[p][k], v)
                           for n, p in m2.named_parameters() for k, v in saved[n].items()),
        "params_as_saved": all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters())),
        "params_untouched": all(torch.equal(p, before[n]) for n, p in m2.named_parameters()),
        "grads_none": all(p.grad is None for p in m2.parameters()),
        "lr": [g["lr"] for g in o2.param_groups],
    }
    # and it trains on
    o2.zero_grad()
    m2(torch.randn(8, 6)).sum().backward()
    o2.step()
    res[key]["steps_after"] = int(o2.state[next(m2.parameters())]["step"])
json.dump(res, open(out + "/res.json", "w"))
'''


def test_keyed_optimizer_loads_before_its_first_step_without_moving_parameters(tmp_path):
    p = run_script(code=CHILD, argv=[tmp_path])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(tmp_path / "res.json"))
    full, no_dense = res["all"], res["no_dense"]
    assert "error" not in full, full
    assert full["state_equal"] and full["params_as_saved"] and full["grads_none"], full
    assert full["lr"] == [0.05] and full["steps_after"] == 4, full   # the saved step (3) + one
    assert "error" not in no_dense, no_dense
    # the optimizer's state loaded; the initialising step moved no weight despite weight decay
    assert no_dense["state_equal"] and no_dense["params_untouched"] and not no_dense["params_as_saved"], no_dense
    assert no_dense["grads_none"] and no_dense["lr"] == [0.05], no_dense
