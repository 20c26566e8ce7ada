"""Tensor parallelism for one stage's layers, through torch's DTensor.

pipezero does not re-implement column/row-parallel layers: a layer's plan is a dict of
submodule paths to torch ParallelStyles (ColwiseParallel, RowwiseParallel, ...), applied
with `parallelize_module` on the grid's "tensor" sub-mesh (Megatron-LM's split, Shoeybi et
al. 2019). What this file adds is checking the plan before any collective (a dimension that
does not divide by the tensor degree is a ValueError naming the layer and the numbers) and
marking the parameters that stay replicated across the tensor group as duplicates, so the
global gradient norm counts them once.
"""

from __future__ import annotations

from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

TensorPlan = Mapping[str, ParallelStyle]  # submodule path (relative to the layer) -> style

__all__ = ["TensorPlan", "apply_tensor_plan", "check_tensor_plan"]


def check_tensor_plan(module: nn.Module, plan: TensorPlan, degree: int, where: str = "layer") -> None:
    """Raise ValueError if a planned submodule is missing or a split dimension does not divide."""
    for path, style in plan.items():
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"tensor plan of {where} names {path!r}, which {type(module).__name__} "
                             f"does not have") from None
        dim = _split_dim(sub, style)
        if dim is not None and dim[1] % degree:
            raise ValueError(f"tensor plan of {where}: {path} ({type(sub).__name__}) splits {dim[0]}={dim[1]} "
                             f"over tensor degree {degree}, which does not divide it; pick a tensor degree "
                             f"that divides {dim[1]}")


def _split_dim(sub: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    if isinstance(sub, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return "out_features", sub.out_features
        if isinstance(style, RowwiseParallel):
            return "in_features", sub.in_features
    if isinstance(sub, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return "embedding_dim", sub.embedding_dim
        if isinstance(style, RowwiseParallel):
            return "num_embeddings", sub.num_embeddings
    return None


def apply_tensor_plan(module: nn.Module, mesh: DeviceMesh, plan: TensorPlan, where: str = "layer") -> nn.Module:
    """Shard `module` over the 1-D tensor `mesh` by `plan`; return it (changed in place)."""
    degree = mesh.size()
    check_tensor_plan(module, plan, degree, where)
    if degree == 1 or not plan:
        return module
    parallelize_module(module, mesh, dict(plan))
    if mesh.get_local_rank() != 0:
        for p in module.parameters():
            if not isinstance(p, DTensor):
                p.pipezero_duplicate = True  # replicated over the tensor group: counted once
    return module
