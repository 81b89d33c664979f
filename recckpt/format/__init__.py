"""The on-disk format: names, schemas, validation, and the code that writes and reads them.
docs/FORMAT.md is the same contract in prose."""
from .names import FORMAT_VERSION

__all__ = ["FORMAT_VERSION"]
