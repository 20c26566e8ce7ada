"""Tensor shards: a plain tensor that holds one rank's slice of a whole parameter.

pipe/'s tensor-parallel linears keep their weights as ordinary local tensors (no DTensor
dispatch per operator), and so do its split experts (pipe/expert/: a MoE layer's stacked
experts cut along dim 0 over the expert group); what a checkpoint, the optimizer's shapes or
an export need to know about them — along which dim the whole tensor was cut, into how many
parts, which part this rank holds, over which process group (the tensor group, the expert
group) — is a `TensorShard` marked on the parameter. pipe/ marks, zero/ and train/ read; the
pair lives here, below all three (as comm/replica.py's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorShard", "mark_tensor_shard", "tensor_shard", "whole_of_shard", "slice_of_whole"]

_ATTR = "pipezero_tensor_shard"


@dataclass(frozen=True)
class TensorShard:
    """Part `rank` of `degree` equal parts of a tensor of `full_shape`, cut along `dim` (torch.chunk)."""

    dim: int
    degree: int
    rank: int
    full_shape: torch.Size
    group: Any = None  # the group (a ProcessGroup: tensor, or expert) the other parts live on

    @property
    def shape(self) -> torch.Size:
        """This part's shape."""
        shape = list(self.full_shape)
        shape[self.dim] //= self.degree
        return torch.Size(shape)


def mark_tensor_shard(tensor: torch.Tensor, shard: TensorShard) -> None:
    """Say that `tensor` is `shard`'s part of a whole tensor."""
    if tensor.shape != shard.shape:
        raise ValueError(f"mark_tensor_shard: a tensor of shape {tuple(tensor.shape)} is not part {shard.rank} "
                         f"of {tuple(shard.full_shape)} cut {shard.degree} ways along dim {shard.dim} "
                         f"(expected {tuple(shard.shape)})")
    setattr(tensor, _ATTR, shard)


def tensor_shard(tensor: torch.Tensor) -> TensorShard | None:
    """The TensorShard marked on `tensor`, or None when it is whole."""
    return getattr(tensor, _ATTR, None)


def whole_of_shard(shard: TensorShard, local: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like `shard`'s part) made whole over the shard's group; a collective."""
    if shard.degree == 1:
        return local
    parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(shard.degree)]
    dist.all_gather(parts, local.contiguous(), group=shard.group)
    return torch.cat(parts, dim=shard.dim)


def slice_of_whole(shard: TensorShard, full: torch.Tensor) -> torch.Tensor:
    """`shard`'s part of the whole tensor `full` (no communication)."""
    if full.shape != shard.full_shape:
        raise ValueError(f"slice_of_whole: a tensor of shape {tuple(full.shape)} is not the whole "
                         f"tensor part {shard.rank} of {shard.degree} is cut from; expected {tuple(shard.full_shape)}")
    return full.chunk(shard.degree, dim=shard.dim)[shard.rank]
