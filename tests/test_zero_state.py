"""ZeroOptimizer state: per-rank round trip, and a consolidated state moving between data degrees.

The truth is one process training all steps uninterrupted on the same global batches.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.zero import ZeroConfig, ZeroOptimizer
from pipezero.zero.state import consolidated_state_dict
from test_zero_parity import data, make_model, make_opt, reference

GLOBAL_WORLD = 4  # the global batch is data(4, step) whatever the data degree


def _build(stage, params=None):
    model = make_model()
    if params is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), params):
                p.copy_(q)
    cfg = ZeroConfig(stage=stage, stage3_param_persistence_threshold=10)
    return model, ZeroOptimizer(make_opt(model, "adamw2"), module=model, config=cfg)


def _train(model, opt, steps):
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        x, y = data(GLOBAL_WORLD, step)
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]))
        opt.step()


def _params(model, opt):
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def _save(stage):
    model, opt = _build(stage)
    _train(model, opt, range(3))
    return _params(model, opt), consolidated_state_dict(opt)


def _resume(stage, params, state):
    model, opt = _build(stage, params)
    opt.load_state_dict(state)
    _train(model, opt, range(3, 6))
    return _params(model, opt)


@pytest.mark.parametrize("saved_stage,loaded_stage", [(2, 3), (3, 1)])
def test_consolidated_state_moves_from_4_to_2_ranks(saved_stage, loaded_stage):
    params, state = run(_save, 4, saved_stage)[0]
    assert set(state["consolidated"]["state"]) == set(range(len(params)))
    first = state["consolidated"]["state"][0]
    assert first["exp_avg"].shape == params[0].shape     # single-process layout
    results = run(_resume, 2, loaded_stage, params, state)
    want = reference("adamw2", GLOBAL_WORLD, steps=6)
    for rank, got in enumerate(results):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")


def _round_trip(stage):
    model, opt = _build(stage)
    _train(model, opt, range(2))
    saved, params = opt.state_dict(), _params(model, opt)
    model2, opt2 = _build(stage, params)
    opt2.load_state_dict(saved)
    _train(model2, opt2, range(2, 4))
    _, other = _build(1)
    with pytest.raises(ValueError, match="consolidated_state_dict"):
        other.load_state_dict(saved)
    return _params(model2, opt2)


def test_per_rank_state_round_trip():
    want = reference("adamw2", GLOBAL_WORLD, steps=4)
    for rank, got in enumerate(run(_round_trip, 2, 2)):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
