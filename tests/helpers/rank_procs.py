"""Start the ranks of a worker script as spawned processes, from a launcher that never imports torch.

`torch.multiprocessing.spawn` imports torch in the launcher first (~3 s on the CI machine) before any
rank starts; the ranks import it again anyway. This does what the scripts used it for with the standard
library: every rank runs `fn(rank, *args)` in its own spawned process, and a rank that exits with an
error ends the others at once (they would otherwise wait in a collective until the gloo timeout) and
makes the launcher exit with an error.

Used by torchrec_child.py and torchrec_loop_child.py, run as scripts (this directory is on sys.path)."""
from __future__ import annotations

import multiprocessing
from multiprocessing.connection import wait

# "fork" only where the caller has already imported what the ranks need and runs no thread of its own
# (zygote.py sets it): each rank then skips its imports.
START_METHOD = "spawn"


def spawn(fn, args: tuple, nprocs: int) -> None:
    ctx = multiprocessing.get_context(START_METHOD)
    procs = [ctx.Process(target=fn, args=(rank, *args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        for p in [p for p in running if not p.is_alive()]:
            running.remove(p)
            if p.exitcode != 0:
                for q in running:
                    q.terminate()
                for q in running:
                    q.join()
                raise SystemExit(f"rank {procs.index(p)} of {nprocs} exited with {p.exitcode}")
