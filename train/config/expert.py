"""ds_config "expert_parallel" (DeepSpeed 0.19.8's AutoEP section): the grid's expert degree.

{"enabled": true, "autoep_size": N} splits each MoE layer's experts over N consecutive ranks of
the data axis (Grid(expert=N), pipe/expert/); the dense layers stay replicas over data x expert.
DeepSpeed's other AutoEP keys pick its own routing and expert tensor split, which pipezero
refuses (it runs the model's own router and transformers' experts implementation), and its
kernels, which are ignored. One key is pipezero's own, not DeepSpeed's (whose AutoEP parser reads
the keys it knows and passes over any other): "overlap": true cuts each MoE layer's tokens in two
halves whose all-to-alls travel while the other half's experts compute (pipe/expert/overlap.py);
off by default until a multi-GPU run measures it. A second one, "overlap_pairs": true, runs each
pair of neighbouring steps (a forward beside another micro-batch's backward: DualPipeV's steady state,
1F1B's, ZB-V's) in turns, one micro-batch's all-to-all travelling while the other computes
(PipelineRunner(overlap_pairs=True), pipe/pairs.py); off by default too, a no-op at expert 1, refused
beside compiled layers (ds_config "compile" off).
"""

from __future__ import annotations

from typing import Any

from pipezero.config_fields import ConfigError, Ignored, Section, Unsupported

__all__ = ["read_expert"]

_OWN = "the model's own router and transformers' experts implementation run here"
# AutoEP's routing and exchange keys at DeepSpeed 0.19.8's defaults (auto_ep_config.py): silent there
_ROUTING = {"preset_model": None, "moe_layer_pattern": None, "expert_pattern": None, "router_pattern": None,
            "route_norm": None, "route_scale": 1.0, "score_apply": "auto", "score_func": "auto", "top_k": "auto",
            "num_expert_groups": None, "num_limited_groups": None, "routed_scaling_factor": "auto",
            "load_balance_coeff": None, "combine_impl": "auto", "row_weighting_impl": "auto",
            "gate_up_impl": "separate", "comm_backend": "comm", "comm_num_sm": 12, "comm_qp_margin": 4,
            "comm_max_tokens_per_rank": 0}
_KERNELS = ("use_grouped_mm", "disable_triton_grouped_mm", "validate_folding_routing", "async_split_plan")
_RULES = {"expert_tensor_parallel_size": Unsupported("expert weights split over tensor ranks", "set it to 1", noop=1),
          **{key: Unsupported(f"AutoEP's {key}: {_OWN}", f"leave it at {default!r}", noop=default)
             for key, default in _ROUTING.items()},
          **{key: Ignored(f"AutoEP's kernel switch ({_OWN})", noop=lambda v: True) for key in _KERNELS}}


def read_expert(value: Any, data_degree: int) -> tuple[int, bool, bool]:
    """(the expert degree (1: off), "overlap", "overlap_pairs") from the section, the degree checked to divide
    the data degree (world / pipe x tensor x sequence, which the expert axis splits into data x expert)."""
    section = Section(value, ("expert_parallel",))
    section.check(("enabled", "autoep_size", "overlap", "overlap_pairs"), _RULES)
    overlap = section.bool("overlap", False)  # pipezero's keys
    pairs = section.bool("overlap_pairs", False)
    if not section.bool("enabled", False):
        return 1, False, False
    size = section.int("autoep_size", 1, lo=1)
    if data_degree % size:
        raise ConfigError(f'{section.where("autoep_size")} = {size} does not divide the data degree {data_degree} '
                          "(world / (pipe x tensor x sequence)), which the expert axis splits into data x expert: "
                          "start a multiple of it as data ranks, or pick a divisor")
    return size, overlap and size > 1, pairs and size > 1
