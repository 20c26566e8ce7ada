"""The param groups of a model with sharded experts: one optimizer, each group reduced over its own ranks.

A dense parameter is a replica on every rank of data x expert x sequence, so it is averaged over
that whole group (the optimizer's, grid.data_sequence_group). An expert's gradient already sums
what every rank of its expert group sent it; the ranks holding the same experts
(grid.expert_data_group: data x sequence x tensor, each sequence rank routing its own slice of the
rows and each tensor rank its own share of those, pipe/tensor_tokens.py) sum it and divide by data x
expert x sequence, which is the mean the dense parameters get (the tensor ranks' shares are one
replica's rows: summed, not averaged). The
expert group says so with two keys ZeroOptimizer reads (zero/reduction.py: "zero_group",
"zero_mean_over"), which also make ZeRO shard the experts over their own group, and let the loss
scaler's inf/nan check and the global gradient norm see them with everything else (each expert
counted once: its slices lie on the ranks of its own group, and every expert group holds other
experts).
DeepSpeed-MoE and Megatron-core reduce experts over the same expert-data-parallel group.

Beside a tensor split each MoE block runs on its tensor rank's share of the tokens with whole parameters
(pipe/tensor_tokens.py), so every parameter of the block is summed over the tensor ranks too, here,
once a step: at expert 1 the whole block (router, experts, shared experts) in one group over
data x sequence x tensor (grid.expert_data_group), at expert > 1 the split experts as above and the
block's dense parameters (router, shared experts) over data x expert x sequence x tensor
(grid.stage_group); each divided by data x expert x sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.comm import all_reduce
from pipezero.pipe.expert.block import ExpertParallel, expert_parameters
from pipezero.pipe.tensor_tokens import token_share, token_split_parameters
from pipezero.topology import Grid, process_device

__all__ = ["expert_param_groups"]


def _check(module: nn.Module, grid: Grid) -> None:
    """The experts were split over the grid's expert axis, their blocks on a token share beside a tensor split.

    Decided on every rank together (one all-reduce of two counts over the world): a pipeline stage with no
    MoE layer sees nothing wrong on its own and would otherwise go on into a collective the others never
    reach. Experts left whole train as dense layers, correctly, only without the expert split.
    """
    layers = [m for m in module.modules() if isinstance(m, ExpertParallel)]
    degrees = sorted({dist.get_world_size(m.group) for m in layers})
    wrong = [d for d in degrees if d != grid.expert_size]
    whole = [type(m).__name__ for m in module.modules() if any(isinstance(c, ExpertParallel) for c in m.children())
             and token_share(m) is None] if grid.tensor_size > 1 else []
    counts = torch.tensor([len(wrong), len(whole)], dtype=torch.int64, device=process_device())
    all_reduce(counts)  # every rank refuses what any rank sees, before any later collective can hang
    wrong_anywhere, whole_anywhere = counts.tolist()
    here = " on another rank (a pipeline stage this rank does not hold)"
    if wrong_anywhere:
        raise ValueError(f"expert_param_groups: the experts are split over groups of {wrong or 'other'} ranks"
                         f"{'' if wrong else here}, the grid's expert axis has {grid.expert_size}; shard them "
                         "with shard_experts(module, grid.expert_group)")
    if whole_anywhere:
        raise ValueError(f"expert_param_groups: on {grid!r} the experts' gradients are summed over the tensor ranks, "
                         "which needs each MoE block run on its tensor rank's share of the tokens, but "
                         f"{whole or 'MoE blocks' + here} run on every token; give them SplitTokens in the tensor "
                         "plan (hf_tensor_plan does)")


def expert_param_groups(module: nn.Module, grid: Grid, **options: Any) -> list[dict[str, Any]]:
    """[dense parameters, expert parameters, a token-split block's other parameters] (the last two when this
    rank holds any) for one ZeroOptimizer over grid.data_sequence_group; `options` (lr, weight_decay, ...)
    go into every group.

    Call it after shard_experts(module, grid.expert_group) when the grid has an expert axis, on every rank
    (a collective: the checks agree over the world, so a refusal is raised on all ranks); beside a tensor
    split at any expert degree too (the module docstring says why). Trainable parameters only. The groups'
    keys are ZeroOptimizer's; a plain torch optimizer would ignore them (and reduce nothing).
    """
    _check(module, grid)
    experts = [p for p in expert_parameters(module) if p.requires_grad]  # a replica among them stays dense
    ids = {id(p) for p in experts}
    split = [p for p in token_split_parameters(module) if id(p) not in ids]  # whole on every tensor rank
    ids.update(id(p) for p in split)
    dense = [p for p in module.parameters() if p.requires_grad and id(p) not in ids]
    mean = {**options, "zero_mean_over": grid.data_sequence_size}
    groups = [{"params": dense, **options}]
    if experts:
        groups.append({"params": experts, **mean, "zero_group": grid.expert_data_group})
    if split:
        groups.append({"params": split, **mean, "zero_group": grid.stage_group})
    return groups
