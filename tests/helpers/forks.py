"""Test-only: the forkserver every multi-process harness forks its workers from.

A session has one forkserver, and its preload list is read only when the server starts, by whichever
harness comes first: so the list is the union of what the harnesses' workers import (torch and recckpt
once per session, instead of ~3 s of CPU a process on the 2-core CI machine), kept here in one place."""
from __future__ import annotations

import multiprocessing

PRELOAD = ["torch", "torch.distributed", "recckpt", "recckpt.train.saver", "helpers.ranks", "helpers.rank_scenarios",
           "helpers.stress_harness", "helpers.incremental_harness"]


def forkserver_context():
    """multiprocessing's forkserver context, its preload list set."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
