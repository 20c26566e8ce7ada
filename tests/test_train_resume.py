"""Checkpoints wired to the real parts: exact resume, reshard onto three other grids, export.

A run stopped at step K and resumed from its checkpoint must give the same losses as the
uninterrupted run, bit for bit (CPU, fp32), at world 1 and on pipe 2 x data 2 with ZeRO-2.
The pipe 2 x data 2 checkpoint then continues on pipe 1 x data 4, pipe 4 x data 1 and a
single process within 1e-6 of the original grid's continuation (only the summation order of
the reductions differs), and its export loads into the single-process GPT.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import run
from pipezero.train.checkpoint import CheckpointError
from pipezero.train.data import ShardedBatches, TokenData

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_loss, gpt_specs  # noqa: E402

MODEL = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)
K, N = 2, 4       # checkpoint after K steps, compare up to step N
GLOBAL_BATCH, MICRO = 16, 4


def _config(pipe: int, zero: int = 2, bf16: bool = False) -> dict:
    return {"bf16": {"enabled": bf16}, "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-3,
                                                         "warmup_min_lr": 3e-4, "warmup_type": "linear"}},
            "zero_optimization": {"stage": zero}, "pipeline": {"stages": pipe}}


def _data() -> TokenData:
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(7))
    return TokenData(tokens, MODEL.seq_len, 0.1)


def _parts(pipe: int, zero: int = 2, bf16: bool = False):
    from pipezero.train.build import build

    parts = build(_config(pipe, zero, bf16), specs=gpt_specs(MODEL), loss_fn=gpt_loss)
    batches = ShardedBatches(_data(), parts.config.batch.per_rank_batch_size, parts.grid.data_rank,
                             parts.grid.data_size)
    return parts, batches


def _train(parts, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = batches.next_batch()
        losses.append(parts.runner.train_step(x, y).item())
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()
    return losses


def _stop_and_resume(directory: str, pipe: int, bf16: bool) -> tuple[list[float], list[float]]:
    """(uninterrupted losses 1..N, losses 1..K then resumed K+1..N)."""
    from pipezero.train.checkpoint.state import load_state, save_state

    parts, batches = _parts(pipe, bf16=bf16)
    straight = _train(parts, batches, N)
    parts, batches = _parts(pipe, bf16=bf16)
    first = _train(parts, batches, K)
    save_state(parts, directory, K, batches.state_dict())
    parts, batches = _parts(pipe, bf16=bf16)  # a fresh job: new weights, optimizer, schedule and data position
    meta = load_state(parts, directory)
    batches.load_state_dict(meta["data"])
    assert meta["step"] == K and parts.scheduler.last_epoch == K
    return straight, first + _train(parts, batches, N - K)


@pytest.mark.parametrize("world, pipe, bf16", [(1, 1, False), (4, 2, False), (1, 1, True)])
def test_resume_is_exact(tmp_path, world, pipe, bf16):
    # bf16: exact too, because the checkpoint holds the fp32 master weights, not the bf16 copies
    for straight, resumed in run(_stop_and_resume, world, str(tmp_path), pipe, bf16, timeout=240):
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=0, atol=0)
        assert straight[-1] < straight[0]


def _continue(directory: str, pipe: int) -> list[float]:
    from pipezero.train.checkpoint.state import load_state

    parts, batches = _parts(pipe)
    batches.load_state_dict(load_state(parts, directory)["data"])
    return _train(parts, batches, N - K)


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    """A pipe 2 x data 2 checkpoint after K steps, and the losses of steps K+1..N on that grid."""
    directory = tmp_path_factory.mktemp("grid2x2")

    def _run():
        return run(_save_then_continue, 4, str(directory), timeout=240)[0]
    return directory, _run()


def _save_then_continue(directory: str) -> list[float]:
    from pipezero.train.checkpoint.state import save_state

    parts, batches = _parts(2)
    _train(parts, batches, K)
    save_state(parts, directory, K, batches.state_dict())
    return _train(parts, batches, N - K)


@pytest.mark.parametrize("world, pipe", [(4, 1), (4, 4), (1, 1)])
def test_reshard_continues_identically(saved_2x2, world, pipe):
    directory, truth = saved_2x2
    for losses in run(_continue, world, str(directory), pipe, timeout=240):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(truth), rtol=0, atol=1e-6)


def test_export_loads_into_single_process_gpt(saved_2x2, tmp_path):
    from pipezero.train.checkpoint.state import export_model

    directory, _ = saved_2x2
    path = export_model(directory, tmp_path / "gpt.safetensors", gpt_specs(MODEL))
    model = GPT(MODEL)
    model.load_state_dict(load_file(str(path)))  # strict: every name, the tied head included
    assert model.layers[-1].weight is model.layers[0].weight
    x, y = _data().windows("val", torch.arange(4))
    loss = gpt_loss(model(x), y)
    fresh = gpt_loss(GPT(MODEL)(x), y)
    assert loss.item() != fresh.item()  # trained weights, not the initial ones


def _load_wrong_model(directory: str) -> str:
    from pipezero.train.build import build
    from pipezero.train.checkpoint.state import load_state

    other = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=8)
    parts = build(_config(1), specs=gpt_specs(other), loss_fn=gpt_loss)
    try:
        load_state(parts, directory)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_checkpoint_of_another_model_is_refused(saved_2x2):
    message = run(_load_wrong_model, 1, str(saved_2x2[0]))[0]
    assert "shape" in message and "another model" in message, message
