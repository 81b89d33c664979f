"""Saving in the training loop: `Saver` (its save side), `CheckpointManager`, save policies, async
snapshots, preemption, RNG state, save options and the increment policy.

Owns: when and what a running job saves, and handing it to the format layer to write.
Must not know: bytes and file layout (the format layer's), or the offline tools (`recckpt.tools`): it
never imports them. It may import the loading layer (`Saver.load` delegates to `recckpt.load`).
"""
