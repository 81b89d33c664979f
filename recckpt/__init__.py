"""recckpt: checkpoints for recommendation models.

Public names are imported lazily, so `import recckpt` stays cheap and a tool that needs only the format
(e.g. `recckpt.verify`) does not import the training-side modules.
"""
from ._version import __version__

_EXPORTS = {
    "Saver": "recckpt.api.saver",
    "LoadResult": "recckpt.api.load_apply",
    "SaveOptions": "recckpt.api.options",
    "ReadOptions": "recckpt.format.sparse_io",
    "LoadConfig": "recckpt.api.load_config",
    "CheckpointManager": "recckpt.api.manager",
    "compact": "recckpt.api.compaction",
    "CompactStats": "recckpt.api.compaction",
    "EveryNSteps": "recckpt.api.policies",
    "EveryNSeconds": "recckpt.api.policies",
    "AtSteps": "recckpt.api.policies",
    "EphemeralEveryNSteps": "recckpt.api.policies",
    "KeepPolicy": "recckpt.api.policies",
    "AnySavePolicy": "recckpt.api.policies",
    "SaveContext": "recckpt.api.policies",
    "SaveDecisionPolicy": "recckpt.api.policies",
    "IncrementPolicy": "recckpt.api.increments",
    "PreemptionHandler": "recckpt.api.preemption",
    "SaveHandle": "recckpt.api.async_save",
    "AsyncSaveError": "recckpt.errors",
    "AsyncCommitOutcomeUnknownError": "recckpt.errors",
    "RNGState": "recckpt.api.rng",
    "HashTable": "recckpt.state.hashtable",
    "EvictionPolicy": "recckpt.state.eviction",
    "SparseAdagrad": "recckpt.state.optim",
    "SparseAdam": "recckpt.state.optim",
    "SparseState": "recckpt.state.protocol",
    "SlotSpec": "recckpt.state.protocol",
    "SparseTableMeta": "recckpt.state.protocol",
    "split_sparse_dense_state_dict": "recckpt.state.protocol",
    "initializers": "recckpt.state.initializers",
    "errors": "recckpt.errors",
    "partition": "recckpt.routing",
    "split_by_owner": "recckpt.routing",
    "verify": "recckpt.format.verifier",
    "VerifyReport": "recckpt.format.verifier",
    "open": "recckpt.api.reader",
    "CheckpointView": "recckpt.api.reader",
    "export": "recckpt.api.exporter",
    "ExportOptions": "recckpt.api.exporter",
    "list_checkpoints": "recckpt.api.outdir",
    "prune": "recckpt.api.outdir",
    "gc": "recckpt.api.outdir",
    "delete": "recckpt.api.outdir",
    "diff": "recckpt.api.compare",
}


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'recckpt' has no attribute {name!r}")
    import importlib
    m = importlib.import_module(mod)
    value = m if mod.endswith("." + name) else getattr(m, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


# Not "open": `from recckpt import *` must not replace the builtin open.
__all__ = ["__version__", *(n for n in _EXPORTS if n != "open")]
