"""One rank of a two-rank job whose output_dir is a private disk: started inside its own mount namespace
(`unshare -m`) with a fresh tmpfs mounted at OUT, so each rank sees its own empty directory at the same
path, as the nodes of a multi-node job given a node-local path do. Saves checkpoint "c" on both ranks
and reports what happened.

Usage: private_disk_child.py OUT RANK WORLD PORT RESULT_FILE VISIBILITY_TIMEOUT_S"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    out, rank, world, port, result_file, vis = sys.argv[1:7]
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from helpers.tables import DictTable
    from recckpt import SaveOptions, Saver
    from recckpt.format import catalog
    from recckpt.state.protocol import SlotSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    res = {"rank": rank}
    try:
        m = torch.nn.Module()
        m.t = DictTable("t", {"embedding": SlotSpec(torch.float32, (4,), "sparse")})
        ids = torch.arange(rank * 1000, rank * 1000 + 100)
        m.t.set_rows(ids, {"embedding": torch.full((100, 4), float(rank))})
        s = Saver(m, output_dir=out, options=SaveOptions(num_buckets=16, fsync=False,
                                                         visibility_timeout_s=float(vis)))
        t0 = time.monotonic()
        try:
            s.save("c")
            res["outcome"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            res["outcome"] = "error"
            res["error"] = f"{type(e).__name__}: {e}"
        res["seconds"] = time.monotonic() - t0
        res["committed"] = [i for i, _ in catalog.committed(s.storage)]
        res["listed"] = catalog.read_version_file(s.storage)
        res["entries"] = sorted(os.listdir(out))
        if res["outcome"] == "ok" and rank == 0:   # what this rank committed is whole (its disk dies with it)
            from recckpt import verify
            res["verify_ok"] = verify(os.path.join(out, "c")).ok
    except BaseException as e:  # noqa: BLE001
        res["crash"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(result_file, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
