"""Expert parallelism: a MoE layer's experts split over an expert group, tokens exchanged by all-to-all.

all_to_all.py (the rows' exchange, with autograd), dispatch.py (the dropless dispatch and the
combine), in_flight.py (the exchange as a launch and a wait node) and overlap.py (a layer's tokens in
two halves, each half's exchanges behind the other's experts), relay.py (a DualPipeV pair's forward and
backward in turns, switching at each launch: one micro-batch's exchange behind the other's compute),
block.py (ExpertParallel, shard_experts), groups.py (expert_param_groups: one ZeroOptimizer, the experts
reduced over their own data group).
"""

from pipezero.pipe.expert.block import ExpertParallel, expert_parameters, shard_experts, whole_experts
from pipezero.pipe.expert.groups import expert_param_groups

__all__ = ["ExpertParallel", "expert_param_groups", "expert_parameters", "shard_experts", "whole_experts"]
