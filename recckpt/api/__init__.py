"""Old import paths, kept for one version: `recckpt.api.<module>` is now `recckpt.train.<module>`,
`recckpt.load.<module>`, `recckpt.tools.<module>` or `recckpt.state.registry` (issue 24 split the api
folder by job).

Importing an old path warns (DeprecationWarning) and gives the module at its new home, the same module
object, so attributes set through either name are seen through both. Public names are unchanged:
`recckpt.Saver` and the other `recckpt.*` exports never went through this package's name.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name under recckpt.api -> its new home.
MOVED = {
    **{m: f"recckpt.train.{m}" for m in ("saver", "manager", "policies", "async_save", "snapshot", "preemption",
                                         "rng", "options", "increments")},
    **{m: f"recckpt.load.{m}" for m in ("load_config", "load_apply", "sparse_load", "chain_load", "row_filter")},
    **{m: f"recckpt.tools.{m}" for m in ("reader", "exporter", "compare", "outdir", "compaction")},
    "registry": "recckpt.state.registry",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path will be removed in the next version", DeprecationWarning,
                  stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    """Loads `recckpt.api.<m>` as the module at its new home (no second copy of its code)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass   # already executed at its new home


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(MOVED[leaf]))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
