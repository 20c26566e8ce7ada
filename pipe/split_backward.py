"""Zero-bubble's split backward: I (the input gradient) now, W (the weight gradients) later.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split B into I
and W. I uses torch's pipelining helper stage_backward_input, which keeps the gradients at the
weight-using nodes; W then computes only the weight gradients from them
(stage_backward_weight). On the first stage (its inputs need no gradient) I is empty and W is
the whole backward. Without those helpers (a private torch module) W re-runs the retained
graph's backward: exact, at one more backward-input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["WeightGrad", "backward_input"]

try:  # torch's split backward (private, present in torch 2.11-2.13); else W re-runs the backward
    from torch.distributed.pipelining._backward import stage_backward_input as _stage_backward_input
    from torch.distributed.pipelining._backward import stage_backward_weight as _stage_backward_weight
except ImportError:  # pragma: no cover
    _stage_backward_input = _stage_backward_weight = None


@dataclass(frozen=True)
class WeightGrad:
    """What W needs, kept by I. `split`: W computes only the weight gradients and assigns
    .grad without autograd hooks (so the caller tells the optimizer); else W is a backward."""

    split: bool
    saved: tuple  # split: (weights, intermediate gradient groups); else (outputs, their gradients)

    def run(self) -> None:
        if self.split:
            weights, groups = self.saved
            _stage_backward_weight(iter(weights), groups)
        else:
            torch.autograd.backward(*self.saved)


def backward_input(outs: list, grads: list, leaves: list, weights: list) -> tuple[Sequence, WeightGrad]:
    """I: the gradients of `leaves` (the chunk's inputs) now, and what W needs later.

    `weights` are the chunk's parameters that need gradients; `grads` is [None] for a loss.
    """
    if not leaves:
        return (), WeightGrad(False, (outs, grads))
    if _stage_backward_input is not None:
        in_grads, groups = _stage_backward_input(outs, None if grads == [None] else grads, leaves, iter(weights))
        return in_grads, WeightGrad(True, (weights, groups))
    in_grads = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    return in_grads, WeightGrad(False, (outs, grads))
