"""recckpt tests: spec."""
