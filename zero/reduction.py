"""A param group's own reduction group: the ranks its gradients are reduced and its shards split over.

ZeroOptimizer reduces over its `group` by default. A param group may name another with two keys,
read (and taken out of the group, so no process group reaches a state_dict) when the optimizer is
built:

  "zero_group"      the process group this group's gradients are summed over and, at stages 1-3,
                    its parameters partitioned over (None: the world);
  "zero_mean_over"  what the sum is divided by (default: that group's size, the mean).

Expert parallelism needs both (pipe/expert/, expert_param_groups): an expert's gradient already
sums what every rank of its expert group sent it, so it is summed over the ranks holding the same
experts and divided by the whole data x expert x sequence size, the mean the dense parameters get.
So does a MoE block beside a tensor split (pipe/tensor_tokens.py): its parameters are whole on every
tensor rank, each rank's gradient its tokens' share (comm.mark_partial_grad), summed over a group that
holds the tensor ranks, once a step; a param group reducing them over fewer ranks is refused here,
and their tensor ranks' replica marks do not make their masters copies (`counted_elsewhere`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipezero.checks import is_int
from pipezero.comm import is_replica, partial_grad_group

__all__ = ["GROUP_KEY", "KEYS", "MEAN_KEY", "Reduction", "check_partial_grads", "counted_elsewhere",
           "take_reductions"]

GROUP_KEY = "zero_group"
MEAN_KEY = "zero_mean_over"
KEYS = (GROUP_KEY, MEAN_KEY)


@dataclass(frozen=True, slots=True)
class Reduction:
    """One param group's reduction: over `group` (`size` ranks, this one `rank`), the sum / `mean_over`."""

    group: Any
    size: int
    rank: int
    mean_over: int

    @property
    def is_mean(self) -> bool:
        """The sum is divided by the group's size (a collective's plain average)."""
        return self.mean_over == self.size


def _of(group: Any) -> tuple[int, int]:
    """(size, this rank's index) of a process group; (1, 0) without a process group."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def take_reductions(param_groups: list[dict], default_group: Any) -> list[Reduction]:
    """Each param group's Reduction, its keys popped from the group (checked before any collective)."""
    out = []
    for g, pg in enumerate(param_groups):
        unknown = sorted(k for k in pg if isinstance(k, str) and k.startswith("zero_") and k not in KEYS)
        if unknown:
            raise ValueError(f"param group {g}: unknown ZeroOptimizer key(s) {unknown}; expected {list(KEYS)}")
        has_own = GROUP_KEY in pg
        group = pg.pop(GROUP_KEY) if has_own else default_group
        size, rank = _of(group)
        if rank < 0:
            raise ValueError(f"param group {g}: {GROUP_KEY!r} is a process group this rank is not in; give "
                             "each rank the group of the ranks that hold the same parameters (e.g. "
                             "grid.expert_data_group)")
        mean_over = pg.pop(MEAN_KEY, size)
        if not is_int(mean_over, 1):
            raise ValueError(f"param group {g}: {MEAN_KEY!r} = {mean_over!r}; expected a positive integer, the "
                             "number the summed gradient is divided by (e.g. grid.data_sequence_size)")
        out.append(Reduction(group, size, rank, mean_over))
    return out


def _ranks(group: Any) -> frozenset[int]:
    """The global ranks of a process group (None: the world)."""
    return frozenset(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _sums_partial(p: torch.Tensor, reduction: Reduction) -> bool:
    """Does `reduction` sum p's partial gradients (mark_partial_grad) over every rank holding a share?"""
    group = partial_grad_group(p)
    return group is not None and dist.is_initialized() and _ranks(group) <= _ranks(reduction.group)


def counted_elsewhere(p: torch.Tensor, reduction: Reduction) -> bool:
    """Is p's value, reduced by `reduction`, a copy another rank counts (comm.is_replica)? Not when the
    reduction sums p's partial copies into one: its shards are then this rank's own (stage 0 counts the
    whole on the group's first rank)."""
    return is_replica(p) and not _sums_partial(p, reduction)


def check_partial_grads(param_groups: list[dict], reductions: list[Reduction]) -> None:
    """Refuse a param group whose partial gradients (comm.mark_partial_grad) its reduction would not sum.

    Pure (no collective): every rank holding such a parameter (each rank of one pipeline stage, so every
    rank of any reduction group it shares) raises alike, before ZeroOptimizer's first collective."""
    if not dist.is_initialized():
        return
    for g, (pg, reduction) in enumerate(zip(param_groups, reductions)):
        short = [p for p in pg["params"] if partial_grad_group(p) is not None and not _sums_partial(p, reduction)]
        if short:
            need = sorted(_ranks(partial_grad_group(short[0])))
            raise ValueError(f"ZeroOptimizer: param group {g} holds {len(short)} parameters whose gradients are each "
                             f"rank's share of a sum over ranks {need} (MoE blocks run on each tensor rank's share "
                             f"of the tokens, pipe/tensor_tokens.py), but it reduces over ranks "
                             f"{sorted(_ranks(reduction.group))}, so they would step on partial gradients; give "
                             "them a param group reducing over the tensor ranks too: "
                             "pipezero.pipe.expert.expert_param_groups(module, grid) makes it")
