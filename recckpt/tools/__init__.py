"""Working on checkpoints without a model: the reader (`recckpt.open`), export, diff, output-directory
maintenance (list, prune, gc, delete) and compaction.

Owns: what the `recckpt` command and model-free scripts do with committed checkpoints.
Must not know: the training side (`recckpt.train`) or the loading layer (`recckpt.load`): it imports
neither, so a tool never pays for (or depends on) the training loop's modules.
"""
