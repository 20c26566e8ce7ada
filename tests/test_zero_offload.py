"""ZeRO-Offload: parity with and without offload, parameters off the device between uses, DPU.

The step with offload runs bucket by bucket on host masters; it must give exactly the
parameters of the run without offload. Parameter offload (stage 3) must work on a data
group of one too: the compute device then holds only the submodules in use. On CPU the
"device side" is what ParamGatherer holds whole (each bucket's flat buffer); the host side
is the owned slice `local`, a storage of its own.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.precision import LossScaler
from pipezero.zero import ZeroConfig, ZeroOptimizer
from pipezero.zero.offload import HostOffload, host_threads
from test_zero_parity import data, local_batch, make_model, make_opt

STEPS = 6


def _config(stage, **kw):
    return ZeroConfig(stage=stage, stage3_param_persistence_threshold=10, reduce_bucket_size=100, **kw)


def _train(stage, offload, delayed=False, accum=1, scaler=False, every=False):
    """Train STEPS steps; return the losses and the final parameters (whole)."""
    world = dist.get_world_size()
    model = make_model()
    kw = {"reduce_every_microbatch": every}
    if offload:
        kw.update(offload_optimizer=True, offload_param=stage == 3, delayed_param_update=delayed)
    inner = make_opt(model, "adamw2")
    if scaler:
        inner = LossScaler(inner, init_scale=2.0 ** 4, dynamic=True)
    opt = ZeroOptimizer(inner, module=model, config=_config(stage, **kw))
    losses = []
    for step in range(STEPS):
        x, y = local_batch(world, step)
        opt.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with opt.no_sync() if i < accum - 1 else _null():
                loss = nn.functional.mse_loss(model(xs), ys) / accum
                opt.backward(loss)
            losses.append(loss.detach().clone())
        opt.step()
    opt.apply_delayed_update()
    with opt.gathered_parameters():
        return losses, [p.detach().clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world,stage,accum", [(1, 3, 1), (2, 1, 2), (2, 3, 2)])
def test_offload_adds_no_difference(world, stage, accum):
    plain = run(_train, world, stage, False, False, accum)
    offloaded = run(_train, world, stage, True, False, accum)
    for (loss_a, a), (loss_b, b) in zip(plain, offloaded):
        torch.testing.assert_close(torch.stack(loss_a), torch.stack(loss_b), rtol=0, atol=0)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- parameters leave the compute device between uses ------------------------------------------
def _residency(prefetch):
    """Watch what the gatherer holds whole while each unit runs and between steps."""
    world = dist.get_world_size()
    model = make_model()
    cfg = _config(3, offload_optimizer=True, offload_param=True, stage3_prefetch_bucket_size=prefetch)
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model, config=cfg)
    gatherer = opt._gatherer
    during: list[int] = []
    for unit in model:
        unit.register_forward_pre_hook(lambda m, a: during.append(gatherer.resident_numel()))
    between = []
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        between.append((gatherer.resident_numel(), sum(p.numel() for b in gatherer.partitioned for p in b.params)))
    host = {b.local.untyped_storage().data_ptr() for b in gatherer.partitioned}
    return (during, between, sum(b.padded for b in gatherer.partitioned),
            len(host) == len(gatherer.partitioned), max(b.padded for b in gatherer.partitioned))


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_parameters_leave_the_device_between_uses(world):
    for during, between, total, own_storage, largest in run(_residency, world, 0):
        assert total > 0 and own_storage              # every partitioned bucket lives on the host
        assert between == [(0, 0)] * 3                # between steps nothing is whole on the device
        assert 0 < max(during) <= largest < total     # while a unit runs, only that unit is whole


def test_prefetch_keeps_the_working_set_bounded():
    during, between, total, _, largest = run(_residency, 1, 200)[0]
    assert between == [(0, 0)] * 3
    assert max(during) <= largest + 200 < total       # the unit in use plus the prefetch window


# -- delayed parameter update ---------------------------------------------------------------
def _delayed_reference(world, accum=1):
    """Plain PyTorch: step k applies the update from step k-1's gradients; the last one at the end."""
    model = make_model()
    opt = make_opt(model, "adamw2")
    params = list(model.parameters())
    losses, pending = [], None
    for step in range(STEPS):
        x, y = data(world, step)
        model.zero_grad()
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            loss = nn.functional.mse_loss(model(xs), ys) / accum
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad.clone() for p in params]
        if pending is not None:
            _apply(opt, params, pending)
        pending = grads
    _apply(opt, params, pending)
    return losses, [p.detach() for p in params]


def _apply(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


@pytest.mark.parametrize("world,stage", [(1, 3), (2, 2)])
def test_delayed_update_applies_the_previous_steps_gradients(world, stage):
    _, truth = _delayed_reference(world)
    results = run(_train, world, stage, True, True)
    plain = run(_train, world, stage, True, False)
    for (_, got), (_, undelayed) in zip(results, plain):
        for a, t in zip(got, truth, strict=True):
            torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(got, undelayed))   # really delayed
    if world == 1:  # one process: the losses are the reference's too (each forward saw those weights)
        ref_losses, _ = _delayed_reference(1)
        torch.testing.assert_close(torch.stack(results[0][0]), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)


def test_delayed_update_sums_microbatches_on_the_host():
    """Every micro-batch's shard is summed on the host while the previous update still runs."""
    _, truth = _delayed_reference(2, accum=2)
    for _, got in run(_train, 2, 3, True, True, 2, every=True):
        for a, t in zip(got, truth, strict=True):
            torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)


def test_delayed_update_through_a_loss_scaler():
    """The unscale and the overflow check run at step(); only the element-wise update is deferred."""
    _, truth = _delayed_reference(2)
    for _, got in run(_train, 2, 1, True, True, 1, True):
        for a, t in zip(got, truth, strict=True):
            torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)


def test_delayed_update_needs_offload():
    with pytest.raises(ValueError, match="delayed_param_update=True, offload_optimizer=False"):
        ZeroConfig(stage=2, delayed_param_update=True)


def test_host_threads_split_the_cores_over_local_processes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = host_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads() == max(1, alone // 2)


# -- on a GPU: the streams, pinned buffers and host sums (skipped on CPU-only CI) ---------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_train(stage, offload, delayed=False, dtype=torch.float32, every=False, accum=2):
    """One process, no process group, model on the GPU."""
    model = make_model(dtype).cuda()
    cfg = _config(stage, offload_optimizer=offload, offload_param=offload and stage == 3,
                  delayed_param_update=delayed, reduce_every_microbatch=every)
    opt = ZeroOptimizer(make_opt(model, "adamw2"), module=model, config=cfg)
    for step in range(STEPS):
        x, y = (t.cuda() for t in data(1, step))
        opt.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with opt.no_sync() if i < accum - 1 else _null():
                opt.backward(nn.functional.mse_loss(model(xs.to(dtype)).float(), ys) / accum)
        opt.step()
    opt.apply_delayed_update()
    with opt.gathered_parameters():
        return [p.detach().float().cpu() for p in model.parameters()]


@cuda
@pytest.mark.parametrize("stage,every", [(1, False), (2, True), (3, False), (3, True)])
def test_cuda_offload_matches_the_device_step(stage, every):
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        plain = _cuda_train(stage, False, dtype=dtype, every=every)
        offloaded = _cuda_train(stage, True, dtype=dtype, every=every)
        for a, b in zip(plain, offloaded, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=tol)


@cuda
@pytest.mark.parametrize("stage", [1, 3])
def test_cuda_delayed_update(stage):
    _, truth = _delayed_reference(1, accum=2)
    for a, t in zip(_cuda_train(stage, True, delayed=True), truth, strict=True):
        torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)


@cuda
def test_cuda_parameters_live_on_the_host_between_uses():
    torch.manual_seed(0)
    warm = nn.Linear(256, 256).cuda()   # cuBLAS takes its workspaces from the caching allocator: count them out
    warm(torch.randn(8, 256, device="cuda")).square().mean().backward()
    del warm
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = _config(3, offload_optimizer=True, offload_param=True, stage3_prefetch_bucket_size=0)
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model, config=cfg)
    peaks = []
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(8, 256, device="cuda")
        opt.backward(model(x).square().mean())
        opt.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.memory_allocated() - baseline)
    assert all(b.local.is_pinned() and b.master.is_pinned() for b in opt._gatherer.partitioned)
    assert max(peaks) < whole / 4, (peaks, whole)   # less than one layer's weights stays on the GPU


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward keeps the GPU busy (~25 ms): the gradients after it land late."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(50_000_000)
        return grad


class _Slow(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


@cuda
@pytest.mark.parametrize("stage,link", [(1, False), (1, True), (3, False)])
def test_cuda_streamed_step_waits_for_each_gradient(stage, link, monkeypatch):
    """Over torch's optimizer directly, step() hands the gradients over while their copies (and,
    at stage 3, their host folds) are still under way and steps each bucket once its own has
    finished; under a loss scaler (a link that reads the gradients first) it waits for all of
    them. The GPU is held back before the first layer's gradients, so a bucket stepped without
    waiting would read a buffer not yet written and the parameters would differ from the device
    step."""
    streamed = []
    original = HostOffload.hand_over
    monkeypatch.setattr(HostOffload, "hand_over", lambda self, b: (streamed.append(self._streaming),
                                                                   original(self, b))[1])

    def train(offload):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), _Slow(), *[nn.Linear(512, 512) for _ in range(3)]).cuda()
        inner = make_opt(model, "adamw2")
        inner = LossScaler(inner, init_scale=1.0, dynamic=False) if link else inner
        cfg = _config(stage, offload_optimizer=offload, offload_param=offload and stage == 3)
        opt = ZeroOptimizer(inner, module=model, config=cfg)
        for step in range(3):
            opt.zero_grad()
            for i in range(2):
                with opt.no_sync() if i == 0 else _null():
                    opt.backward(model(torch.randn(8, 512, device="cuda")).square().mean())
            opt.step()
        with opt.gathered_parameters():
            return [p.detach().cpu() for p in model.parameters()]

    plain = train(False)
    for a, b in zip(plain, train(True), strict=True):   # the host's Adam rounds apart from the GPU's
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert streamed and all(s is not link for s in streamed), streamed
