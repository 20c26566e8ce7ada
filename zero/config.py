"""ZeroConfig: the knobs of ZeroOptimizer, and DeepSpeed's `zero_optimization` keys read into it.

"auto" values are resolved from the model's hidden size h the way the Hugging Face
DeepSpeed integration documents it: reduce_bucket_size = h*h,
stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h.
Sizes are in elements, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

__all__ = ["ZeroConfig", "resolve_auto"]

_AUTO_RULES = {
    "reduce_bucket_size": lambda h: h * h,
    "allgather_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# DeepSpeed keys about features pipezero does not have, or does not need a knob for: accepted, ignored
_IGNORED_KEYS = {"sub_group_size", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
                 "stage3_gather_fp16_weights_on_model_save", "round_robin_gradients", "load_from_fp32_weights",
                 "elastic_checkpoint", "ignore_unused_parameters", "memory_efficient_linear"}
_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "fast_init", "ratio", "nvme_path", "buffer_size",
                 "max_in_cpu"}


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """How ZeroOptimizer partitions and moves model state."""

    stage: int = 2
    """0: averaged gradients (DDP); 1: + sharded optimizer state; 2: + sharded gradients; 3: + sharded parameters."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient bucket (one collective each)."""
    allgather_bucket_size: int = 50_000_000
    """Accepted for DeepSpeed compatibility; updated parameters are gathered per gradient bucket."""
    overlap_comm: bool = True
    """Reduce buckets during backward as they fill (False: all at step time)."""
    contiguous_gradients: bool = True
    """Accepted for DeepSpeed compatibility; gradients always go through contiguous bucket buffers."""
    reduce_scatter: bool = True
    """Accepted for DeepSpeed compatibility; stages 1-3 always reduce-scatter."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of the next units (in the recorded order) gathered ahead; 0 turns prefetch off."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Accepted for DeepSpeed compatibility."""
    offload_optimizer: bool = False
    """Keep fp32 master shards and optimizer state on the CPU and step there."""
    offload_param: bool = False
    """Stage 3: keep the owned parameter slices on the CPU between uses (any data degree, one included)."""
    delayed_param_update: bool = False
    """With offload_optimizer: step k's CPU update runs during step k+1's forward and backward and is
    applied at step k+1's step() (ZeRO-Offload's DPU; see zero/offload.py). pipezero's own key."""
    reduce_every_microbatch: bool = False
    """Stages 2-3: reduce-scatter every backward's gradients into the shard, even inside no_sync or
    a pipeline hold, so no whole gradient outlives its bucket (DeepSpeed ZeRO-2's behaviour; more
    reduce traffic, less memory). False: accumulate whole .grad until the final micro-batch."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroConfig(stage={self.stage!r}): stage must be 0, 1, 2 or 3")
        for name, low in (("reduce_bucket_size", 1), ("allgather_bucket_size", 1), ("stage3_max_live_parameters", 1),
                          ("stage3_prefetch_bucket_size", 0), ("stage3_param_persistence_threshold", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ZeroConfig({name}={value!r}): must be an integer number of elements >= {low}")
        if not isinstance(self.reduce_every_microbatch, bool):
            raise TypeError(f"ZeroConfig(reduce_every_microbatch={self.reduce_every_microbatch!r}): must be "
                            "True or False")
        if self.reduce_every_microbatch and self.stage < 2:
            raise ValueError(f"ZeroConfig(reduce_every_microbatch=True, stage={self.stage}): only stages 2-3 "
                             "shard gradients; use stage=2, or leave reduce_every_microbatch False")
        if self.delayed_param_update and not self.offload_optimizer:
            raise ValueError("ZeroConfig(delayed_param_update=True, offload_optimizer=False): the delayed update "
                             "overlaps the CPU optimizer step; set offload_optimizer=True or leave it False")
        if self.offload_param and self.stage != 3:
            raise ValueError(f"ZeroConfig(offload_param=True, stage={self.stage}): parameter offload needs "
                             "stage 3; use offload_optimizer for stages 1-2")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], hidden_size: int | None = None) -> "ZeroConfig":
        """Read DeepSpeed's `zero_optimization` section; unknown keys are errors."""
        if not isinstance(cfg, Mapping):
            raise TypeError(f"zero_optimization must be a dict, got {type(cfg).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in resolve_auto(cfg, hidden_size).items():
            if key in ("offload_optimizer", "offload_param"):
                kwargs[key] = _offload_device(key, value)
            elif key in known:
                kwargs[key] = value
            elif key in _IGNORED_KEYS:
                continue
            else:
                raise ValueError(f"zero_optimization.{key} is not a known key; known keys are "
                                 f"{sorted(known)} (and DeepSpeed's {sorted(_IGNORED_KEYS)}, ignored)")
        return cls(**kwargs)


def _offload_device(key: str, value: Any) -> bool:
    """{"device": "cpu"} -> True, {"device": "none"} or None -> False."""
    if value is None:
        return False
    if not isinstance(value, Mapping):
        raise TypeError(f"zero_optimization.{key} must be a dict like {{\"device\": \"cpu\"}}, got {value!r}")
    unknown = set(value) - _OFFLOAD_KEYS
    if unknown:
        raise ValueError(f"zero_optimization.{key} has unknown keys {sorted(unknown)}; "
                         f"known keys are {sorted(_OFFLOAD_KEYS)}")
    device = value.get("device", "none")
    if device not in ("cpu", "none"):
        raise ValueError(f"zero_optimization.{key}.device={device!r}: pipezero offloads to \"cpu\" or \"none\" "
                         "(NVMe offload is not supported)")
    return device == "cpu"


def resolve_auto(cfg: Mapping[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """Replace "auto" values with the Hugging Face integration's formulas in the hidden size."""
    out = dict(cfg)
    for key, value in cfg.items():
        if value != "auto":
            continue
        if key not in _AUTO_RULES:
            raise ValueError(f"zero_optimization.{key}=\"auto\": only {sorted(_AUTO_RULES)} may be \"auto\"")
        if hidden_size is None:
            raise ValueError(f"zero_optimization.{key}=\"auto\" needs the model's hidden size: pass "
                             "hidden_size= to from_config, or a module with config.hidden_size")
        out[key] = _AUTO_RULES[key](hidden_size)
    return out
