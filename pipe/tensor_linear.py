"""Column- and row-parallel nn.Linear on plain local tensors, the collectives explicit.

Megatron-LM's split (Shoeybi et al. 2019), without DTensor: the weight shard is an ordinary
nn.Parameter holding this tensor rank's rows (column-parallel) or columns (row-parallel),
marked with a comm.TensorShard so checkpoints and the optimizer know the whole tensor. The
module itself is untouched (its class, forward and names stay; DeferringLinear and compile
see a plain Linear); two hooks put the communication around it:

* column-parallel: the input passes `_ToTensorGroup` (identity forward, all-reduce of the
  input gradient backward: every rank's rows contribute to it); the output stays this rank's
  slice of the features, as ColwiseParallel's local output; a layer's column-parallel Linears
  that read the same tensor (q/k/v, gate/up) share one such node (`SharedInput`): one
  all-reduce of their summed input gradient;
* row-parallel: the input is already this rank's slice of the features; the output is
  all-reduced in place (its gradient is the identity, so no autograd node is needed: the
  Linear's own output is fresh and nothing saved it; a view, which DeferringLinear's node
  returns, goes through `_FromTensorGroup` instead). The bias is whole on every rank and the
  Linear adds it on each, so the sum holds it `degree` times: the reduce takes the extra
  copies off (as a constant, so the bias gradient stays the Linear's own, whole).

DTensor runs ~30 operators per Linear through its dispatcher; here a Linear costs one hook
more than the plain one, and a column-parallel input one small autograd node
(bench/tp_dispatch.py measures both). On a group of one (a one-rank mesh, as the benchmarks
and the planner split a block) the all-reduces are skipped, as Megatron-LM does: they would
sum one tensor.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from pipezero.comm import TensorShard, mark_tensor_shard

__all__ = ["SharedInput", "shard_columns", "shard_rows"]


class _ToTensorGroup(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the tensor group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, degree: int) -> torch.Tensor:
        ctx.group, ctx.degree = group, degree
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.degree > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def _reduce_output(y: torch.Tensor, bias: torch.Tensor | None, extra: int, group) -> torch.Tensor:
    """A row-parallel Linear's output summed over the tensor group (less `extra` copies of the bias).

    The sum's gradient is the identity, so a fresh output (a plain Linear's) is reduced in place
    outside autograd: no node, nothing saved it. A view (DeferringLinear's node returns one)
    cannot be changed in place and goes through `_FromTensorGroup`, which reduces a copy; so does a
    traced one (a compiled layer), out of place there.
    """
    if not extra:  # a group of one (the benchmarks' one-rank mesh): nothing to sum
        return y
    if torch.compiler.is_compiling() or not y.is_contiguous() or y._base is not None:
        return _FromTensorGroup.apply(y, bias, extra, group)
    with torch.no_grad():
        _sum_less_bias(y, bias, extra, group)
    return y


def _sum_less_bias(y: torch.Tensor, bias: torch.Tensor | None, extra: int, group) -> None:
    dist.all_reduce(y, group=group)
    if bias is not None:
        y.sub_(bias.to(y.dtype), alpha=extra)


class _FromTensorGroup(torch.autograd.Function):
    """All-reduce forward of a copy (less `extra` copies of the bias); identity backward.

    Traced, the sum is a functional all-reduce: torch 2.11 traced the in-place one on the copy into an
    all-zero gradient for every parameter before it (tests/test_tensor_parallel.py's compiled case).
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor | None, extra: int, group) -> torch.Tensor:
        if torch.compiler.is_compiling():
            summed = funcol.all_reduce(y, "sum", group)
            return summed - bias.to(summed.dtype) * extra if bias is not None else summed
        y = y.clone(memory_format=torch.contiguous_format)
        _sum_less_bias(y, bias, extra, group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


def _shard(module: nn.Module, name: str, dim: int, group, degree: int, rank: int) -> None:
    """Replace module.<name> by its part `rank` of `degree` along `dim`, a plain marked nn.Parameter."""
    whole = getattr(module, name)
    part = nn.Parameter(whole.detach().chunk(degree, dim=dim)[rank].clone(), requires_grad=whole.requires_grad)
    mark_tensor_shard(part, TensorShard(dim, degree, rank, whole.shape, group))
    setattr(module, name, part)


class SharedInput:
    """One `_ToTensorGroup` node for the column-parallel Linears of a layer that read the same tensor.

    q/k/v (or gate/up) read one input: each would all-reduce its own part of the input
    gradient; through one node autograd sums the parts first and one all-reduce moves them
    (the all-reduce is linear). Weak references: the cache keeps no activation alive.
    """

    def __init__(self, group, degree: int) -> None:
        self.group, self.degree = group, degree
        self._x: weakref.ref | None = None
        self._y: weakref.ref | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return _ToTensorGroup.apply(x, self.group, self.degree)
        y = self._y() if self._x is not None and self._x() is x else None
        if y is None:
            y = _ToTensorGroup.apply(x, self.group, self.degree)
            self._x, self._y = weakref.ref(x), weakref.ref(y)
        return y


def shard_columns(linear: nn.Linear, group, degree: int, rank: int, shared: SharedInput | None = None) -> None:
    """Make `linear` column-parallel in place: its output features split `degree` ways
    (`shared`: the node its layer's other column-parallel Linears use for the same input)."""
    _shard(linear, "weight", 0, group, degree, rank)
    if linear.bias is not None:
        _shard(linear, "bias", 0, group, degree, rank)
    linear.out_features //= degree
    to_group = shared if shared is not None else SharedInput(group, degree)

    def pre_hook(_module: nn.Module, args: tuple) -> tuple:
        return (to_group(args[0]),) + args[1:]
    linear.register_forward_pre_hook(pre_hook)


def shard_rows(linear: nn.Linear, group, degree: int, rank: int) -> None:
    """Make `linear` row-parallel in place: its input features split `degree` ways, the output summed."""
    _shard(linear, "weight", 1, group, degree, rank)
    linear.in_features //= degree

    def from_group(module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        bias = module.bias
        return _reduce_output(out, None if bias is None else bias.detach(), degree - 1, group)
    linear.register_forward_hook(from_group)
