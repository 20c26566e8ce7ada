"""precision/ across ranks (gloo/CPU): the world-wide skip and the global norm over shards and stages."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run
from pipezero.comm import TRAFFIC
from pipezero.comm import mark_replica
from pipezero.precision import LossScaler, clip_grad_norm, global_grad_norm
from pipezero.topology import Grid

INF = float("inf")


# -- one inf on one rank of 4: every rank skips, nothing moves ------------------------------
def _skip_together(clip, poison):
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank its own "stage" of different parameters
    layer = torch.nn.Linear(4, 3)
    idle = torch.nn.Parameter(torch.zeros(2))  # never gets a gradient (rank 3 has only this)
    params = [idle] if rank == 3 else [*layer.parameters(), idle]
    opt = LossScaler(torch.optim.Adam(params, lr=0.1), init_scale=2.0 ** 8, hysteresis=1,
                     clip_grad_norm=clip)
    x = torch.randn(5, 4)

    def backward(plant):
        if rank != 3:
            opt.backward(layer(x).square().mean())
            if plant:
                layer.weight.grad[1, 2] = poison
    backward(plant=False)
    first = opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in params]
    adam_before = {k: v.clone() for p in params for k, v in opt.inner.state[p].items()}
    backward(plant=(rank == 2))
    TRAFFIC.reset()
    second = opt.step()
    calls = TRAFFIC.snapshot().get("all_reduce", {}).get("calls", 0)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    adam_after = {k: v for p in params for k, v in opt.inner.state[p].items()}
    state_unchanged = all(torch.equal(adam_before[k], adam_after[k]) for k in adam_before)
    opt.zero_grad()
    backward(plant=False)
    third = opt.step()
    return first, second, third, opt.loss_scale, unchanged, state_unchanged, calls


@pytest.mark.parametrize("clip, poison", [(0.0, INF), (0.5, float("nan"))], ids=["fused-check", "norm-check"])
def test_one_poisoned_rank_makes_every_rank_skip(clip, poison):
    results = run(_skip_together, 4, clip, poison)
    for rank, (first, second, third, scale, unchanged, state_unchanged, calls) in enumerate(results):
        assert (first, second, third) == (True, False, True), f"rank {rank}"
        assert scale == 2.0 ** 7, f"rank {rank}: the scale must halve on every rank"
        assert unchanged and state_unchanged, f"rank {rank}: a skipped step changed parameters or Adam state"
        assert calls == 1, f"rank {rank}: {calls} all-reduces in one step, expected one"


def _noop_moves_nothing():
    param = torch.nn.Parameter(torch.ones(3))
    opt = LossScaler(torch.optim.SGD([param], lr=0.5), init_scale=1, dynamic=False)
    param.grad = torch.full((3,), float(dist.get_rank() + 1))
    TRAFFIC.reset()
    stepped = opt.step()
    return stepped, TRAFFIC.snapshot().get("all_reduce", {}).get("calls", 0), param.detach()


def test_bf16_path_needs_no_collective():
    for rank, (stepped, calls, param) in enumerate(run(_noop_moves_nothing, 4)):  # the pool above
        assert stepped and calls == 0
        torch.testing.assert_close(param, torch.full((3,), 1 - 0.5 * (rank + 1)))


# -- global norm over 2 data shards x 2 stages, tied weight counted once ---------------------
V, D, B = 11, 8, 8


def _model():
    torch.manual_seed(0)
    return {"embed": torch.nn.Parameter(torch.randn(V, D)),  # tied: the head is embed.T
            "w1": torch.nn.Parameter(torch.randn(D, D) / 3), "w2": torch.nn.Parameter(torch.randn(D, D) / 3)}


def _loss(params, tokens, targets):
    h = torch.tanh(F.embedding(tokens, params["embed"]) @ params["w1"])  # stage 0: embed, w1
    h = torch.tanh(h @ params["w2"])                                      # stage 1: w2, head (embed)
    return F.cross_entropy(h @ params["embed"].T, targets)


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B,), generator=gen), torch.randint(0, V, (B,), generator=gen)


def _local_tensors(grid, params, layout):
    """What this rank holds, with .grad set: its stage's params, replicated or sharded over data."""
    owned = ["embed", "w1"] if grid.pipe_rank == 0 else ["w2", "embed"]
    tensors = []
    for name in owned:
        grad = params[name].grad
        if layout == "sharded":  # ZeRO-style: data rank r owns a contiguous slice of the flat grad
            flat = grad.flatten()
            half = (flat.numel() + 1) // 2
            part = flat[grid.data_rank * half:(grid.data_rank + 1) * half]
            t = torch.zeros(part.numel())
            t.grad = part.clone()
        else:
            t = torch.zeros_like(grad)
            t.grad = grad.clone()
            if grid.data_rank > 0:
                mark_replica(t)
        if name == "embed" and grid.pipe_rank == 1:  # the tied copy: stage 0 already counts it
            mark_replica(t)
        tensors.append(t)
    return tensors


def _sharded_norm(layout, max_norm):
    grid = Grid(pipe=2, data=2)
    params = _model()
    tokens, targets = _data()
    shard = slice(grid.data_rank * B // 2, (grid.data_rank + 1) * B // 2)
    _loss(params, tokens[shard], targets[shard]).backward()  # the full model's grads on this shard
    for p in params.values():
        dist.all_reduce(p.grad, group=grid.data_group)  # data-parallel mean (the tie sum is in .grad)
        p.grad /= 2
    tensors = _local_tensors(grid, params, layout)
    unclipped = global_grad_norm(tensors)
    norm = clip_grad_norm(tensors, max_norm)
    return unclipped, norm, [t.grad for t in tensors]


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_global_norm_over_data_shards_and_stages_equals_torch(layout):
    max_norm = 0.1
    params = _model()
    _loss(params, *_data()).backward()
    expected = torch.nn.utils.clip_grad_norm_(params.values(), max_norm)
    assert expected > max_norm  # the clip really clips
    reference = _local_tensors  # the same slicing, applied to the clipped single-process grads
    results = run(_sharded_norm, 4, layout, max_norm)
    for rank, (unclipped, norm, grads) in enumerate(results):
        torch.testing.assert_close(unclipped, expected, rtol=1e-5, atol=0)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
        wanted = reference(_FakeGrid(rank), params, layout)
        for got, want in zip(grads, wanted):
            torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-7)


class _FakeGrid:
    """pipe_rank/data_rank of a rank of Grid(pipe=2, data=2) (data varies fastest)."""

    def __init__(self, rank):
        self.pipe_rank, self.data_rank = divmod(rank, 2)
