"""The expert parameters' gradient reduction: over the ranks that hold the same experts.

ZeroOptimizer reduces all its parameters over one group (zero/optimizer.py); a parameter group
with a group of its own is not there yet. So the dense parameters go to a ZeroOptimizer over
the whole data x expert group, and the expert parameters (expert_parameters) to their own
optimizer, after this plain all-reduce: the sum over the expert's data group (the ranks holding
the same experts; None or one rank: none), divided by the data x expert size, which is the
mean the dense parameters get (each expert's gradient already sums every rank's tokens).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["reduce_expert_grads"]


def reduce_expert_grads(params: Iterable[torch.Tensor], expert_data_group: Any, data_expert_size: int) -> None:
    """p.grad = sum over expert_data_group of p.grad / data_expert_size, for every p with a gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    many = expert_data_group is not None and dist.get_world_size(expert_data_group) > 1
    flat = torch.cat([g.reshape(-1) for g in grads])
    if many:
        dist.all_reduce(flat, group=expert_data_group)
    flat /= data_expert_size
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
