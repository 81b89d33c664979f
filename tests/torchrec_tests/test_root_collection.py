"""An EmbeddingBagCollection given to the Saver as the model itself (no wrapper, no DMP): its tables are
sparse tables with their fused optimizer's state, as when the same EBC sits inside a module. Before, the
root was never looked at: the table was saved as a dense tensor, its Adagrad state left out, and a resume
reported success with the live optimizer state. Run in a child process (the test process never imports
torchrec)."""
from __future__ import annotations

import json

from .harness import needs_torchrec, run_script

pytestmark = needs_torchrec

CHILD = r'''
import json, sys, warnings
import torch
warnings.filterwarnings("ignore")
import recckpt
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

def ebc():
    torch.manual_seed(0)
    e = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10,
                                                          feature_names=["f"])])
    apply_optimizer_in_backward(torch.optim.Adagrad, e.parameters(), {"lr": 0.1})
    return e

def train(m):
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([3]))
    m(kjt).values().pow(2).sum().backward()

out = sys.argv[1]
m = ebc()
train(m)
w = m.embedding_bags.t0.weight
opt = w._in_backward_optimizers[0]
saved_w, saved_sum = w.detach().clone(), opt.state[w]["sum"].clone()
s = recckpt.Saver(m, output_dir=out)
s.save("c1")
view = recckpt.open(out + "/c1")
train(m); train(m)
r = s.load()
json.dump({"tables": sorted(view.tables), "loaded": sorted(r.tables),
           "weight": bool(torch.equal(w, saved_w)), "sum": bool(torch.equal(opt.state[w]["sum"], saved_sum))},
          open(out + "/res.json", "w"))
'''


def test_a_bare_ebc_as_the_model_saves_and_restores_its_tables_and_optimizer_state(tmp_path):
    p = run_script(code=CHILD, argv=[tmp_path / "ck"])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(tmp_path / "ck" / "res.json"))
    assert res == {"tables": ["embedding_bags.t0"], "loaded": ["embedding_bags.t0"], "weight": True, "sum": True}, res
