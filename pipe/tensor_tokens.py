"""A block run on this tensor rank's share of the tokens: a MoE block beside a tensor split.

Megatron-core's layout for experts beside a tensor axis (attention and the MoE layer parallelised
apart: Liu et al. 2025, MoE Parallel Folding, arXiv 2504.14960): attention is split by heads
(pipe/tensor_parallel.py), so after its all-reduce every tensor rank holds the same hidden
states; the MoE block is not split by weights but by tokens. `SplitTokens`, a ParallelStyle
for the block, puts two autograd nodes around it:

* in: the block's input rows (batch x sequence flattened) padded with zero rows to a multiple
  of the tensor degree, and this rank's contiguous 1/t of them taken (`_Share`: backward, the
  ranks' row gradients all-gathered, so every rank holds the whole gradient of the replicated
  input);
* out: the ranks' output rows all-gathered and the padding dropped (`_Gather`: backward, this
  rank's rows of the whole gradient, which is the same on every rank: no reduce-scatter, which
  would count it `degree` times).

The block's parameters (router, whole experts, shared experts) stay whole on every rank and see
this rank's tokens only, so their gradients are summed over the tensor group, as a per-head norm's
(ReplicateOnShards), in every micro-batch's backward; the block's plain Linears (a shared expert's)
keep their weight gradient in the ordinary backward, where that sum runs (EagerLinear: a split
schedule's W would skip it). Experts split over an expert axis (pipe/expert/) are new parameters
made after the plan: they are summed over the tensor group by their reduction group instead, once
a step (pipe/expert/groups.py); at expert 1 the hooks sum every expert's gradient every micro-batch.
The padded rows reach the router and the experts but not the output; a routed model's
load-balancing sums skip them (`TokenShare.row_weights`) and add the ranks' sums up
(`sum_over_tensor`, pipe/hf/layers.py).
Padding rather than refusing: a microbatch of b x s rows need not divide by t.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from pipezero.comm import all_gather, all_reduce
from pipezero.pipe.deferred_linear import EagerLinear
from pipezero.pipe.tensor_parallel import ReplicateOnShards

__all__ = ["SplitTokens", "TokenShare", "sum_over_tensor", "token_share"]

_SHARES: "weakref.WeakKeyDictionary[nn.Module, TokenShare]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class TokenShare:
    """Rank `rank` of a tensor group of `degree` runs a block on its share of the rows."""

    group: Any
    degree: int
    rank: int

    def padded(self, rows: int) -> int:
        """The rows once padded to a multiple of the degree."""
        return rows + (-rows) % self.degree

    def bounds(self, rows: int) -> tuple[int, int]:
        """[first, last) of this rank's rows among the padded ones."""
        each = self.padded(rows) // self.degree
        return self.rank * each, (self.rank + 1) * each

    def row_weights(self, padding: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
        """The weight of each of this rank's rows in the router's sums: the padding mask's (1 = token)
        with 0 for the padded rows; None where every row counts (no mask, no padded row)."""
        if padding is None and self.padded(rows) == rows:
            return None
        flat = torch.ones(rows, device=device) if padding is None else padding.reshape(-1).to(device).float()
        flat = torch.cat([flat, flat.new_zeros(self.padded(rows) - rows)])
        first, last = self.bounds(rows)
        return flat[first:last]


def token_share(module: nn.Module) -> TokenShare | None:
    """The TokenShare SplitTokens gave `module`, None when it runs on every token."""
    return _SHARES.get(module)


class SplitTokens(ParallelStyle):
    """A block whole on every tensor rank, run on the rank's share of its input rows (module docstring).

    The block takes hidden states [..., d] and returns them (or a tuple whose first element they are,
    the rest passed on as they come: Llama 4's router logits, which its layer drops).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        share = TokenShare(device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank())
        if share.degree == 1:
            return module
        for m in module.modules():
            if type(m) is nn.Linear:  # its weight gradient in the ordinary backward, where the sum hooks run
                m.__class__ = EagerLinear
        ReplicateOnShards()._apply(module, device_mesh)
        shapes: list[torch.Size] = []  # the input's shape, from the pre-hook to the hook of the same call
        module.register_forward_pre_hook(lambda m, args: _share_input(share, shapes, args))
        module.register_forward_hook(lambda m, args, out: _gather_output(share, shapes.pop(), out))
        _SHARES[module] = share
        return module


def _share_input(share: TokenShare, shapes: list[torch.Size], args: tuple) -> tuple:
    hidden, *rest = args
    shapes.append(hidden.shape)
    rows = hidden.reshape(-1, hidden.shape[-1])
    return (_Share.apply(rows, share).unsqueeze(0), *rest)


def _gather_output(share: TokenShare, shape: torch.Size, out: Any) -> Any:
    first = out[0] if isinstance(out, tuple) else out
    whole = _Gather.apply(first.reshape(-1, first.shape[-1]), share)[:shape[:-1].numel()].reshape(shape)
    return (whole, *out[1:]) if isinstance(out, tuple) else whole


class _Share(torch.autograd.Function):
    """rows [N, d] -> this rank's rows of them padded to a multiple of the degree; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, share: TokenShare) -> torch.Tensor:
        ctx.share, ctx.rows = share, rows.shape[0]
        first, last = share.bounds(rows.shape[0])
        extra = share.padded(rows.shape[0]) - rows.shape[0]
        if extra:
            rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
        return rows[first:last].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.share)[:ctx.rows], None


class _Gather(torch.autograd.Function):
    """Each rank's rows [n, d] -> every rank's, in rank order [degree n, d]; backward: this rank's rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, share: TokenShare) -> torch.Tensor:
        ctx.share, ctx.rows = share, rows.shape[0]
        return _all_gather(rows, share)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        start = ctx.share.rank * ctx.rows
        return grad[start:start + ctx.rows].contiguous(), None


@torch.compiler.disable
def _all_gather(rows: torch.Tensor, share: TokenShare) -> torch.Tensor:
    out = rows.new_empty((share.degree * rows.shape[0], *rows.shape[1:]))
    all_gather(out, rows.contiguous(), group=share.group)
    return out


class _SumOverTensor(torch.autograd.Function):
    """The sum over the tensor group; backward: the identity (every rank's loss reads the same sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.detach().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


@torch.compiler.disable
def sum_over_tensor(x: torch.Tensor, share: TokenShare) -> torch.Tensor:
    """The sum over the tensor group of what each rank computed on its share of the rows (a router's
    load-balancing sums), differentiable; the tensor ranks' losses are one loss, so its gradient is
    each rank's own, not summed again."""
    return _SumOverTensor.apply(x, share.group)
