import pytest

import harness


def pytest_configure(config):
    harness.start_server()  # its imports (torch, transformers) run beside the collection


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools():
    yield
    harness.shutdown()
