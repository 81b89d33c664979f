import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """Long stress modes run only with RECCKPT_SLOW=1 (see pyproject's `slow` marker)."""
    if os.environ.get("RECCKPT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow check: set RECCKPT_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
