"""The loss of a sequence shard: its part of the whole sequence's loss, scaled for the mean over ranks.

One process computes mean CE over every trained token of the sequence: sum over tokens / N.
Split in `degree` slices, rank r holds sum_r over its n_r trained tokens; the runner and ZeRO
average over data x sequence ranks (the loss and the gradients alike), so each shard's loss is
degree x sum_r / N, N the count over the sequence group (one small all-reduce): the mean over
the sequence ranks is then exactly sum / N, whatever share of the trained tokens each slice
holds (labels are shifted on the whole sequence before the split, so the last slice has one
fewer; an SFT prompt may fill a slice with none).

`ShardMean(loss_fn)` takes a loss_fn that is a mean over this shard's targets other than -100
(causal_lm_loss, the GPT's loss, F.cross_entropy's mean): PipelineModule wraps every loss_fn
so under a sequence axis. `ShardSum(loss_fn)` marks a loss already divided by the global count
(train/data's token_mean_loss, its scale computed over the whole batch): only times degree. Any
`ShardsLoss` (a `bind(group, degree)`) is bound as it is: a wrapper that adds a term every sequence
rank holds whole (pipe/hf/router.py's `WithRouterLoss`) binds the loss it wraps (`shard_loss`) and
adds the term once, outside that loss's weighing.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["ShardMean", "ShardSum", "ShardsLoss", "shard_loss"]

IGNORE_INDEX = -100  # Hugging Face's (and train/data's) untrained label


@runtime_checkable
class ShardsLoss(Protocol):
    """A loss_fn that says how a sequence shard weighs it (ShardMean, ShardSum, or a wrapper of one)."""

    def bind(self, group: Any, degree: int) -> Callable: ...


def shard_loss(loss_fn: Callable, group: Any, degree: int) -> Callable:
    """loss_fn bound to the sequence group: a ShardsLoss as it says, any other a mean over its shard's
    trained targets (ShardMean)."""
    shard = loss_fn if isinstance(loss_fn, ShardsLoss) else ShardMean(loss_fn)
    return shard.bind(group, degree)


class ShardSum:
    """A loss_fn already divided by the global count of trained tokens: times the degree once split."""

    def __init__(self, loss_fn: Callable, group: Any = None, degree: int = 1):
        self.loss_fn, self.group, self.degree = loss_fn, group, degree

    def bind(self, group: Any, degree: int) -> "ShardSum":
        return ShardSum(self.loss_fn, group, degree)

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        loss = self.loss_fn(output, targets)
        return loss * self.degree if self.degree > 1 else loss


class ShardMean:
    """A loss_fn that is a mean over this shard's trained targets -> degree x its sum / the global count."""

    def __init__(self, loss_fn: Callable, group: Any = None, degree: int = 1, ignore_index: int = IGNORE_INDEX):
        self.loss_fn, self.group, self.degree, self.ignore_index = loss_fn, group, degree, ignore_index

    def bind(self, group: Any, degree: int) -> "ShardMean":
        return ShardMean(self.loss_fn, group, degree, self.ignore_index)

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        if self.degree == 1:
            return self.loss_fn(output, targets)
        labels = targets[0] if isinstance(targets, (tuple, list)) else targets
        mine = (labels != self.ignore_index).sum() if not labels.is_floating_point() else labels.new_tensor(
            labels.numel())
        mine, total = _counts(mine, self.group)
        if mine == 0:  # no trained token here: the mean would be 0/0
            return _zero(output)
        loss = self.loss_fn(output, targets)
        return loss * (mine * self.degree / total)


@torch.compiler.disable  # eager under a compiled loss (pipe/compile.py): traced, the in-place sum was lost
def _counts(mine: torch.Tensor, group: Any) -> tuple[int, int]:
    """(this shard's trained tokens, the sequence group's): one small all-reduce."""
    counts = mine.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(counts, group=group)
    return int(mine), int(counts.item())


def _zero(output: Any) -> torch.Tensor:
    """A zero loss on the output's graph (backward gives every input a zero gradient)."""
    tensors = [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
    return sum(t.float().sum() * 0.0 for t in tensors if t.is_floating_point())
