"""Global gradient norm, clipping and the inf/nan check, in ONE small all-reduce per step.

Gradients of one model may be spread over pipeline stages, data shards (ZeRO) and tensor shards.
The global L2 norm is sqrt(sum over the world of each rank's local sum of squares), where a
tensor that duplicates one another rank already counts is marked a replica (comm.mark_replica:
a tied embedding on its second stage, replicated masters on data ranks > 0, a replicated
weight on tensor ranks > 0) and is left out of the sum. Replicas still take part in the
inf/nan count, which rides in the same two-number all-reduce.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from pipezero.checks import is_number
from pipezero.comm import all_reduce, is_replica
from pipezero.topology import process_device

__all__ = ["GradStats", "grad_stats", "global_grad_norm", "clip_grad_norm",
           "grouped_grads"]

_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


class GradStats:
    """What the one all-reduce found: the global norm (of the unscaled grads) and finiteness."""

    __slots__ = ("norm", "finite")

    def __init__(self, norm: float, finite: bool):
        self.norm, self.finite = norm, finite

    def clip_coef(self, max_norm: float) -> float:
        """The factor that brings the norm down to max_norm (1.0 when already below)."""
        return min(1.0, max_norm / (self.norm + _EPS))


def grouped_grads(params: Iterable[torch.Tensor]) -> dict[tuple, tuple[list, list]]:
    """The existing grads by (device, dtype), each with its duplicate flags (foreach ops want one of each)."""
    groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for p in params:
        if p.grad is not None:
            grad = _local(p.grad)  # a tensor-parallel grad counts by this rank's shard
            grads, dups = groups[(grad.device, grad.dtype)]
            grads.append(grad)
            dups.append(is_replica(p))
    return groups


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor gradient (its own storage: in-place ops reach the DTensor)."""
    if isinstance(grad, DTensor):
        with torch.no_grad():
            return grad.to_local()
    return grad


def comm_device(group=None) -> torch.device:
    """Where the small all-reduce lives: the current GPU for nccl, else the CPU."""
    return process_device(group)


def _local_sums(groups: dict[tuple, tuple[list, list]], device: torch.device) -> torch.Tensor:
    """[sum of squares of the non-duplicate grads, count of non-finite grads] on this rank (float64)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for grads, dups in groups.values():
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double()
        keep = torch.tensor([not d for d in dups], device=norms.device)
        kept = torch.where(keep, norms, torch.zeros((), dtype=norms.dtype, device=norms.device))
        part = torch.stack([kept.square().sum(),  # duplicates left out of the sum of squares ...
                            (~torch.isfinite(norms)).sum().double()])  # ... but their inf/nan counted
        sums += part.to(device)
    return sums


def _agree(stats: torch.Tensor, group) -> tuple[float, bool]:
    all_reduce(stats, group=group)
    sumsq, bad = stats.tolist()
    return sumsq, bad == 0 and math.isfinite(sumsq)


def grad_stats(params: Iterable[torch.Tensor] | dict, group=None, scale: float = 1.0) -> GradStats:
    """The global norm of `params`' grads divided by `scale`, and whether all of them are finite.

    `params` may also be grouped_grads(params), computed once by a caller that reuses it.
    Every rank of `group` (default: the whole world) must call it, even with no grads.
    """
    groups = params if isinstance(params, dict) else grouped_grads(params)
    stats = _local_sums(groups, comm_device(group))
    sumsq, finite = _agree(stats, group)
    norm = math.sqrt(sumsq) / scale if finite else (math.nan if math.isnan(sumsq) else math.inf)
    return GradStats(norm, finite)


def _param_list(params) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    params = list(params)
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected tensors (parameters), got {type(p).__name__}; pass model.parameters()")
    return params


def global_grad_norm(params: Iterable[torch.Tensor] | torch.Tensor, group=None) -> torch.Tensor:
    """The L2 norm of the gradients of `params` across every rank of `group`, duplicates counted once.

    Returns a 0-dim float32 tensor (inf or nan when some gradient is).
    """
    return torch.tensor(grad_stats(_param_list(params), group).norm, dtype=torch.float32)


def clip_grad_norm(params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, group=None) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most `max_norm`; return the norm before clipping.

    Like torch.nn.utils.clip_grad_norm_, but over every rank of `group` (default: the world), each
    replica (comm.is_replica) counted once. A non-finite norm is returned and the gradients are
    left untouched (never multiplied by nan), so the caller can skip the step.
    """
    if not is_number(max_norm, above=0, finite=False):
        raise ValueError(f"clip_grad_norm(max_norm={max_norm!r}): must be a positive number")
    groups = grouped_grads(_param_list(params))
    stats = grad_stats(groups, group)
    if stats.finite:
        coef = stats.clip_coef(float(max_norm))
        if coef < 1.0:
            for grads, _ in groups.values():
                torch._foreach_mul_(grads, coef)
    return torch.tensor(stats.norm, dtype=torch.float32)
