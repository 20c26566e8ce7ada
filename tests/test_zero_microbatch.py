"""ZeRO-2 reducing every micro-batch (ZeroConfig.reduce_every_microbatch): parity and memory.

With the option, each backward's gradients are reduce-scattered into the rank's gradient
shard even inside no_sync or a pipeline hold, so no whole gradient is kept between
micro-batches. fp32 parity against single-process training with gradient accumulation, a
2-stage pipeline with a tied embedding at pipe 2 x data 2, and live-tensor counts.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.comm import TRAFFIC
from pipezero.pipe import PipelineModule, PipelineRunner
from pipezero.topology import Grid
from pipezero.zero import ZeroConfig, ZeroOptimizer
from test_pipe_runner import assert_parity, batch, loss_fn, make_schedule, specs
from test_zero_parity import data, local_batch, make_model, make_opt, reference

ACCUM = 4


def _config(stage: int, every: bool) -> ZeroConfig:
    return ZeroConfig(stage=stage, reduce_every_microbatch=every, reduce_bucket_size=200,
                      stage3_param_persistence_threshold=10)


# -- parity with accumulation ----------------------------------------------------------------
def _accumulate(stage: int, kind: str, hold: bool) -> tuple:
    """Accumulate 4 micro-batches per step under no_sync (or the runner's hold/release)."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, kind), module=model if stage == 3 else None, config=_config(stage, True))
    params = list(model.parameters())
    calls = []
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        TRAFFIC.reset()
        if hold:
            opt.hold_grad_sync(params)
        for m, (xs, ys) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM))):
            last = m == ACCUM - 1
            if hold and last:
                opt.release_grad_sync(params)
            with opt.no_sync() if not (hold or last) else _Null():
                opt.backward(nn.functional.mse_loss(model(xs), ys) / ACCUM)
        if hold:
            opt.flush_grad_sync(params)
        assert opt.step() is True
        calls.append(TRAFFIC.snapshot().get("reduce_scatter", {}).get("calls", 0))
    with opt.gathered_parameters():
        return [p.detach().clone() for p in params], calls, len(opt.buckets)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world, stage, kind, hold", [
    (2, 2, "adam", False),
    (4, 2, "adamw2", True),    # two param groups, the pipeline runner's readiness protocol
    (2, 3, "sgd", False),
])
def test_accumulation_parity(world, stage, kind, hold):
    want = reference(kind, world, steps=3, accum=ACCUM)
    for rank, (got, calls, buckets) in enumerate(run(_accumulate, world, stage, kind, hold)):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        # every micro-batch reduced every bucket, not only the last one
        assert all(c == ACCUM * buckets for c in calls), (calls, buckets)


class Sometimes(nn.Module):
    """make_model's net plus a layer used only on even forward calls (as an MoE expert may
    sit out a micro-batch): its bucket is incomplete after an odd micro-batch."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.extra = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.net(x) + (self.extra(x) if self.calls % 2 else 0)


def _sometimes() -> list:
    world = dist.get_world_size()
    model = Sometimes()
    opt = ZeroOptimizer(make_opt(model, "sgd"), config=_config(2, True))
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        for m, (xs, ys) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM))):
            with opt.no_sync() if m < ACCUM - 1 else _Null():
                opt.backward(nn.functional.mse_loss(model(xs), ys) / ACCUM)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sometimes_reference(world: int) -> list:
    """One process; micro-batch m is every rank's micro-batch m together (the extra layer
    sees the same samples as in the distributed run)."""
    model = Sometimes()
    opt = make_opt(model, "sgd")
    for step in range(3):
        x, y = data(world, step)
        xs, ys = ([part.chunk(ACCUM) for part in t.chunk(world)] for t in (x, y))
        opt.zero_grad()
        for m in range(ACCUM):
            mb_x, mb_y = torch.cat([r[m] for r in xs]), torch.cat([r[m] for r in ys])
            (nn.functional.mse_loss(model(mb_x), mb_y) / ACCUM).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_parameter_missing_from_some_microbatches():
    """Gradients pushed twice into a bucket not yet reduced (the layer beside them sat out a
    micro-batch) add up rather than overwrite."""
    want = _sometimes_reference(2)
    for got in run(_sometimes, 2):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- memory: no whole gradient between micro-batches -----------------------------------------
def _live_after_first_microbatch(every: bool, hold: bool) -> tuple[int, int, int]:
    """(params with a live .grad, live full bucket buffers, params) after a non-final backward."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), config=_config(2, every))
    params = list(model.parameters())
    x, y = local_batch(world, 0)
    if hold:
        opt.hold_grad_sync(params)
    with opt.no_sync() if not hold else _Null():
        opt.backward(nn.functional.mse_loss(model(x), y))
    opt.wait_grad_sync()
    grads = sum(p.grad is not None for p in params)
    buffers = sum(st.grad is not None for st in opt._sync._state.values())
    return grads, buffers, len(params)


@pytest.mark.parametrize("hold", [False, True])
def test_no_whole_gradient_between_microbatches(hold):
    for grads, buffers, n in run(_live_after_first_microbatch, 2, True, hold):
        assert (grads, buffers) == (0, 0)
    for grads, buffers, n in run(_live_after_first_microbatch, 2, False, hold):
        assert grads == n  # the default holds whole gradients until the final micro-batch


# -- gradients assigned without hooks (torch's split weight backward) ---------------------------
def _assigned_grads() -> tuple:
    """Non-final micro-batches set .grad by hand, then collect_grad_sync reduces them."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), config=_config(2, True))
    params = list(model.parameters())
    live = []
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        opt.hold_grad_sync(params)
        for m, (xs, ys) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM))):
            loss = nn.functional.mse_loss(model(xs), ys) / ACCUM
            if m == ACCUM - 1:
                opt.release_grad_sync(params)
                opt.backward(loss)
                continue
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g if p.grad is None else p.grad + g
            opt.collect_grad_sync(params)
            live.append(sum(p.grad is not None for p in params))
        opt.flush_grad_sync(params)
        assert opt.step() is True
    return [p.detach().clone() for p in params], live


def test_collect_assigned_grads():
    want = reference("adam", 2, steps=3, accum=ACCUM)
    for rank, (got, live) in enumerate(run(_assigned_grads, 2)):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        assert set(live) == {0}, live


# -- a 2-stage pipeline with a tied embedding, pipe 2 x data 2 --------------------------------
def _pipeline(name: str, m: int, blocks: int, steps: int, size: int, lr: float, seqs: list) -> tuple:
    grid = Grid(pipe=2)
    sched = make_schedule(name, m)
    model = PipelineModule(specs(blocks), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=lr), group=grid.data_group,
                        config=ZeroConfig(stage=2, reduce_every_microbatch=True, reduce_bucket_size=64))
    runner = PipelineRunner(model, sched, optimizer=opt)
    losses, share, calls = [], size // grid.data_size, []
    for step in range(steps):
        ids, targets = batch(step, size, seqs[step])
        mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)
        TRAFFIC.reset()
        losses.append(runner.train_step(ids[mine], targets[mine]).item())
        assert opt.step() is True
        calls.append(TRAFFIC.snapshot().get("reduce_scatter", {}).get("calls", 0))
        opt.zero_grad()
    return (losses, {n: p.detach().clone() for n, p in model.named_parameters()}), calls, len(opt.buckets)


@pytest.mark.parametrize("name", ["OneFOneB", "ZeroBubbleH1"])
def test_pipeline_tied_parity(name):
    steps, size, blocks, lr, seqs, m = 3, 8, 2, 0.01, [4, 6, 3], 4
    results = run(_pipeline, 4, name, m, blocks, steps, size, lr, seqs, timeout=120)
    assert_parity([r for r, _, _ in results], blocks, steps, size, lr, "adam", seqs)
    if name == "ZeroBubbleH1":  # torch's split weight backward sets .grad without hooks: reduced at flush
        return
    for _, calls, buckets in results:  # micro-batches reduced while held: more calls than buckets
        assert all(c > buckets for c in calls), (calls, buckets)


def _two_train_steps(stage: int, every: bool, name: str) -> list:
    """Master gradients after one train_step and after two of the same batch before one step."""
    grid = Grid(pipe=2)
    out = []
    for repeats in (1, 2):
        sched = make_schedule(name, 4)
        model = PipelineModule(specs(2), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                               placement=sched.placement)
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group=grid.data_group,
                            config=ZeroConfig(stage=stage, reduce_every_microbatch=every, reduce_bucket_size=100))
        runner = PipelineRunner(model, sched, optimizer=opt)
        ids, targets = batch(0, 8)
        mine = slice(grid.data_rank * 4, (grid.data_rank + 1) * 4)
        for _ in range(repeats):
            runner.train_step(ids[mine], targets[mine])
        opt.prepare_grads()
        out.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
    return out


@pytest.mark.parametrize("stage, every, name", [(0, False, "OneFOneB"), (1, False, "OneFOneB"),
                                               (2, False, "OneFOneB"), (2, True, "OneFOneB"),
                                               (0, False, "ZeroBubbleH1"), (1, False, "ZeroBubbleH1")])
def test_two_train_steps_before_one_step_add_up(stage, every, name):
    """The tied embedding's gradient too (stage 0 added it to an average still in flight, stages 1-2
    dropped it: its bucket's earlier reduction was still under way at flush); and the Linear weights
    whose W assigns .grad without hooks (no hook completed their bucket's earlier reduction either)."""
    for once, twice in run(_two_train_steps, 4, stage, every, name):
        for a, b in zip(once, twice, strict=True):
            torch.testing.assert_close(b, 2 * a, rtol=1e-6, atol=1e-6)


# -- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, error", [
    (dict(stage=1, reduce_every_microbatch=True), ValueError),
    (dict(stage=2, reduce_every_microbatch=1), TypeError),
])
def test_bad_config(kw, error):
    with pytest.raises(error, match="reduce_every_microbatch"):
        ZeroConfig(**kw)
