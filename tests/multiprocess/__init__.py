"""recckpt tests: multiprocess."""
