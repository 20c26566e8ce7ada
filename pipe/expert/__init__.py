"""Expert parallelism: a MoE layer's experts split over an expert group, tokens exchanged by all-to-all.

all_to_all.py (the rows' exchange, with autograd), dispatch.py (the dropless dispatch and the
combine), block.py (ExpertParallel, shard_experts), grads.py (the expert parameters' reduction).
"""

from pipezero.pipe.expert.block import ExpertParallel, expert_parameters, shard_experts, whole_experts
from pipezero.pipe.expert.grads import reduce_expert_grads

__all__ = ["ExpertParallel", "expert_parameters", "reduce_expert_grads", "shard_experts", "whole_experts"]
