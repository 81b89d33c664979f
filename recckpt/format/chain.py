"""Chains of incremental checkpoints: from the newest link back to its full base, every link opened
and checked (manifest, parent hash, index, shard sizes) before any row is read.

An incremental checkpoint names its parent by id, a sibling directory of the same output directory,
and by the SHA-256 of the parent's manifest.json (which records the size and checksum of every file
of the parent, so the hash pins the parent's whole content). docs/FORMAT.md, "Incremental checkpoints".
"""
from __future__ import annotations

import os

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..storage import Storage
from .chain_index import parse_indexes
from .checkpoint import CheckpointReader

#: A chain longer than this is refused as garbled (a loop of parents is caught before, by ids).
MAX_CHAIN_LINKS = 10_000


def sibling(ckpt_dir: str, ckpt_id: str) -> str:
    """The directory of checkpoint `ckpt_id` next to `ckpt_dir` (both relative to the storage root)."""
    head = ckpt_dir.rsplit("/", 1)[0] if "/" in ckpt_dir else ""
    return f"{head}/{ckpt_id}" if head else ckpt_id


def split_path(path: str) -> tuple[str, str]:
    """(output directory, checkpoint directory name) of the checkpoint at `path` (local path or fsspec
    URL): a link names its parent as a sibling, so a chain is opened through the output directory."""
    path = os.fspath(path)
    if "://" not in path:
        path = os.path.abspath(path)
    root, _, name = path.rstrip("/").rpartition("/")
    return (root or "/"), name


def open_chain(newest: CheckpointReader) -> list[CheckpointReader]:
    """The links of `newest`'s chain, base first, each checked: the parent exists and is committed, its
    manifest hash is the one its child recorded, its index parses and matches its manifest, its shard
    files have the recorded sizes, and all links share the bucket count. A full checkpoint is a chain of
    one. Raises CorruptCheckpointError naming the missing or altered link."""
    links = chain_of(newest)
    for link in links:
        link.verify_worker_indexes()
        if link.manifest.index is not None:
            _ = link.segments  # parses and checks the index and every shard file's size
    return links


def chain_of(newest: CheckpointReader) -> list[CheckpointReader]:
    """The links of `newest`'s chain as `walk_chain` opens them, their indexes validated together where
    they can be (one pass instead of one per link); their files are not checked yet (a reader's
    `files_problems`, or its first read of a link, does that)."""
    links = walk_chain(newest)
    parse_indexes(links)
    return links


def walk_chain(newest: CheckpointReader) -> list[CheckpointReader]:
    """The links of `newest`'s chain, base first, opened from the newest back: each parent exists and is
    committed, its manifest hash is the one its child recorded, and all links share the bucket count
    (the links' own files are not checked here: open_chain or verify does that). A table's bucket
    function may differ between links (format.fold reads such a link whole)."""
    links = [newest]
    seen = {newest.manifest.ckpt_id}
    storage: Storage = newest.storage
    cur = newest
    while cur.manifest.parent is not None:
        ref = cur.manifest.parent
        if ref.ckpt_id in seen or len(links) >= MAX_CHAIN_LINKS:
            raise CorruptCheckpointError(f"{cur.describe()}: its chain of parents loops back to {ref.ckpt_id!r} "
                                         f"or is longer than {MAX_CHAIN_LINKS}", cur.describe())
        seen.add(ref.ckpt_id)
        where = storage.describe(sibling(cur.ckpt_dir, ref.ckpt_id))
        if not cur.ckpt_dir:
            raise IncompatibleCheckpointError(
                f"{cur.describe()} is an incremental checkpoint on {ref.ckpt_id!r}, a sibling directory: "
                f"open it through its output directory (ckpt_path=<output_dir>, ckpt_id=...)")
        try:
            parent = CheckpointReader(storage, sibling(cur.ckpt_dir, ref.ckpt_id), threads=newest.threads,
                                      read_options=newest.read_options)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{where}: link of the chain of {newest.describe()} is missing (parent of {cur.describe()}); "
                f"the chain cannot be loaded: load an older complete checkpoint", where) from None
        if parent.manifest.content_sha256 != ref.manifest_sha256:
            raise CorruptCheckpointError(
                f"{where}: link of the chain of {newest.describe()} was altered or replaced: its manifest's "
                f"SHA-256 is {parent.manifest.content_sha256}, its child {cur.describe()} recorded "
                f"{ref.manifest_sha256}", where)
        if parent.manifest.num_buckets != newest.manifest.num_buckets:
            raise CorruptCheckpointError(
                f"{where}: {parent.manifest.num_buckets} buckets, but {newest.describe()} has "
                f"{newest.manifest.num_buckets}; the links of a chain share one bucket count", where)
        links.append(parent)
        cur = parent
    links.reverse()
    return links


def table_links(links: list[CheckpointReader], table: str) -> list[CheckpointReader]:
    """The links that hold `table`'s rows in the newest link's state: from the newest back to the last
    one that holds the table whole (its base for this table). Slots must agree along the way."""
    newest = links[-1]
    info = newest.manifest.tables[table]
    out = [newest]
    for link in reversed(links[:-1]):
        if not info.changes:
            break
        have = link.manifest.tables.get(table)
        if have is None:
            raise CorruptCheckpointError(f"{link.describe()}: has no table {table!r}, but its child in the chain "
                                         f"of {newest.describe()} holds only that table's changes", link.describe())
        if have.slots != newest.manifest.tables[table].slots:
            def spelled(slots):   # names alone can be equal where a dtype or shape differs
                return ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in slots.items())
            raise CorruptCheckpointError(f"{link.describe()}: table {table!r} has slots {spelled(have.slots)}, the "
                                         f"newest link {newest.describe()} "
                                         f"{spelled(newest.manifest.tables[table].slots)}; links of a chain share "
                                         f"a table's slots", link.describe())
        out.append(link)
        info = have
    if info.changes:
        raise CorruptCheckpointError(f"{out[-1].describe()}: table {table!r} holds only changes but the chain "
                                     f"has no earlier link", out[-1].describe())
    out.reverse()
    if len(out) > 1 and info.column_blocks is not None:
        # written by recckpt before increments held such a table whole after a load (docs/FORMAT.md): a fold
        # reads whole rows and cannot join column blocks with the later links' row changes
        raise IncompatibleCheckpointError(
            f"{newest.describe()}: table {table!r} cannot be read through its chain: link {out[0].describe()} "
            f"holds it as column blocks and the later link {out[1].describe()} holds its row changes, which "
            f"no fold can join. {out[0].describe()} itself can be loaded, read and exported; to use the newer "
            f"links leave the table out (load_conf 'tables', export --tables)", table=table,
            path=newest.describe())
    return out


def chain_stats(found, ckpt_id: str) -> tuple[int, int, int] | None:
    """(increments, their payload bytes, the base's payload bytes) of the chain ending at `ckpt_id`, from
    the committed checkpoints `found` ((id, CatalogEntry), as catalog.committed lists them); None if a link
    is not among them."""
    by_id = dict(found)
    incs = inc_bytes = 0
    cur = by_id.get(ckpt_id)
    seen = set()
    while cur is not None and cur.parent is not None:
        if cur.ckpt_id in seen:
            return None
        seen.add(cur.ckpt_id)
        incs += 1
        inc_bytes += cur.payload_bytes
        cur = by_id.get(cur.parent.ckpt_id)
    if cur is None:
        return None
    return incs, inc_bytes, cur.payload_bytes
