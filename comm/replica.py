"""Replica marking: a tensor whose value another rank already holds and counts.

A tied embedding on its second stage, replicated fp32 masters on data ranks > 0 (ZeRO stage 0)
and a replicated weight on tensor ranks > 0 are replicas: the global gradient norm counts
them once (on their owner), while they still take part in the inf/nan check. pipe/ and zero/
mark them, precision/ reads the mark; the pair lives here, below all three.
"""

from __future__ import annotations

import torch

__all__ = ["mark_replica", "is_replica"]

_ATTR = "pipezero_duplicate"


def mark_replica(tensor: torch.Tensor) -> None:
    """Say that another rank holds and counts this tensor's value."""
    setattr(tensor, _ATTR, True)


def is_replica(tensor: torch.Tensor) -> bool:
    """Whether `tensor` was marked with mark_replica."""
    return bool(getattr(tensor, _ATTR, False))
