"""recckpt: checkpoints for recommendation models.

Public names are imported lazily, so `import recckpt` stays cheap and a tool that needs only the format
(e.g. `recckpt.verify`) does not import the training-side modules.
"""
from ._version import __version__

_EXPORTS = {
    "Saver": "recckpt.train.saver",
    "LoadResult": "recckpt.load.load_apply",
    "SaveOptions": "recckpt.train.options",
    "ReadOptions": "recckpt.format.sparse_io",
    "LoadConfig": "recckpt.load.load_config",
    "CheckpointManager": "recckpt.train.manager",
    "compact": "recckpt.tools.compaction",
    "CompactStats": "recckpt.tools.compaction",
    "EveryNSteps": "recckpt.train.policies",
    "EveryNSeconds": "recckpt.train.policies",
    "AtSteps": "recckpt.train.policies",
    "EphemeralEveryNSteps": "recckpt.train.policies",
    "KeepPolicy": "recckpt.train.policies",
    "AnySavePolicy": "recckpt.train.policies",
    "SaveContext": "recckpt.train.policies",
    "SaveDecisionPolicy": "recckpt.train.policies",
    "IncrementPolicy": "recckpt.train.increments",
    "PreemptionHandler": "recckpt.train.preemption",
    "SaveHandle": "recckpt.train.async_save",
    "SaveEvent": "recckpt.train.events",
    "LoadEvent": "recckpt.train.events",
    "AsyncSaveError": "recckpt.errors",
    "AsyncCommitOutcomeUnknownError": "recckpt.errors",
    "RNGState": "recckpt.train.rng",
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
    "open": "recckpt.tools.reader",
    "CheckpointView": "recckpt.tools.reader",
    "export": "recckpt.tools.exporter",
    "ExportOptions": "recckpt.tools.exporter",
    "list_checkpoints": "recckpt.tools.outdir",
    "prune": "recckpt.tools.outdir",
    "gc": "recckpt.tools.outdir",
    "delete": "recckpt.tools.outdir",
    "diff": "recckpt.tools.compare",
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
