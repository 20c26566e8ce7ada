"""Partial gradients: a parameter whole on several ranks whose gradient on each is only its share of the sum.

A MoE block beside a tensor split runs on each tensor rank's share of the tokens (pipe/tensor_tokens.py)
with its parameters whole on every tensor rank: each rank's gradient covers its own tokens, and the
model's gradient is the sum over the tensor group. No hook sums it in the backward; whoever reduces the
gradients once a step must reduce these over a group holding those ranks (ZeroOptimizer refuses a param
group that does not, zero/reduction.py), and, having summed the copies into one, counts the result once
(the tensor ranks' replica marks then say nothing about its shards). pipe/ marks, zero/ reads; the pair
lives here, below both (as comm/replica.py's).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mark_partial_grad", "partial_grad_group"]

_ATTR = "pipezero_partial_grad"


def mark_partial_grad(tensor: torch.Tensor, group: Any) -> None:
    """Say that `tensor`'s gradient on this rank is its share of the sum over `group` (a ProcessGroup)."""
    setattr(tensor, _ATTR, group)


def partial_grad_group(tensor: torch.Tensor) -> Any | None:
    """The group `tensor`'s gradient is to be summed over (mark_partial_grad), None when it is whole."""
    return getattr(tensor, _ATTR, None)
