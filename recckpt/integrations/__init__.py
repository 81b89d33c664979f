"""Adapters for other libraries' models (TorchRec first): they map those libraries' tables and optimizer
state onto the `SparseState` protocol and their sharding plans onto ownership.

An integration may import anything in recckpt below it. Nothing in recckpt imports an integration,
except the one plugin registry in the state layer, which imports an adapter only when the library it
adapts is already loaded (so `import recckpt` never pays for, or needs, an optional library).
"""
