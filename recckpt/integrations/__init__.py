"""Adapters that map other libraries' models onto recckpt's `SparseState` protocol (optional extras).

Nothing in recckpt imports these packages except the plugin registry `recckpt.state.plugins`, which
imports an adapter only when a model holds a module of its library and that library is loaded.
"""
