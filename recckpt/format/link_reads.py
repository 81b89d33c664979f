"""Reads of many checkpoints at once: the links of a chain, each with its own `SegmentReader`, read in
one engine call instead of one (or three) per link.

A chain of a hundred small increments spent most of its load in the fixed cost of those calls (starting
threads, opening files) and in the Python around each; one call across links also lets the engine's
threads and its read-ahead run over all of them. Every byte is verified as in a reader's own `read`,
and a failure names the link's file as that would. A reader that cannot hand its requests to the engine
(an object store) reads its own share itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import _C
from .sparse_io import ReadBatch, ReadRequest, SegmentReader


@dataclass(frozen=True)
class LinkRead:
    """Requests of one reader's table, each read into its destination (a writable uint8 array of the
    request's bytes)."""
    reader: SegmentReader
    table: str
    reqs: list[ReadRequest]
    dsts: list[np.ndarray]


#: Files one engine call of `read_across` opens at most (unless a single job holds more): the engine keeps
#: a call's files open until it returns, and a chain of hundreds of links has files beyond a process's
#: usual limit of 1024 descriptors.
FILES_PER_CALL = 256


def read_across(jobs: Sequence[LinkRead]) -> None:
    """Read and verify every job, in as few engine calls as the readers allow (one per `FILES_PER_CALL`
    files, or a quarter of the process's limit on open files where that is lower)."""
    import resource
    # a quarter of the process's descriptors at most: it has its own files open, and other threads theirs
    limit = max(8, min(FILES_PER_CALL, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))
    calls: list[list[tuple[int, list]]] = [[]]
    files: set = set()
    for k, job in enumerate(jobs):
        if not job.reqs:
            continue
        mine = job.reader.engine_requests(job.reqs, job.dsts)
        if mine is None:
            job.reader.read(job.table, job.reqs, job.dsts)
            continue
        its = {(id(job.reader), r.file) for r in job.reqs}
        if calls[-1] and len(files | its) > limit:
            calls.append([])
            files = set()
        calls[-1].append((k, mine))
        files |= its
    for call in calls:
        if call:
            _engine_call(jobs, call)


def _engine_call(jobs: Sequence[LinkRead], call: list[tuple[int, list]]) -> None:
    """One engine call reading the engine requests of the jobs `call` names ((job index, its requests))."""
    engine, owners = [], []
    for k, mine in call:
        engine += mine
        owners += [(k, i) for i in range(len(mine))]
    first = jobs[owners[0][0]].reader
    nread, errors = _C.read_ranges(engine, max(jobs[k].reader.threads for k, _ in call),
                                   readahead_bytes=first.options.readahead_bytes)
    # The engine counts the call's bytes (whole checksum chunks, padding): shared out by what each asked.
    asked = {k: sum(r.nbytes for r in jobs[k].reqs) for k, _ in call}
    total, given = max(1, sum(asked.values())), 0
    for n, (k, want) in enumerate(asked.items()):
        part = nread - given if n == len(asked) - 1 else nread * want // total
        jobs[k].reader.bytes_read += part
        given += part
    if errors:
        k, i = owners[errors[0][0]]
        raise jobs[k].reader.read_error(jobs[k].table, jobs[k].reqs[i], errors[0][1])


def batch_read(reader: SegmentReader, batch: ReadBatch, cols: list[np.ndarray]) -> LinkRead:
    """The job that reads `batch` of `reader` into `cols` (one flat uint8 buffer per column, ids first)."""
    reqs, dsts = batch.layout(cols)
    return LinkRead(reader, batch.table, reqs, dsts)
