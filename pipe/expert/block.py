"""Expert parallelism for a Hugging Face MoE layer: its experts split over an expert group.

`shard_experts(module, group)` replaces each MoE layer's experts (the `experts` child whose
stacked parameters have one slice per expert: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3) by an
`ExpertParallel` holding this rank's E / n of them, under the same parameter names. Its forward
takes what transformers' experts take (hidden, top-k indices, top-k weights): the rows go to
their experts' ranks (pipe/expert/dispatch.py), this rank's experts compute them with
transformers' own experts implementation (grouped_mm by default) on a copy of the module
that holds the local experts only, and the rows come back. The router and the dense layers
stay replicated, so each rank of the group routes its own tokens (the group's ranks are data
replicas for everything else).

Each split parameter is marked with a comm.TensorShard (dim 0, the expert group): like a
tensor-parallel slice, a checkpoint saves it whole under its global name and cuts this rank's
experts out again on load, so a checkpoint moves across expert degrees (train/checkpoint/).

Gradients: a dense parameter is reduced over the whole data x expert group, as before; so is a
parameter of the experts module that has no slice per expert (its dim 0 is not the number of
experts: it stays whole, the same on every rank, and is no expert parameter). An
expert's gradient already sums what every rank's tokens sent it; it is summed over the ranks
holding the same experts (the expert's own data group) and divided by the size of the whole
data x expert group: expert_param_groups (pipe/expert/groups.py) gives ZeroOptimizer that group.
Overlap (`shard_experts(module, group, overlap=True)`, ds_config "expert_parallel" "overlap": true, a
key of pipezero's): the layer's tokens in two halves, each half's all-to-alls in flight while the other
half's experts compute, forward and backward (pipe/expert/overlap.py); the same outputs and gradients
(an expert's weight gradient summed in two parts). Off by default until a multi-GPU run measures it
(bench/moe_multi.py's expert-overlap run). Every rank of a group must take the same setting.
Lepikhin et al. 2020 (GShard), Fedus et al. 2021 (Switch); the layout is DeepSpeed-MoE's and
Megatron-core's.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.comm import TensorShard, mark_tensor_shard, tensor_shard
from pipezero.pipe.expert.dispatch import combine, dispatch
from pipezero.pipe.expert.overlap import overlapped

__all__ = ["ExpertParallel", "expert_parameters", "shard_experts", "whole_experts"]


class ExpertParallel(nn.Module):
    """This rank's experts of one MoE layer; called as transformers' experts module is called. `overlap`: the
    tokens in two halves, their exchanges hidden behind the other half's experts (pipe/expert/overlap.py)."""

    def __init__(self, experts: nn.Module, num_experts: int, group: Any, overlap: bool = False):
        super().__init__()
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % ranks:
            raise ValueError(f"ExpertParallel: {num_experts} experts do not split evenly over an expert group of "
                             f"{ranks} ranks; expected an expert degree that divides the number of experts")
        self.num_experts, self.group, self.overlap = num_experts, group, overlap
        per_rank = num_experts // ranks
        local = copy.copy(experts)  # the same class, forward, config and implementation switch
        local._parameters = {}  # a shallow copy shares the dict: its own, holding the local slices only
        for name, p in experts.named_parameters(recurse=False):
            split = p.shape[0] == num_experts
            part = p.detach()[rank * per_rank:(rank + 1) * per_rank].clone() if split else p
            setattr(local, name, nn.Parameter(part, requires_grad=p.requires_grad))
            if split:  # which slice of which whole: a checkpoint saves it whole, by name, and cuts it again
                mark_tensor_shard(local._parameters[name], TensorShard(0, ranks, rank, p.shape, group))
            self.register_parameter(name, local._parameters[name])  # the experts' own names
        local.num_experts = per_rank
        self._local = [local]  # not a child: its parameters are this module's, under their names

    def split_parameters(self) -> list[nn.Parameter]:
        """The parameters split over the expert group (one slice per expert); the others are replicas."""
        return [p for p in self.parameters() if tensor_shard(p) is not None]

    def whole(self, p: torch.Tensor) -> torch.Tensor:
        """Every expert's slice of parameter p, gathered over the expert group (a collective)."""
        if tensor_shard(p) is None:
            return p.detach()  # not split (a parameter without one slice per expert)
        out = p.new_empty((self.num_experts, *p.shape[1:]))
        dist.all_gather_into_tensor(out, p.detach().contiguous(), group=self.group)
        return out

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        compute = partial(self._compute, dtype=top_k_weights.dtype)
        if self.overlap:
            return overlapped(compute, hidden, top_k_index, top_k_weights, self.num_experts, self.group)
        rows, plan = dispatch(hidden, top_k_index, self.num_experts, self.group)
        return combine(compute(rows, plan.local_ids), plan, top_k_weights, self.group, hidden.dtype)

    def _compute(self, rows: torch.Tensor, local_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts on the rows that came here, each row its one local expert at weight 1 (`dtype`:
        the router weights')."""
        ones = torch.ones(rows.shape[0], 1, dtype=dtype, device=rows.device)
        return self._local[0](rows, local_ids.unsqueeze(-1), ones)


def shard_experts(module: nn.Module, group: Any, overlap: bool = False) -> int:
    """Split every MoE layer's experts in `module` over `group`; returns how many layers were split.
    Call it before building the optimizers (the expert parameters are new tensors). `overlap`: each layer's
    all-to-alls hidden behind its experts' compute (ExpertParallel's), the same on every rank."""
    done = 0
    for parent in list(module.modules()):
        experts = dict(parent.named_children()).get("experts")
        if experts is None or isinstance(experts, ExpertParallel):
            continue
        stacked = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
        if not stacked:
            continue  # a ModuleList of experts (not the stacked layout transformers 5 uses)
        parent.experts = ExpertParallel(experts, stacked[0].shape[0], group, overlap)
        done += 1
    return done


def whole_experts(module: nn.Module) -> dict[int, torch.Tensor]:
    """id(parameter) -> its whole value, for every expert parameter of `module` (a collective over each
    layer's expert group): what an export under the Hugging Face names needs."""
    return {id(p): m.whole(p) for m in module.modules() if isinstance(m, ExpertParallel)
            for p in m.split_parameters()}


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The split parameters of every ExpertParallel in `module`: what is reduced over the expert's data group
    (one without a slice per expert is a replica, reduced with the dense parameters)."""
    return [p for m in module.modules() if isinstance(m, ExpertParallel) for p in m.split_parameters()]
