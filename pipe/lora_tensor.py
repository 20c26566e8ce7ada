"""LoRA under tensor parallelism: the base split as its plan says, the adapters whole on every tensor rank.

torch's ColwiseParallel / RowwiseParallel shard an nn.Linear's own weight and bias; a
LoraLinear also holds lora_A and lora_B, which ColwiseParallel would try to shard too (and
RowwiseParallel would leave as plain tensors beside DTensors). `lora_tensor_plan(source)`
wraps a plan source (hf_tensor_plan(), gpt_tensor_plan(), a {class: plan} mapping) so that
each style aimed at a LoraLinear shards only the base, then places the adapters as Replicate
DTensors: DTensor's propagation makes the adapter path exact in either split (column-wise: the
whole update is sliced where it is added; row-wise: A x is a partial sum reduced with the
base's output), and a hook makes each adapter gradient whole before it accumulates (DTensor
would leave it sharded or partial, and the optimizer reads the local tensor). The adapters are small, so keeping them
whole costs little; what the split saves is the base.

These wrapped styles are not the plain ColwiseParallel / RowwiseParallel that
pipe/tensor_linear.py splits on local tensors, so an adapted Linear stays on DTensor (its
per-operator dispatch cost included); the layer's other Linears are split on local tensors.
In a compiled layer (PipelineModule(compile=...)) an adapted Linear runs eager, a break in the
layer's graph: torch.compile cannot trace a DTensor parameter once ZeroOptimizer has put its
local tensor in a flat buffer (torch 2.13: "Attempted to set the storage of a tensor on device
cpu to a storage on different device meta").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from pipezero.pipe.lora import LoraLinear
from pipezero.pipe.tensor_parallel import PlanSource, TensorPlan, plan_for

__all__ = ["lora_tensor_plan"]


class _BaseOnly:
    """Mixed in front of a ParallelStyle: apply it to the base weight, replicate the adapters."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, LoraLinear):
            return super()._apply(module, device_mesh)
        adapters = {k: module._modules.pop(k) for k in ("lora_A", "lora_B", "lora_dropout")}
        try:
            out = super()._apply(module, device_mesh)
        finally:
            module._modules.update(adapters)
        for adapter in (adapters["lora_A"], adapters["lora_B"]):
            w = adapter.weight
            adapter.weight = nn.Parameter(distribute_tensor(w.detach(), device_mesh, [Replicate()]),
                                          requires_grad=w.requires_grad)
            adapter.weight.register_hook(_whole_grad)
        module.__class__ = _EagerLoraLinear
        return out


class _EagerLoraLinear(LoraLinear):
    """A LoraLinear on DTensors, run eager inside a compiled layer (module docstring)."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _whole_grad(grad: DTensor) -> DTensor:
    """DTensor leaves a replicated weight's gradient in whatever placement its use produced (a shard,
    or a partial sum); the optimizer reads the local tensor as the whole gradient, so make it whole."""
    if all(isinstance(p, Replicate) for p in grad.placements):
        return grad
    return grad.redistribute(placements=[Replicate()] * len(grad.placements))


def _wrapped(style: Any) -> Any:
    cls = type(style)
    if issubclass(cls, _BaseOnly):
        return style
    new = object.__new__(type(f"Lora{cls.__name__}", (_BaseOnly, cls), {}))
    new.__dict__.update(style.__dict__)
    return new


def lora_tensor_plan(source: PlanSource) -> Any:
    """PipelineModule(tensor_plan=...) for layers adapted by lora_specs: `source`'s plan, adapter-aware."""
    def plan(layer: nn.Module) -> TensorPlan | None:
        inner = plan_for(source, layer)
        if not inner:
            return inner
        return {path: _wrapped(style) if isinstance(layer.get_submodule(path), LoraLinear) else style
                for path, style in inner.items()}
    return plan
