"""What a load applies, and how: `LoadConfig`, built from a plain dict like
`{"load": ["*"], "exclude": ["sparse_opt"], "strict": True}`."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Mapping

from ..errors import LoadConfigError
from ..state import renames

CATEGORIES = ("sparse", "sparse_opt", "dense", "extra", "io_state")


def _tuple_of_str(v, name):
    if isinstance(v, str):
        v = (v,)
    try:
        v = tuple(v)
    except TypeError:
        raise LoadConfigError(f"LoadConfig.{name} must be a string or a list of strings, got {v!r}") from None
    if not all(isinstance(x, str) for x in v):
        raise LoadConfigError(f"LoadConfig.{name} must hold strings, got {v!r}")
    return v


@dataclass(frozen=True)
class LoadConfig:
    load: tuple[str, ...] = ("*",)
    """Categories to load: 'sparse' (ids + embeddings and other non-optimizer slots), 'sparse_opt'
    (optimizer slots and the sparse optimizer's own state; excluded → fresh optimizer state), 'dense',
    'extra' (registered objects), 'io_state' (this worker's reader state), or '*' for all."""

    exclude: tuple[str, ...] = ()
    """Categories removed from `load`."""

    strict: bool = True
    """Missing or unexpected tables/keys/objects: one error listing all of them (True) or one warning (False)."""

    tables: tuple[str, ...] = ("*",)
    """Globs over the checkpoint's sparse table names; only matching tables are loaded."""

    slots: tuple[str, ...] = ("*",)
    """Globs over slot names (e.g. 'embedding', 'adam.*'); non-matching slots are not loaded."""

    dense_keys: tuple[str, ...] = ("*",)
    """Globs over the checkpoint's dense keys."""

    rename: Mapping[str, str] = field(default_factory=dict)
    """Checkpoint name → model name, for tables and dense keys. A key ending in '.' renames a prefix
    ('tower_a.' → 'tower_b.'). Applied before matching against the model."""

    cast: bool = True
    """Allow float ↔ float casts (fp32 ↔ bf16/fp16/fp64) to the model's dtype. Other dtype changes always fail."""

    merge: bool = False
    """Sparse tables: insert the checkpoint's rows into what the table already holds (model-bank warm
    start from several sources) instead of replacing its contents."""

    duplicates: str = "error"
    """An id stored by more than one worker (a job that ran with a bad routing): 'error' (default)
    raises, naming the table and how many ids; 'newest' keeps the copy from the worker that saved at
    the highest step (`Saver.save(step=...)`) and still raises when the steps are equal or unknown.
    Never are both copies kept silently. See docs/DISTRIBUTED.md."""

    io_state_on_resize: str = "error"
    """IO state is per worker; loading on a different number of workers than saved it: 'error'
    (default) raises naming both sizes, before anything is loaded; 'drop' loads everything else and
    leaves the registered IO-state objects untouched (listed in LoadResult.io_state_dropped)."""

    mmap: bool = False
    """Sparse tables: map the checkpoint's slot columns into the tables copy-on-write instead of copying
    them (as torch.load's `mmap` option does for tensors): the load then copies only the ids, and a
    table's pages stay shared with the page cache until training writes them. Applies to replace loads
    from a local filesystem into tables implementing `AdoptStorage` (HashTable does) with no dtype
    cast; other tables are copied as usual, and so are rows of segments this worker owns only partly.
    `LoadResult.tables_mapped` and `bytes_mapped` say what was mapped. While a table maps a
    checkpoint, do not truncate or rewrite its files in place (the process would get SIGBUS); deleting
    it is safe, but its disk space is freed only once no table maps it. See docs/LOADING.md."""

    overflow: str = "error"
    """A table that holds at most a fixed number of ids per process (TorchRec's managed-collision tables,
    `RoutedRows`) loaded onto another plan, where a process is routed more of the checkpoint's ids than it
    has room for: 'error' (default) raises, naming the table, the process and both counts, before anything
    is loaded; 'evict' keeps the ids the table's own eviction policy ranks highest (for MCH: LFU by count,
    LRU by last access) and drops the rest. See docs/TORCHREC.md."""

    admit_by: str | None = None
    """A table that holds at most a fixed number of ids per process (`RoutedRows`: TorchRec's managed-
    collision tables) given more of the checkpoint's ids than it has room for: admit those with the
    highest values of this checkpoint slot (one value per row; ties: the smaller id) and leave out the
    rest, instead of `overflow`'s rule. E.g. 'freq' (a HashTable's counter: the most frequent ids) or
    'last_step' (the most recently seen) when a HashTable checkpoint warm-starts an MCH table. The
    counts admitted and left out are in `LoadResult.admission`. Other tables ignore it. See docs/TORCHREC.md."""

    ownership: Callable | None = None
    """Which ids this rank keeps, when training routed ids with its own function instead of
    `recckpt.partition`: `ownership(ids: int64 tensor, world: int) -> ranks` (e.g.
    `lambda ids, world: ids % world`). Loads correctly but every rank reads every row (slower)."""

    def __post_init__(self):
        if self.duplicates not in ("error", "newest"):
            raise LoadConfigError(f"LoadConfig.duplicates must be 'error' or 'newest', got {self.duplicates!r}")
        if self.io_state_on_resize not in ("error", "drop"):
            raise LoadConfigError(f"LoadConfig.io_state_on_resize must be 'error' or 'drop', got "
                                  f"{self.io_state_on_resize!r}")
        if self.overflow not in ("error", "evict"):
            raise LoadConfigError(f"LoadConfig.overflow must be 'error' or 'evict', got {self.overflow!r}")
        if self.admit_by is not None and (not isinstance(self.admit_by, str) or not self.admit_by):
            raise LoadConfigError(f"LoadConfig.admit_by must be a slot name (e.g. 'freq') or None, got "
                                  f"{self.admit_by!r}")
        if self.ownership is not None and not callable(self.ownership):
            raise LoadConfigError(f"LoadConfig.ownership must be a function (ids, world) -> ranks, got "
                                  f"{type(self.ownership).__name__}")
        for name in ("load", "exclude", "tables", "slots", "dense_keys"):
            object.__setattr__(self, name, _tuple_of_str(getattr(self, name), name))
        for name in ("load", "exclude"):
            bad = [c for c in getattr(self, name) if c != "*" and c not in CATEGORIES]
            if bad:
                raise LoadConfigError(f"LoadConfig.{name}: unknown categories {bad}; known: "
                                      f"{', '.join(CATEGORIES)} and '*'")
        if not self.load or not any(self.wants(c) for c in CATEGORIES):
            raise LoadConfigError(f"LoadConfig load={list(self.load)}, exclude={list(self.exclude)} selects "
                                  f"nothing to load; name at least one of {', '.join(CATEGORIES)} (or '*')")
        for name in ("strict", "cast", "merge", "mmap"):
            if not isinstance(getattr(self, name), bool):
                raise LoadConfigError(f"LoadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        # A prefix may map to "" (a wrapper's `module.` or `_orig_mod.` left out); a whole name may not.
        if not isinstance(self.rename, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and k and (v or k.endswith("."))
                for k, v in self.rename.items()):
            raise LoadConfigError(f"LoadConfig.rename must map non-empty names to non-empty names, or a prefix "
                                  f"(ending in '.') to a prefix, which may be '' (e.g. {{'module.': ''}} to leave "
                                  f"out a DDP wrapper's prefix); got {self.rename!r}")
        object.__setattr__(self, "rename", dict(self.rename))

    @classmethod
    def coerce(cls, conf) -> "LoadConfig":
        if conf is None:
            return cls()
        if isinstance(conf, cls):
            return conf
        if not isinstance(conf, Mapping):
            raise LoadConfigError(f"load_conf must be a dict or LoadConfig, got {type(conf).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(conf) - known)
        if unknown:
            raise LoadConfigError(f"load_conf: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**conf)

    def wants(self, category: str) -> bool:
        chosen = set(CATEGORIES) if "*" in self.load else set(self.load)
        if "*" in self.exclude:
            return False
        return category in chosen and category not in self.exclude

    def table_selected(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in self.tables)

    def slot_selected(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in self.slots)

    def dense_selected(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, g) for g in self.dense_keys)

    def unmatched(self, tables: list[str] | None, slots: list[str] | None, dense_keys: list[str] | None
                  ) -> list[str]:
        """The selectors a user wrote that match nothing in a checkpoint with these table names, slot
        names and dense keys (None: a part this load does not read, so not checked): a typo there would
        otherwise load nothing for that part, silently."""
        out = []
        pairs = [("tables", self.tables, tables), ("slots", self.slots, slots), ("dense_keys", self.dense_keys, dense_keys)]
        for field_name, globs, names in pairs:
            if names is None:
                continue
            for g in globs:
                if g != "*" and not any(fnmatch.fnmatchcase(n, g) for n in names):
                    out.append(f"load_conf {field_name} pattern {g!r} matches nothing in the checkpoint "
                               f"(it has {sorted(names)[:20]})")
        return out

    def unknown_renames(self, names: Iterable[str]) -> list[str]:
        """The `rename` keys that name none of `names` (a checkpoint's table names and dense keys): a rename
        names the checkpoint, not the model, so a key naming nothing is a typo whatever `strict` says."""
        known = list(names)
        return [k for k in self.rename
                if not (any(n.startswith(k) for n in known) if k.endswith(".") else k in known)]

    def renamed(self, name: str) -> str:
        return renames.renamed(self.rename, name)
