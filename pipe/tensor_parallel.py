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

from typing import Callable, Mapping, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from pipezero.comm import mark_replica

TensorPlan = Mapping[str, ParallelStyle]  # submodule path (relative to the layer) -> style
# what PipelineModule(tensor_plan=) takes: {layer class: plan}, or a callable built layer -> plan or None
PlanSource = Union[Mapping[type, TensorPlan], Callable[[nn.Module], "TensorPlan | None"]]

__all__ = ["ColwiseHeads", "PlanSource", "TensorPlan", "apply_tensor_plan", "check_tensor_plan", "is_replicated",
           "mark_tensor_duplicates", "plan_for"]


class ColwiseHeads(ColwiseParallel):
    """ColwiseParallel for a fused projection laid out head by head: each tensor rank gets whole heads.

    Only adds what the check needs: `heads`, the count that must divide by the tensor degree
    (out_features dividing is not enough: 3 heads of 4 features split in 2 cut a head in half).
    """

    def __init__(self, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads


def plan_for(source: PlanSource | None, module: nn.Module) -> TensorPlan | None:
    """The plan `source` gives a built layer (None: the layer stays whole on every tensor rank)."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get(type(module))
    if callable(source):
        return source(module)
    raise TypeError(f"tensor_plan={source!r}: expected {{layer class: plan}} or a callable layer -> plan")


def is_replicated(p) -> bool:
    """Is `p` whole on every tensor rank (a plain tensor, or a DTensor placed Replicate everywhere)?"""
    if isinstance(p, DTensor):
        return all(isinstance(pl, Replicate) for pl in p.placements)
    return True


def mark_tensor_duplicates(module: nn.Module, tensor_rank: int) -> None:
    """On tensor ranks > 0, flag the replicated parameters so the global grad norm counts them once."""
    if tensor_rank == 0:
        return
    for p in module.parameters():
        if is_replicated(p):
            mark_replica(p)


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
        if isinstance(style, ColwiseHeads):
            return "heads", style.heads
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
    mark_tensor_duplicates(module, mesh.get_local_rank())  # replicated over the tensor group: counted once
    return module
