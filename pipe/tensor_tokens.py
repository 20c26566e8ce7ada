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

The block's parameters (router, whole experts, shared experts, LoRA adapters inside) stay whole on
every rank and see this rank's tokens only: each rank's gradient is its share, the model's is the sum
over the tensor group. No hook sums it in the backward; the optimizer's reduction does, once a step,
over a group holding the tensor ranks, as it reduces split experts (comm.mark_partial_grad marks them;
ZeroOptimizer refuses a param group reducing them over fewer ranks). Where each kind goes
(pipe/expert/groups.py, `expert_param_groups`), each divided by data x expert x sequence:
* expert 1: router, experts and shared experts in one group over data x sequence x tensor
  (grid.expert_data_group, every rank holding the same, whole, experts);
* expert > 1: the split experts over data x sequence x tensor as before (the ranks holding the same
  experts), the router and shared experts, dense parameters, over data x expert x sequence x tensor
  (grid.stage_group: every rank of the pipe stage).
Before, a hook all-reduced each such gradient over the tensor group in every micro-batch's backward (at
expert 1 every expert's, M times a step); now ZeRO sums it with the data reduction it runs anyway, once,
and at stages 1-3 shards it over that group too. The block's Linears defer their weight GEMMs to a split
schedule's W like any other (the runner hands those gradients to the optimizer: collect_grad_sync).
The global gradient norm counts each once (its shards are each rank's own: zero/reduction.py's
counted_elsewhere); checkpoints keep them whole by name, as before. A plain torch optimizer beside such
blocks is refused by the runner, as one beside a data axis is.
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

from pipezero.comm import all_gather, all_reduce, mark_partial_grad

__all__ = ["SplitTokens", "TokenShare", "sum_over_tensor", "token_share", "token_split_parameters"]

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


def token_split_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of every block inside `module` run on a token share (SplitTokens), in order:
    what the optimizer sums over the tensor group (module docstring)."""
    blocks = [m for m in module.modules() if token_share(m) is not None]
    return [p for b in blocks for p in b.parameters() if p.requires_grad]


class SplitTokens(ParallelStyle):
    """A block whole on every tensor rank, run on the rank's share of its input rows (module docstring).

    The block takes hidden states [..., d] and returns them (or a tuple whose first element they are,
    the rest passed on as they come: Llama 4's router logits, which its layer drops).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        share = TokenShare(device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank())
        if share.degree == 1:
            return module
        for p in module.parameters():  # each rank's gradient its tokens' share: summed by the optimizer
            mark_partial_grad(p, share.group)
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
