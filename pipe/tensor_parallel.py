"""Tensor parallelism for one stage's layers: torch's plan vocabulary, plain local tensors where it can.

A layer's plan is a dict of submodule paths to torch ParallelStyles (ColwiseParallel,
RowwiseParallel, ...), applied over the grid's "tensor" sub-mesh (Megatron-LM's split,
Shoeybi et al. 2019). An nn.Linear under a plain ColwiseParallel / ColwiseHeads /
RowwiseParallel (default layouts) is split on plain local tensors with explicit collectives
(pipe/tensor_linear.py): DTensor's per-operator dispatch cost ~8x on small blocks. Any other
style or module (an Embedding, custom layouts, SequenceParallel, lora_tensor_plan's styles)
goes to torch's `parallelize_module` and becomes DTensors, as before (ReplicateOnShards, a
whole module reading this rank's shard, stays plain, its gradients summed over the group).
This file also checks the plan before any collective (a dimension that does not divide by the tensor degree is a
ValueError naming the layer and the numbers) and marks the parameters that stay replicated
across the tensor group as duplicates, so the global gradient norm counts them once.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from pipezero.comm import all_reduce, mark_replica, tensor_shard, whole_of_shard
from pipezero.pipe.tensor_linear import SharedInput, shard_columns, shard_rows

TensorPlan = Mapping[str, ParallelStyle]  # submodule path (relative to the layer) -> style
# what PipelineModule(tensor_plan=) takes: {layer class: plan}, or a callable built layer -> plan or None
PlanSource = Union[Mapping[type, TensorPlan], Callable[[nn.Module], "TensorPlan | None"]]

__all__ = ["ColwiseHeads", "PlanSource", "ReplicateOnShards", "TensorPlan", "apply_tensor_plan", "check_tensor_plan",
           "is_replicated", "mark_tensor_duplicates", "plan_for", "shard_module", "whole_tensor"]


class ColwiseHeads(ColwiseParallel):
    """ColwiseParallel for a fused projection laid out head by head: each tensor rank gets whole heads.

    Only adds what the check needs: `heads`, the count that must divide by the tensor degree
    (out_features dividing is not enough: 3 heads of 4 features split in 2 cut a head in half).
    """

    def __init__(self, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads


class ReplicateOnShards(ParallelStyle):
    """A module kept whole on every tensor rank that reads this rank's shard: its gradients summed over the group.

    Qwen3's and Gemma 3's q_norm / k_norm normalise each head with one weight shared by all
    heads; after a column-parallel q_proj each tensor rank holds some heads, so its gradient of
    that weight sums over its heads only. The sum over the tensor group is the whole model's
    gradient, the same on every rank (Megatron-LM all-reduces its qk-layernorm gradients alike).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        if device_mesh.size() > 1:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_hook(lambda grad: _summed(grad, group))
        return module


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone(memory_format=torch.contiguous_format)
    all_reduce(grad, group=group)  # comm's: counted in TRAFFIC with the tensor group's other collectives
    return grad


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
    """Is `p` whole on every tensor rank (a plain unsharded tensor, or a DTensor placed Replicate everywhere)?"""
    if isinstance(p, DTensor):
        return all(isinstance(pl, Replicate) for pl in p.placements)
    return tensor_shard(p) is None


def whole_tensor(p: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """`value` (default: p itself; e.g. p.grad), laid out like p on this tensor rank, made whole.

    A collective over the tensor group for a split parameter (a TensorShard or a sharded
    DTensor), every tensor rank taking part; a whole parameter's value comes back as it is.
    """
    value = p if value is None else value
    if isinstance(value, DTensor):
        return value.full_tensor()
    shard = tensor_shard(p)
    return value if shard is None else whole_of_shard(shard, value)


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
    shard_module(module, mesh, plan)
    mark_tensor_duplicates(module, mesh.get_local_rank())  # replicated over the tensor group: counted once
    return module


def shard_module(module: nn.Module, mesh: DeviceMesh, plan: TensorPlan, dtensor: bool = False) -> None:
    """Split `module` by `plan` over `mesh` (unchecked; also on a one-rank mesh, as the benchmarks
    measure): Linears under the plain styles on local tensors, the rest through DTensor.
    `dtensor=True` sends every style to torch's parallelize_module (the old path, for comparison)."""
    group, degree, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    shared = SharedInput(group, degree)  # q/k/v reading one input: one all-reduce of its gradient
    rest = {}
    for path, style in plan.items():
        sub = module.get_submodule(path)
        split = None if dtensor else _local_split(sub, style)
        if split == "columns":
            shard_columns(sub, group, degree, rank, shared)
        elif split == "rows":
            shard_rows(sub, group, degree, rank)
        else:
            rest[path] = style
    if rest:
        parallelize_module(module, mesh, rest)


def _local_split(sub: nn.Module, style: ParallelStyle) -> str | None:
    """"columns" / "rows" when `style` on `sub` is what tensor_linear.py does; None: DTensor's path."""
    if type(sub) is not nn.Linear or type(style) not in (ColwiseParallel, ColwiseHeads, RowwiseParallel):
        return None
    # the layouts a default style has: column (Replicate in, local Shard(-1) out), row (the reverse)
    column = isinstance(style, ColwiseParallel)
    into, out = (Replicate(), Shard(-1)) if column else (Shard(-1), Replicate())
    if (tuple(style.input_layouts) != (into,) or tuple(style.output_layouts) != (out,)
            or not style.use_local_output):
        return None
    return "columns" if column else "rows"
