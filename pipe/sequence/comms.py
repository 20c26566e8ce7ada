"""The all-to-alls of Ulysses attention: sequence shards <-> head shards, differentiable.

Each rank of the sequence group holds a contiguous slice of the sequence with every head;
attention needs the whole sequence for some heads. One all-to-all trades them: rank r sends
its slice of head group j to rank j and receives slice i of head group r from rank i, so,
concatenated in rank order, it holds the whole sequence of its own heads (Jacobs et al. 2023,
DeepSpeed-Ulysses, arXiv 2309.14509). With equal splits an all-to-all is its own inverse, so
the backward of each exchange is the same exchange of the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "gather_sequence", "heads_to_sequence", "sequence_to_heads", "sum_over_sequence"]


class _AllToAll(torch.autograd.Function):
    """Dim 0 split in `degree` equal parts, part j to rank j; backward: the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


@torch.compiler.disable  # a compiled layer (pipe/compile.py) runs the exchange eagerly, a graph break
def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [degree, ...]: part j goes to rank j; the result's part i came from rank i (autograd-aware)."""
    return _AllToAll.apply(x, group)


def sequence_to_heads(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[b, heads, s_local, d] (this rank's slice of the sequence, every head) ->
    [b, heads / degree, s, d] (the whole sequence, this rank's heads)."""
    b, heads, s_local, d = x.shape
    parts = x.reshape(b, degree, heads // degree, s_local, d).transpose(0, 1)  # [degree, b, h_l, s_l, d]
    got = all_to_all(parts, group)                                          # part i: sequence slice i
    return got.permute(1, 2, 0, 3, 4).reshape(b, heads // degree, degree * s_local, d)


def heads_to_sequence(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[b, s, heads_local, d] (attention's output, whole sequence, this rank's heads) ->
    [b, s / degree, heads_local * degree, d] (this rank's slice of the sequence, every head)."""
    b, s, heads_local, d = x.shape
    parts = x.reshape(b, degree, s // degree, heads_local, d).transpose(0, 1)  # [degree, b, s_l, h_l, d]
    got = all_to_all(parts, group)                                          # part i: head group i
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // degree, degree * heads_local, d)


class _SumOver(torch.autograd.Function):
    """Every rank's x summed over the group; backward: every rank's gradient of the sum, summed too
    (each rank's loss reads the same total, so each x reaches every rank's loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@torch.compiler.disable
def sum_over_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the sequence group of a tensor each rank computed on its slice (a MoE router's
    running sums: pipe/hf/router.py), differentiable."""
    return _SumOver.apply(x, group)


@torch.compiler.disable
def gather_sequence(x: torch.Tensor, group, degree: int, dim: int = 1) -> torch.Tensor:
    """The whole of a tensor every rank holds a slice of along `dim` (no gradient: positions, masks)."""
    parts = [torch.empty_like(x) for _ in range(degree)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
