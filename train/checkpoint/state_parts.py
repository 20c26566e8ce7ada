"""What save_state / load_state need from a job's parts, written down as protocols instead of `Any`.

The grid-independent checkpoint (train/checkpoint/state.py) stores every parameter and its optimizer state
whole, under its global name, so the optimizer that owns the parameters must hand them over whole
and take them back by parameter: `ByNameState`, which ZeroOptimizer implements at every stage (its
shards gathered over the data group). `StateParts` is the rest of a job that a checkpoint records:
`pipezero.train.Parts` satisfies it, and so does any small object a hand composition makes with
these fields. (Per-rank checkpoints of arbitrary Saveable things: train/checkpoint/saveable.py.)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

__all__ = ["ByNameState", "StateParts"]


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


class _Grid(Protocol):
    rank: int
    world_size: int
    data_rank: int
    tensor_rank: int
    pipe_size: int
    data_size: int
    tensor_size: int


class StateParts(Protocol):
    """The parts of a job a checkpoint saves and restores (pipezero.train.Parts has them all)."""

    module: nn.Module
    optimizer: ByNameState
    grid: _Grid
    scheduler: Any          # a torch LR scheduler or None
    config: _Config
    dtype: torch.dtype
