"""fp16 training with MasterWeights + dynamic LossScaler follows the fp32 truth; torch's GradScaler beside it.

Tolerance (stated): over 50 SGD-momentum steps of a small MLP, with the scale growing every 4 clean
steps so that overflows (skipped steps) happen, every loss is within 1% (relative) of the fp32 run
that skips the same steps, and the fp32 masters within 1e-3 of its parameters. Measured on CPU:
1.3e-3 and 1.2e-4 for ours, 1.1e-3 and 1.2e-4 for GradScaler; fp16 rounding of weights and
activations is what separates them from fp32.
"""

import torch

from pipezero.precision import LossScaler, MasterWeights

STEPS, LR = 50, 0.05
LOSS_RTOL, PARAM_ATOL = 1e-2, 1e-3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batches():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=gen)
    for _ in range(STEPS):
        x = torch.randn(64, 16, generator=gen)
        yield x, torch.tanh(x @ w / 4)


def _loss(model, x, y, dtype):
    return (model(x.to(dtype)).float() - y).square().mean()


def _fp32_reference(skips):
    """Plain fp32 PyTorch, skipping the steps the run under test skipped."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for (x, y), skip in zip(_batches(), skips):
        loss = _loss(model, x, y, torch.float32)
        loss.backward()
        if not skip:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, list(model.parameters())


def _fp16_run(master_weights):
    model = _mlp().half()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    opt = LossScaler(MasterWeights(inner) if master_weights else inner,
                     init_scale=2.0 ** 16, scale_window=4, hysteresis=2)
    losses, skips, scales = [], [], []
    for x, y in _batches():
        loss = _loss(model, x, y, torch.float16)
        opt.backward(loss)
        skips.append(not opt.step())
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(opt.loss_scale)
    return losses, skips, scales, model, opt.param_groups[0]["params"]


def _grad_scaler():
    """torch's own recipe: fp32 params, fp16 autocast, GradScaler."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=4)
    losses, skips = [], []
    for x, y in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, x, y, torch.float32)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skips.append(scaler.get_scale() < before)
        losses.append(loss.item())
    return losses, skips, list(model.parameters())


def test_fp16_master_weights_follow_fp32():
    losses, skips, scales, model, masters = _fp16_run(master_weights=True)
    assert 0 < sum(skips) < STEPS // 2 and max(scales) > 2.0 ** 16  # overflows, growth, mostly steps
    assert all(p.dtype == torch.float16 for p in model.parameters())
    for master, param in zip(masters, model.parameters()):  # the model holds the masters, rounded
        assert master.dtype == torch.float32 and torch.equal(master.detach().half(), param.detach())
    ref_losses, ref_params = _fp32_reference(skips)
    assert ref_losses[-1] < 0.5 * ref_losses[0]  # it learns, so a frozen model would fail
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    for master, ref in zip(masters, ref_params):
        torch.testing.assert_close(master.detach(), ref.detach(), rtol=0, atol=PARAM_ATOL)


def test_torch_grad_scaler_within_the_same_tolerance():
    losses, skips, params = _grad_scaler()
    ref_losses, ref_params = _fp32_reference(skips)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    for param, ref in zip(params, ref_params):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=0, atol=PARAM_ATOL)


def test_without_master_weights_fp16_drifts_further():
    """The reason MasterWeights exists: stepping the fp16 weights directly loses small updates."""
    drifts = []
    for master_weights in (True, False):
        _, skips, _, _, params = _fp16_run(master_weights)
        _, ref_params = _fp32_reference(skips)
        drifts.append(max((p.float() - r).abs().max().item() for p, r in zip(params, ref_params)))
    assert drifts[0] < drifts[1] / 2, drifts
