"""The `recckpt` command (also `python -m recckpt`): ls, inspect, verify, diff, export, prune, gc.

Built only on the public API (`recckpt.open`, `recckpt.export`, `recckpt.diff`, `recckpt.verify`,
`recckpt.list_checkpoints`, `recckpt.prune`, `recckpt.gc`); docs/CLI.md describes every verb."""
from .main import main

__all__ = ["main"]
