"""Checkpoints of ZeRO-3 inside a pipeline load on other grids and stages, and the reverse.

A pipe 2 x data 2 job at stage 3 saves after K steps; its continuation is the truth. The
checkpoint continues within 1e-6 at stage 2 on the same grid, at stage 3 on pipe 1 x data 4
(data parallel only), at stage 2 on pipe 4 x data 1 and in one process; a stage-2 checkpoint
of the same grid continues at stage 3 as it does at stage 2.
"""

import pytest
import torch

from harness import run
from test_train_resume import K, N, _parts, _train


def _save_then_continue(directory: str, save_zero: int, load_zero: int) -> tuple[list[float], list[float]]:
    """(the saving job's losses K+1..N, a fresh job at load_zero on the same grid from the checkpoint)."""
    from pipezero.train.checkpoint.state import load_state, save_state

    parts, batches = _parts(2, save_zero)
    _train(parts, batches, K)
    save_state(parts, directory, K, batches.state_dict())
    truth = _train(parts, batches, N - K)
    parts, batches = _parts(2, load_zero)
    batches.load_state_dict(load_state(parts, directory)["data"])
    return truth, _train(parts, batches, N - K)


def _continue(directory: str, pipe: int, zero: int) -> list[float]:
    from pipezero.train.checkpoint.state import load_state

    parts, batches = _parts(pipe, zero)
    batches.load_state_dict(load_state(parts, directory)["data"])
    return _train(parts, batches, N - K)


@pytest.fixture(scope="module")
def saved_stage3(tmp_path_factory):
    """A pipe 2 x data 2 stage-3 checkpoint and its continuation; checked to load at stage 2 there."""
    directory = tmp_path_factory.mktemp("stage3_2x2")
    truth, at_stage2 = run(_save_then_continue, 4, str(directory), 3, 2, timeout=300)[0]
    return directory, truth, at_stage2


def test_stage3_checkpoint_continues_at_stage2_on_its_grid(saved_stage3):
    _, truth, at_stage2 = saved_stage3
    torch.testing.assert_close(torch.tensor(at_stage2), torch.tensor(truth), rtol=0, atol=1e-6)
    assert truth[-1] < truth[0] + 1.0  # a real continuation, not a fresh start


@pytest.mark.parametrize("world, pipe, zero", [(4, 1, 3), (4, 4, 2), (1, 1, 3)])
def test_stage3_checkpoint_continues_on_other_grids(saved_stage3, world, pipe, zero):
    directory, truth, _ = saved_stage3
    for losses in run(_continue, world, str(directory), pipe, zero, timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(truth), rtol=0, atol=1e-6)


def test_stage2_checkpoint_continues_at_stage3(tmp_path):
    truth, at_stage3 = run(_save_then_continue, 4, str(tmp_path), 2, 3, timeout=300)[0]
    torch.testing.assert_close(torch.tensor(at_stage3), torch.tensor(truth), rtol=0, atol=1e-6)
