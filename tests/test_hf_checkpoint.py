"""Checkpoints of a Hugging Face model in a pipeline load onto other grids and continue as if never stopped.

A tiny Qwen2 (tied embedding and head, so the tie crosses stages on some grids) is built by
`build` from its save_pretrained directory through hf_layer_specs, trains K steps on pipe 2 x
data 2 with ZeRO-2 and saves with train/checkpoint/state.py; its own continuation is the run that never
stopped. The checkpoint then continues on pipe 1 x data 2 at ZeRO-3, on pipe 4 x data 1 at
ZeRO-1 and in one process. Every continuation must give the losses of transformers' own model
trained straight through in one process with plain AdamW, and its final parameters, under the
model's own names (~1e-5, fp32).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from test_hf import BATCH, LR, STEPS, _batch, _checkpoint, _mine, _truth  # noqa: E402

FAMILY = "qwen2"
K = 1  # checkpoint after K steps; continue to STEPS


def _config(pipe: int, zero: int) -> dict:
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero},
            "pipeline": {"stages": pipe, "partition_method": "uniform"}}


def _parts(path: str, pipe: int, zero: int):
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.train.build import build

    return build(_config(pipe, zero), specs=hf_layer_specs(path), loss_fn=causal_lm_loss)


def _train(parts, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        ids, targets = _batch(step)
        losses.append(parts.runner.train_step(_mine(ids, parts.grid), _mine(targets, parts.grid)).item())
        assert parts.optimizer.step() is True
        parts.optimizer.zero_grad()
    return losses


def _params(parts) -> dict[str, torch.Tensor]:
    """The whole parameters under Hugging Face names (ZeRO-3 holds shards: gathered for the read)."""
    from pipezero.pipe.hf import hf_state_dict

    with parts.optimizer.gathered_parameters():
        return {name: value.clone() for name, value in hf_state_dict(parts.module).items()}


def _save_then_continue(path: str, directory: str):
    """pipe 2 x data 2, ZeRO-2: K steps, save, then the steps after K of the run that never stopped."""
    from pipezero.train.checkpoint.state import save_state

    parts = _parts(path, 2, 2)
    _train(parts, 0, K)
    save_state(parts, directory, K, {"step": K})
    return _train(parts, K, STEPS), _params(parts)


def _continue(path: str, directory: str, pipe: int, zero: int):
    """A fresh job on another grid: load the checkpoint, train the steps after K."""
    from pipezero.train.checkpoint.state import load_state

    parts = _parts(path, pipe, zero)
    meta = load_state(parts, directory)
    assert meta["data"] == {"step": K} and meta["grid"] == {"pipe": 2, "data": 2, "tensor": 1}
    return _train(parts, K, STEPS), _params(parts)


def _check(results, family: str = FAMILY) -> None:
    """Losses after K and final parameters of every rank equal one process trained straight through."""
    losses, params, _ = _truth(family)
    seen = set()
    for rank_losses, state in results:
        torch.testing.assert_close(rank_losses, losses[K:], rtol=1e-5, atol=1e-5)
        for name, value in state.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(params) - {"lm_head.weight"}, set(params) - seen  # the tied head is the embedding


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The pipe 2 x data 2 checkpoint after K steps; its own continuation checked against one process."""
    root = tmp_path_factory.getbasetemp()
    path, directory = _checkpoint(FAMILY, str(root)), str(tmp_path_factory.mktemp("hf_ckpt"))
    _check(run(_save_then_continue, 4, path, directory, timeout=300))
    return path, directory


@pytest.mark.parametrize("world, pipe, zero", [(2, 1, 3), (4, 4, 1), (1, 1, 0)])
def test_checkpoint_continues_on_another_grid(saved, world, pipe, zero):
    path, directory = saved
    _check(run(_continue, world, path, directory, pipe, zero, timeout=300))
