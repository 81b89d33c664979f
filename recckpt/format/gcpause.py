"""Python's cyclic garbage collector paused while recckpt builds or parses the metadata of many tables.

The index and manifest of a model of a thousand tables are hundreds of thousands of small dicts, lists
and dataclasses, built and freed within one save, load or verify. Allocated while the collector runs,
they trigger full collections, each of which walks every object of the process (a model of a thousand
modules is a few hundred thousand): measured at 1000 tables x 200 rows, 6 full collections took 2.2 s
of 3 saves on a busy machine. None of this metadata forms reference cycles (reference counting frees it),
so pausing the collector for those steps only defers the collection of other code's cycles; it is never
paused while rows are written or read, which can take long.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_resume = False   # whether the outermost pause found the collector enabled


@contextlib.contextmanager
def paused():
    """Pause the cyclic collector for the block (nested and concurrent pauses share one: the collector
    resumes when the last one ends, and only if it was enabled when the first began)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
