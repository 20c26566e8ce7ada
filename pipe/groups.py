"""The CPU (gloo) groups a PipelineRunner uses beside the pipe group: where metadata and the
step-start batch check travel, so neither waits for the GPU's queued work on nccl."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["cpu_world_group", "side_group"]


def cpu_world_group() -> Any:
    """A group over every rank that reduces CPU tensors: the default one when it has gloo, else a
    gloo twin (created on every rank). The step-start check runs there, so checking a batch never
    waits for the GPU to finish the previous step (the optimizer's kernels queue up behind it)."""
    return None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")


def side_group(grid: Any) -> Any:
    """The pipe group itself on gloo; beside nccl, a gloo twin (created on every rank, in order)."""
    if dist.get_backend(grid.pipe_group) != "nccl":
        return grid.pipe_group
    mine = None
    for ranks in grid.axis_groups("pipe"):
        group = dist.new_group(ranks, backend="gloo")
        mine = group if grid.rank in ranks else mine
    return mine
