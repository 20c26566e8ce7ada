"""What save_state / load_state need from a job's parts, written down as protocols instead of `Any`.

The grid-independent checkpoint (train/checkpoint/state.py) stores every parameter and its optimizer state
whole, under its global name, so the optimizer that owns the parameters must hand them over whole
and take them back by parameter: `ByNameState`, which ZeroOptimizer implements at every stage (its
shards gathered over the data group); any other optimizer (a torch one, a LossScaler /
MasterWeights chain over one) is seen through train/checkpoint/by_name.py's view of its state_dict, the same
layout. `StateParts` is the rest of a job that a checkpoint records: `pipezero.train.Parts`
satisfies it, and so does `HandParts(module, optimizer, scheduler)`, a job composed by hand.
(Per-rank checkpoints of arbitrary Saveable things: train/checkpoint/saveable.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from pipezero.train.checkpoint.saveable import Saveable

__all__ = ["ByNameState", "HandParts", "StateParts", "WorldGrid"]


@runtime_checkable
class ByNameState(Protocol):
    """An optimizer (chain) that gives and takes its parameters and their state whole, by parameter."""

    param_groups: list[dict[str, Any]]
    original_params: list[list[torch.Tensor]]   # each group's model parameters, in order
    inner: Any                                  # the next link of the chain (its own state: link_state_dict)

    def full_shapes(self) -> dict[int, torch.Size]: ...

    def full_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def load_full_parameters(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None: ...

    def per_parameter_state(self) -> list[tuple[torch.Tensor, dict[str, Any]]]: ...

    def load_per_parameter_state(self, state_of: Callable[[torch.Tensor], dict[str, Any] | None]) -> None: ...


class _Config(Protocol):
    batch: Any              # train.config.batch.BatchConfig: the sizes a resume on another data degree keeps
                            # (a config of None: no batch sizes recorded)


class _Grid(Protocol):
    rank: int
    world_size: int
    data_rank: int
    tensor_rank: int
    sequence_rank: int
    expert_rank: int
    pipe_size: int
    data_size: int
    tensor_size: int
    sequence_size: int
    expert_size: int


class StateParts(Protocol):
    """The parts of a job a checkpoint saves and restores (pipezero.train.Parts has them all)."""

    module: nn.Module
    optimizer: ByNameState
    grid: _Grid
    scheduler: Any          # a torch LR scheduler or None
    config: _Config
    dtype: torch.dtype


@dataclass(frozen=True)
class WorldGrid:
    """The grid of a job without a pipeline or tensor axis: every process is a data rank (one process, DDP)."""

    rank: int = 0
    world_size: int = 1
    tensor_rank: int = 0
    sequence_rank: int = 0
    expert_rank: int = 0
    pipe_size: int = 1
    tensor_size: int = 1
    sequence_size: int = 1
    expert_size: int = 1

    @property
    def data_rank(self) -> int:
        return self.rank

    @property
    def data_size(self) -> int:
        return self.world_size

    @classmethod
    def current(cls) -> "WorldGrid":
        """This process in the default process group (rank 0 of 1 without one)."""
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size())
        return cls()


@dataclass(eq=False)
class HandParts:
    """A job composed by hand, for save_state / load_state: the same checkpoint `build`'s Parts write.

    `optimizer`: a ZeroOptimizer chain, a LossScaler / MasterWeights chain or a plain torch
    optimizer, or a list of them holding different parameters (the dense ZeroOptimizer and the
    experts' own optimizer of pipe/expert/: their state is saved by parameter name as one
    optimizer's would be; only the first may keep state of its own, a loss scale); `scheduler`:
    a torch LR scheduler or None (both Saveable: state_dict / load_state_dict). `grid`: the
    job's topology.Grid (a pipeline, a tensor axis, an expert axis); None: every
    process is a data rank (`WorldGrid.current()`). `config`: anything with the `batch` sizes
    (train's TrainConfig) or None. `dtype`: the compute dtype recorded, by default the model's.
    """

    module: nn.Module
    optimizer: Any
    scheduler: Any = None
    grid: Any = None
    config: Any = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"HandParts(module={type(self.module).__name__}): expected the nn.Module being trained")
        several = isinstance(self.optimizer, (list, tuple))
        wrong = [type(o).__name__ for o in (self.optimizer if several else [self.optimizer])
                 if not isinstance(o, torch.optim.Optimizer)]
        if wrong or self.optimizer in ([], ()):
            shown = wrong if several else wrong[0]
            raise TypeError(f"HandParts(optimizer={shown}): expected a torch.optim.Optimizer or an optimizer chain "
                            "(ZeroOptimizer, LossScaler, MasterWeights), or a list of them")
        if self.scheduler is not None and not isinstance(self.scheduler, Saveable):
            raise TypeError(f"HandParts(scheduler={type(self.scheduler).__name__}): expected a torch LR scheduler "
                            "(or another Saveable: state_dict / load_state_dict) or None")
        if self.grid is None:
            self.grid = WorldGrid.current()
        if self.dtype is None:
            floating = [p.dtype for p in self.module.parameters() if p.is_floating_point()]
            self.dtype = floating[0] if floating else torch.float32
