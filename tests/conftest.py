import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


def pytest_collection_modifyitems(config, items):
    """`slow` tests (long stress modes) run only with RECCKPT_SLOW=1, so CI stays fast."""
    if os.environ.get("RECCKPT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow stress test: set RECCKPT_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
