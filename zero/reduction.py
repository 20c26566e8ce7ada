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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipezero.checks import is_int

__all__ = ["GROUP_KEY", "KEYS", "MEAN_KEY", "Reduction", "take_reductions"]

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
