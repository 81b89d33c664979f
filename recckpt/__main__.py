"""`python -m recckpt ...`: the same command as the `recckpt` console script."""
import sys

from recckpt.cli import main

sys.exit(main())
