"""Test-suite wide settings.

Folders: unit/ (one process), multiprocess/ (real worker processes; marked `multiprocess`), stress/
(crash, corruption, fault and fuzz trials: a small sample by default), spec/ (docs/FORMAT.md read by an
independent reader), helpers/ (a package the tests import; nothing in it is collected).

Slow checks have one switch: the `slow` marker, run only with RECCKPT_SLOW=1. A test that scales its
work with the switch asks for the `slow_mode` fixture instead of reading the environment itself.
"""
import gc
import os

import pytest

SLOW = os.environ.get("RECCKPT_SLOW") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="slow check: set RECCKPT_SLOW=1 to run it")
    multiprocess = os.path.join(HERE, "multiprocess") + os.sep
    for item in items:
        if str(item.fspath).startswith(multiprocess):
            item.add_marker(pytest.mark.multiprocess)
        if not SLOW and "slow" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # What collection imported (torch, torchrec, every test module) lives for the whole session: set aside,
    # Python's full collections (automatic, and each test's gc.collect()) no longer walk it again. A full
    # collection in this session took ~0.6 s otherwise.
    gc.freeze()


@pytest.fixture(scope="session")
def slow_mode() -> bool:
    """True when the slow checks run (RECCKPT_SLOW=1): tests that sample scale up by it."""
    return SLOW


try:  # property-based tests take their example count from here, so the slow switch scales them too
    from hypothesis import HealthCheck, settings

    settings.register_profile("recckpt", max_examples=200 * (20 if SLOW else 1), deadline=None,
                              suppress_health_check=list(HealthCheck), database=None)
    settings.load_profile("recckpt")
except ImportError:  # hypothesis is a test dependency; without it the property tests fail to import
    pass


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for the whole session. Tests get
    credentials and the endpoint from `s3_server.options()` (passed as `storage_options`), never from
    the environment, so nothing can reach a real service."""
    from helpers.s3_server import running_server
    with running_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the session's server; its name."""
    return s3_server.new_bucket()


@pytest.fixture(scope="session", autouse=True)
def torchrec_stays_out_of_the_test_process():
    """TorchRec costs ~4 s to import and pulls fbgemm: the suite's own process never imports it (the TorchRec
    tests run it in worker processes). A test that imports it fails the session here."""
    import sys
    yield
    assert "torchrec" not in sys.modules, (f"a test imported torchrec ({sys.modules.get('torchrec')}) into the pytest "
                                           f"process; run TorchRec in a worker process (tests/torchrec_tests/harness.py)")
