"""Before a commit: is every file the workers wrote where the committer will commit it?

A save commits on worker 0 once every worker has handed over its part. When the output directory is
not shared between the workers (a node-local path given to a multi-node job, or separate disks
mounted at one path), each worker's files sit on its own disk and a commit would make a checkpoint
that no one can load. So worker 0 opens every file named in every part, at the location it commits,
and checks its recorded size. Shared filesystems may show another node's new file late (NFS
attribute and negative-lookup caches), so the check retries for a bounded window before it fails.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import CheckpointSaveError
from ..storage import Storage

log = logging.getLogger("recckpt")


@dataclass(frozen=True)
class ExpectedFile:
    worker: int
    rel: str      # relative to the checkpoint directory
    size: int


@dataclass(frozen=True)
class Problem:
    file: ExpectedFile
    found: int | None   # its size as seen, None: not found

    def describe(self) -> str:
        seen = "missing" if self.found is None else f"{self.found} bytes"
        return f"{self.file.rel} (written by rank {self.file.worker}, {self.file.size} bytes; seen: {seen})"


def _check(storage: Storage, stage: str, files: list[ExpectedFile]) -> list[Problem]:
    paths = [f"{stage}/{f.rel}" if stage else f.rel for f in files]
    try:
        sizes: list[int | None] = list(storage.sizes(paths))   # one listing per directory on object stores
    except FileNotFoundError:
        sizes = []
        for p in paths:    # which ones: opening each file (NFS revalidates what it caches on open)
            try:
                sizes.append(storage.size(p))
            except FileNotFoundError:
                sizes.append(None)
    return [Problem(f, n) for f, n in zip(files, sizes) if n != f.size]


def check_visible(storage: Storage, stage: str, files: Iterable[ExpectedFile], *, ckpt_id: str,
                  timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
    """Raise CheckpointSaveError unless every file in `files` is under `stage` with its size, retrying
    for up to `timeout_s` seconds (files seen once are not asked for again)."""
    pending = list(files)
    deadline = time.monotonic() + timeout_s
    delay, waited = 0.05, False
    while True:
        problems = _check(storage, stage, pending)
        if not problems:
            if waited:
                log.info("recckpt: every file of checkpoint %r is visible now", ckpt_id)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise _not_shared(storage, stage, ckpt_id, problems, timeout_s)
        if not waited:
            log.warning("recckpt: %d file(s) of checkpoint %r written by rank(s) %s are not visible yet at %s "
                        "(e.g. %s); checking again for up to %g s", len(problems), ckpt_id,
                        sorted({p.file.worker for p in problems}), storage.describe(stage),
                        problems[0].describe(), timeout_s)
            waited = True
        sleep(min(delay, left))
        delay = min(delay * 2, 1.0)
        pending = [p.file for p in problems]


def _not_shared(storage: Storage, stage: str, ckpt_id: str, problems: list[Problem], timeout_s: float
                ) -> CheckpointSaveError:
    ranks = sorted({p.file.worker for p in problems})
    example = problems[0].describe()
    where = storage.describe()
    if ranks == [0]:   # only this worker's own files: the store lost or cut them
        return CheckpointSaveError(
            f"checkpoint {ckpt_id!r} was not committed: {len(problems)} file(s) this worker wrote are not in "
            f"{storage.describe(stage)} as written, e.g. {example}. Something else removed or changed them "
            f"while the save ran. Nothing was committed and earlier checkpoints are intact.", path=where, rank=0)
    if storage.engine_path("") is None:   # an object store: the ranks wrote to different ones
        return CheckpointSaveError(
            f"checkpoint {ckpt_id!r} was not committed: {len(problems)} file(s) written by rank(s) "
            f"{', '.join(map(str, ranks))} are not in this store as rank 0 sees it ({storage.describe(stage)}) "
            f"after {timeout_s:g} s, e.g. {example}. The ranks are not writing to the same store: give every "
            f"rank the same output_dir and storage_options (endpoint_url, credentials, bucket), or something "
            f"removed the files while the save ran. Nothing was committed and earlier checkpoints are "
            f"intact.", path=where, rank=ranks[0])
    return CheckpointSaveError(
        f"checkpoint {ckpt_id!r} was not committed: {len(problems)} file(s) written by rank(s) "
        f"{', '.join(map(str, ranks))} are not visible to rank 0 at {storage.describe(stage)} after {timeout_s:g} s, "
        f"e.g. {example}. The output directory {where} is not shared between the ranks: each rank wrote to "
        f"its own disk at that path (as with a node-local directory given to a multi-node job), so the "
        f"checkpoint could never be loaded. Use a shared filesystem (NFS, Lustre, ...) or an object store "
        f"(s3://...) as output_dir; if it is shared but shows other nodes' files late, raise "
        f"SaveOptions.visibility_timeout_s. Nothing was committed and earlier checkpoints are intact.",
        path=where, rank=ranks[0])


__all__ = ["ExpectedFile", "check_visible"]
