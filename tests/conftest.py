import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

SLOW = os.environ.get("RECCKPT_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="long stress check: set RECCKPT_SLOW=1 to run it "
                                   "(benchmarks/stress.py runs the same at full size)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
