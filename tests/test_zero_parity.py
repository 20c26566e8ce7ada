"""ZeroOptimizer stages 0-3 against single-process training on the concatenated batch (fp32).

Every data rank trains on its slice of the batch; averaged gradients equal the full-batch
mean gradient, so after the same steps every rank's parameters must equal one process
training plain PyTorch on the whole batch.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.zero import ZeroConfig, ZeroOptimizer

STEPS = 10
BATCH = 8  # per data rank... times the world size for the whole batch


def make_model(dtype=torch.float32, frozen=False, tied=False) -> nn.Module:
    """Widths 8-16 and a 7-element bias (does not divide 2 or 4 ranks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 7),
                          nn.Tanh(), nn.Linear(7, 8))
    if frozen:
        model[2].requires_grad_(False)
    if tied:
        model[6].weight = nn.Parameter(model[0].weight.detach().t().contiguous()[:8, :7].clone())
    return model.to(dtype)


class Tied(nn.Module):
    """An embedding and an output head that share one weight (as GPT does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x)))).sum(-1, keepdim=True)


def make_opt(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters()]
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "adamw2":
        decay = [p for p in params if p.dim() > 1]
        no_decay = [p for p in params if p.dim() <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    raise ValueError(kind)


def data(world: int, step: int, tied: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    if tied:
        x = torch.randint(0, 11, (BATCH * world, 3), generator=g)
        return x, torch.randn(BATCH * world, 3, 1, generator=g)
    return torch.randn(BATCH * world, 8, generator=g), torch.randn(BATCH * world, 8, generator=g)


def reference(kind: str, world: int, steps: int = STEPS, build=make_model, tied=False, accum=1) -> list:
    """One process, plain PyTorch, the whole batch."""
    model = build()
    opt = make_opt(model, kind)
    for step in range(steps):
        x, y = data(world, step, tied)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            (nn.functional.mse_loss(model(xs), ys) / accum).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def local_batch(world: int, step: int, tied: bool = False):
    x, y = data(world, step, tied)
    r = dist.get_rank()
    return x.chunk(world)[r], y.chunk(world)[r]


def train_zero(kind: str, stage: int, steps: int = STEPS, build=make_model, tied=False, accum=1,
               sync_each=False, **kw) -> list:
    """The same training under ZeroOptimizer; returns the final (gathered) parameters."""
    world = dist.get_world_size()
    model = build()
    if stage == 3:  # weights partitioned, biases (< 10 elements) persistent
        kw.setdefault("config", ZeroConfig(stage=3, stage3_param_persistence_threshold=10))
    opt = ZeroOptimizer(make_opt(model, kind), stage=stage, module=model if stage == 3 else None, **kw)
    for step in range(steps):
        x, y = local_batch(world, step, tied)
        opt.zero_grad()
        for m, (xs, ys) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            ctx = opt.no_sync() if m < accum - 1 and not sync_each else _null()
            with ctx:
                opt.backward(nn.functional.mse_loss(model(xs), ys) / accum)
        assert opt.step() is True
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _all_kinds(stage: int) -> dict:
    return {kind: train_zero(kind, stage) for kind in ("adam", "adamw2", "sgd")}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_fp32(stage, world):
    results = run(_all_kinds, world, stage)
    for kind in ("adam", "adamw2", "sgd"):
        want = reference(kind, world)
        for rank, per_kind in enumerate(results):
            for a, b in zip(per_kind[kind], want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"stage {stage} {kind} rank {rank}: {m}")
