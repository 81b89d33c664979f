"""recckpt tests: unit."""
