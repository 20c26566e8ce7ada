"""The spawn helper itself: results, errors with rank and traceback, timeouts, reuse."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import harness


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on(rank):
    if dist.get_rank() == rank:
        raise KeyError("planted")
    return os.getpid()


def _hang_on(rank):
    if dist.get_rank() == rank:
        time.sleep(60)
    return os.getpid()


def _pid():
    return os.getpid()


@pytest.mark.parametrize("world", [1, 3, 8])
def test_runs_on_every_rank(world):
    results = harness.run(_rank_and_sum, world)
    assert results == [(r, float(sum(range(world)))) for r in range(world)]


def test_error_names_rank_and_traceback():
    with pytest.raises(harness.RankError) as info:
        harness.run(_fail_on, 2, 1)
    text = str(info.value)
    assert "rank 1" in text and "KeyError: 'planted'" in text and "_fail_on" in text
    assert "rank 0 ---" not in text
    harness.run(_pid, 2)  # the pool survives an error that every rank answered


def test_timeout_kills_the_pool():
    pids = harness.run(_pid, 2)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        harness.run(_hang_on, 2, 0, timeout=3)
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert set(harness.run(_pid, 2)).isdisjoint(pids)


def test_workers_are_reused_and_cheap():
    first = harness.run(_pid, 4)
    start = time.perf_counter()
    for _ in range(20):
        assert harness.run(_pid, 4) == first
    per_call = (time.perf_counter() - start) / 20
    assert per_call < 0.5, f"harness overhead {per_call * 1e3:.0f} ms per call"


def _grid_and_threads():
    from pipezero.topology import Grid

    grid = Grid(pipe=2, data=2, tensor=1)
    t = torch.ones(1)
    dist.all_reduce(t, group=grid.data_group)
    return len(os.listdir("/proc/self/task"))


def test_a_tasks_process_groups_do_not_outlive_it():
    """Every Grid makes subgroups; kept, a 4-rank worker held ~900 gloo threads after a suite."""
    counts = [max(harness.run(_grid_and_threads, 4)) for _ in range(6)]
    assert counts[-1] <= counts[1], counts  # flat after the first task (lazy threads start there)
