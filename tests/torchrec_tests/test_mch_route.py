"""recckpt routes a managed-collision table's raw ids to shards as TorchRec's row-wise input distribution
does (FBGEMM's block bucketize): compared id by id with FBGEMM itself, in a worker process (the test
process never imports FBGEMM or TorchRec), over in-range, out-of-range and negative ids."""
from __future__ import annotations

import json
import textwrap

from .harness import needs_torchrec, run_script

pytestmark = needs_torchrec


def test_route_matches_fbgemm_block_bucketize():
    code = textwrap.dedent("""
        import json, torch, fbgemm_gpu  # noqa: F401
        from recckpt.integrations.torchrec.mch import route
        g = torch.Generator().manual_seed(0)
        bad = []
        for size, buckets in [(60, 2), (60, 3), (1000, 7), (2 ** 40, 5), (2 ** 63 - 1, 4)]:
            ids = torch.cat([torch.randint(-3 * size if size < 2 ** 60 else -2 ** 62, min(3 * size, 2 ** 62), (3000,),
                                           generator=g), torch.tensor([0, size - 1, size, -1, 2 ** 63 - 1, -2 ** 63])])
            n = ids.numel()
            out = torch.ops.fbgemm.block_bucketize_sparse_features(
                torch.ones(n, dtype=torch.int64), ids, False, False,
                torch.tensor([-(-size // buckets)]), buckets)
            theirs = out[0].view(buckets, n).argmax(0)
            mine = route(ids, size, buckets)
            bad += [(size, buckets, int(i)) for i in ids[mine != theirs][:5]]
        print(json.dumps(bad))
    """)
    proc = run_script(code=code, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stdout
