import os

import pytest

import harness


def pytest_configure(config):
    harness.start_server()  # its imports (torch, transformers) run beside the collection


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools():
    yield
    harness.shutdown()


@pytest.fixture(autouse=True)
def _nothing_distributed_leaks_into_the_next_test():
    """A test that starts a process group in the test process itself (a DeepSpeed-style engine, a
    one-process job) leaves RANK / MASTER_PORT in os.environ and the group alive; the next test's
    subprocesses then read them as torchrun's (EADDRINUSE, one process where two were meant)."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
