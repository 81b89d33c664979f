"""A registered object whose state holds a DTensor or ShardedTensor (each rank holds a shard of it), such as
TorchRec's CombinedOptimizer([dmp.fused_optimizer, dense]): its save failed with torch's own "torch
function '__get__' ... not supported for ShardedTensor!", naming neither the object nor the key. It now
fails naming both, and says to register only the dense optimizer. Run in a process of its own (it needs a
process group and a device mesh)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

CHILD = r"""
import os, sys, tempfile, datetime
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import recckpt
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
mesh = init_device_mesh("cpu", (1,))
class Opt:
    def state_dict(self):
        return {"state": {"t.weight": {"momentum1": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}}}
    def load_state_dict(self, s):
        pass
m = torch.nn.Module()
m.t = recckpt.HashTable("t", dim=2)
s = recckpt.Saver(m, output_dir=sys.argv[1])
s.register_for_checkpointing("optim", Opt())
try:
    s.save("c")
    print("SAVED")
except Exception as e:
    print(type(e).__name__, str(e))
print("committed:", os.path.exists(os.path.join(sys.argv[1], "c", "manifest.json")))
dist.destroy_process_group()
"""


def test_a_dtensor_in_a_registered_objects_state_is_refused_naming_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120, env=env)
    out = p.stdout
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SAVED" not in out and "committed: False" in out, out
    assert "optim" in out and "momentum1" in out and "a DTensor" in out and "register only the dense optimizer" in out, out
