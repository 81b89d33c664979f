"""Loading into a live model: the load configuration, resolving which checkpoint to load, matching the
checkpoint against the model and applying it (dense, extras, IO state), sparse and chain loads, row
filters.

Owns: everything `Saver.load` and `CheckpointManager.restore` do once a checkpoint is chosen.
Must not know: bytes and file layout (it reads through `recckpt.format`), the training side
(`recckpt.train`) or the offline tools (`recckpt.tools`): it imports neither.
"""
