"""Loads the chain head `c059` of an output directory in a process whose limit on open files is lowered
(argv: output dir, soft limit, "chunked" or "one_call"), then prints a JSON line: the loaded value of id 9,
or the error. "one_call" makes the links' reads one engine call again, as before recckpt capped the files
a call opens: the call runs out of descriptors."""
import json
import resource
import sys

import torch

import recckpt
from recckpt.format import link_reads

out, soft, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
if mode == "one_call":
    link_reads.FILES_PER_CALL = 1 << 30
    real = resource.getrlimit
    resource.getrlimit = lambda which: (1 << 30, 1 << 30) if which == resource.RLIMIT_NOFILE else real(which)
m = torch.nn.Module()
m.t = recckpt.HashTable("t", 4)
try:
    recckpt.Saver(m, output_dir=out).load(ckpt_id="c059")
    print(json.dumps({"value": float(m.t.read_rows("embedding", m.t.lookup(torch.tensor([9])))[0, 0])}))
except Exception as e:  # noqa: BLE001 - reported to the test
    print(json.dumps({"error": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}))
