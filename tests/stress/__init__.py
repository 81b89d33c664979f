"""recckpt tests: stress."""
