import pytest

import harness


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools():
    yield
    harness.shutdown()
