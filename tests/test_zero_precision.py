"""ZeroOptimizer with low-precision models and in the chain with LossScaler; CPU offload.

Tolerances: a bf16 model rounds every weight to 8 bits of mantissa after each step, so after
10 steps it sits within ~1e-2 of fp32 training; we require the ZeRO run to stay as close
to the fp32 truth as plain single-process bf16 training with fp32 master weights does
(2x its error + 2e-3). fp16 with loss scaling: same rule.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.precision import LossScaler
from pipezero.zero import ZeroConfig, ZeroOptimizer
from test_zero_parity import data, local_batch, make_model, make_opt, reference

STEPS = 10


def _config(stage, **kw):
    return ZeroConfig(stage=stage, stage3_param_persistence_threshold=10, **kw)


def _low_precision_run(stage, dtype, overflow_step=None):
    """ZeRO over a bf16/fp16 model (fp32 masters inside); fp16 goes through a dynamic LossScaler."""
    world = dist.get_world_size()
    model = make_model(dtype)
    inner = make_opt(model, "adam")
    if dtype == torch.float16:
        inner = LossScaler(inner, init_scale=2.0 ** 8)
    opt = zero = ZeroOptimizer(inner, module=model, config=_config(stage))
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    stepped = []
    for step in range(STEPS):
        x, y = local_batch(world, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        if step == overflow_step and dist.get_rank() == world - 1:
            loss = loss * float("inf")              # only the last rank overflows
        opt.backward(loss)
        stepped.append(opt.step())
    with zero.gathered_parameters():
        return [p.detach().float().clone() for p in model.parameters()], stepped, repr(opt)


def _single_low_precision(dtype, world, skip=None):
    """Plain PyTorch in one process: low-precision model, fp32 master copies in the optimizer."""
    model = make_model(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(masters, lr=1e-2)
    for step in range(STEPS):
        if step == skip:
            continue
        x, y = data(world, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return [p.detach().float() for p in model.parameters()]


def _fp32_truth(world, skip=None):
    model = make_model()
    opt = make_opt(model, "adam")
    for step in range(STEPS):
        if step == skip:
            continue
        x, y = data(world, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _check_close(got_per_rank, truth, single, what):
    for rank, got in enumerate(got_per_rank):
        for a, t, s in zip(got, truth, single, strict=True):
            budget = 2 * (s - t).abs().max().item() + 2e-3
            err = (a - t).abs().max().item()
            assert err <= budget, f"{what} rank {rank}: {err:.2e} from fp32, single-process {budget:.2e} budget"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_model_with_fp32_masters(stage):
    results = run(_low_precision_run, 2, stage, torch.bfloat16)
    _check_close([r[0] for r in results], _fp32_truth(2), _single_low_precision(torch.bfloat16, 2),
                 f"bf16 stage {stage}")
    assert all(all(r[1]) for r in results)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scaler_chain_with_forced_overflow(stage):
    results = run(_low_precision_run, 2, stage, torch.float16, 4)
    expected = f"ZeroOptimizer(stage={stage}, LossScaler(dynamic, Adam))"
    for params, stepped, text in results:
        assert stepped == [s != 4 for s in range(STEPS)], stepped      # every rank skipped step 4
        assert text == expected
    _check_close([r[0] for r in results], _fp32_truth(2, skip=4),
                 _single_low_precision(torch.float16, 2, skip=4), f"fp16 stage {stage}")


def _overflow_once():
    """One fp16 Linear, stage 2, one process, an infinite loss: (stepped, weights, scale after)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).half()
    before = [p.detach().clone() for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler(adamw, init_scale=16.0, hysteresis=1)
    opt = ZeroOptimizer(scaler, stage=2)
    loss = model(torch.ones(2, 4, dtype=torch.float16)).float().sum() * float("inf")
    opt.backward(loss)
    stepped = opt.step()
    return stepped, before, [p.detach().clone() for p in model.parameters()], scaler.loss_scale


def test_the_chain_skips_an_overflow():
    """ZeroOptimizer(LossScaler(...)) on inf grads: nothing stepped, the scale halved."""
    stepped, before, after, scale = run(_overflow_once, 1)[0]
    assert stepped is False
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert scale == 8.0


def test_the_other_chain_order_is_refused():
    """LossScaler(ZeroOptimizer(...)) once stepped on inf grads (the scaler looked before ZeRO handed
    them over); the chain has one order now, and the other one fails at construction."""
    model = nn.Linear(4, 4).half()
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
    with pytest.raises(TypeError, match=r"LossScaler\(ZeroOptimizer\(stage=2, AdamW\)\): ZeroOptimizer must be "
                                        r"the outermost .* ZeroOptimizer\(LossScaler\(\.\.\.\)\)"):
        LossScaler(zero, init_scale=16.0, hysteresis=1)


# -- offload -------------------------------------------------------------------------------------
def _offload(stage, offload):
    world = dist.get_world_size()
    model = make_model()
    kw = {"offload_optimizer": offload} if stage < 3 else {"offload_optimizer": offload, "offload_param": offload}
    opt = ZeroOptimizer(make_opt(model, "adamw2"), module=model, config=_config(stage, **kw))
    for step in range(4):
        x, y = local_batch(world, step)
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
    separate = all(b.master.data_ptr() != b.local.data_ptr() for b in opt.buckets)
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()], separate


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_matches_the_run_without(stage):
    plain = run(_offload, 2, stage, False)
    offloaded = run(_offload, 2, stage, True)
    for (a, sep_a), (b, sep_b) in zip(plain, offloaded):
        assert not sep_a and sep_b        # offload really steps separate CPU masters
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
