"""The state layer: the ``SparseState`` protocol, splitting state dicts into sparse and dense parts,
and the reference ``HashTable`` with its sparse optimizers.

``protocol`` and ``initializers`` are pure Python; ``HashTable`` and the optimizers need the C++
engine (``recckpt._C``) and are imported on first use.
"""
from recckpt.state import initializers
from recckpt.state.protocol import (
    SLOT_CATEGORIES,
    FixedSize,
    RowRangeLayout,
    SlotSpec,
    SparseState,
    SparseTableMeta,
    split_sparse_dense_state_dict,
)

_LAZY = {
    "HashTable": "recckpt.state.hashtable",
    "SparseOptimizer": "recckpt.state.optim",
    "SparseAdagrad": "recckpt.state.optim",
    "SparseAdam": "recckpt.state.optim",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'recckpt.state' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = [
    "SLOT_CATEGORIES",
    "FixedSize",
    "RowRangeLayout",
    "SlotSpec",
    "SparseState",
    "SparseTableMeta",
    "split_sparse_dense_state_dict",
    "initializers",
    *_LAZY,
]
