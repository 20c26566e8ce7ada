"""ZeroConfig: the knobs of ZeroOptimizer, and the one reader of DeepSpeed's `zero_optimization` section.

`ZeroConfig.from_dict` is the only reader of that section: `ZeroOptimizer.from_config` and
train/'s `parse_config` both call it, so they cannot disagree. It applies DeepSpeed 0.19.8's
defaults (stage 0, 5e8-element buckets, overlap_comm on at stage 3 only), its aliases
(`prefetch_bucket_size` for `stage3_prefetch_bucket_size`, ...) and deprecated spellings
(`cpu_offload`, `cpu_offload_param`), and its stage rules (offload_param means nothing below
stage 3, offload_optimizer nothing at stage 0: warned about once and ignored, as DeepSpeed
ignores them). "auto" sizes follow the model's hidden size h as the Hugging Face integration
fills them: reduce_bucket_size = h*h, stage3_prefetch_bucket_size = int(0.9*h*h),
stage3_param_persistence_threshold = 10*h; any other "auto" takes DeepSpeed's default.
Sizes are element counts, as in DeepSpeed. Constructing ZeroConfig directly keeps pipezero's
own defaults (stage 2, 5e7-element buckets, overlap on), tuned for the Python API.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from pipezero.checks import is_int
from pipezero.config_fields import AUTO, ConfigError, Ignored, Section, Unsupported, warn_once

__all__ = ["OFFLOAD_RULES", "ZERO_RULES", "ZeroConfig"]

_HF_AUTO = {  # the sizes the Hugging Face integration fills from the hidden size
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
_PREFETCH = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")
_PERSIST = ("stage3_param_persistence_threshold", "param_persistence_threshold")
_KEYS = ("stage", "reduce_bucket_size", "overlap_comm", "offload_optimizer", "offload_param", "cpu_offload",
         "cpu_offload_param", *_PREFETCH, *_PERSIST)
_KNOB = "a DeepSpeed tuning knob with no counterpart here"


ZERO_RULES = {
    **{k: Ignored(_KNOB, noop=default) for keys, default in (
        (("sub_group_size", "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
          "max_reuse_distance"), 1_000_000_000),
        (("stage3_model_persistence_threshold", "model_persistence_threshold"), sys.maxsize),
        (("stage3_module_granularity_threshold", "module_granularity_threshold"), 0)) for k in keys},
    "allgather_bucket_size": Ignored("updated parameters are gathered per gradient bucket", noop=500_000_000),
    "contiguous_gradients": Ignored("gradients always go through contiguous bucket buffers", noop=True),
    "reduce_scatter": Ignored("stages 1-3 always reduce-scatter", noop=True),
    "allgather_partitions": Ignored("updated partitions are always all-gathered", noop=True),
    "use_multi_rank_bucket_allreduce": Ignored(_KNOB, noop=True),
    "stage3_use_all_reduce_for_fetch_params": Ignored(_KNOB, noop=False),
    "use_all_reduce_for_fetch_params": Ignored(_KNOB, noop=False),
    "stage3_allgather_sequential": Ignored(_KNOB, noop=False),
    "allgather_sequential": Ignored(_KNOB, noop=False),
    "round_robin_gradients": Ignored(_KNOB, noop=False),
    "parameter_alignment": Ignored(_KNOB, noop=False),
    "memory_efficient_linear": Ignored(_KNOB, noop=True),
    "override_module_apply": Ignored(_KNOB, noop=True),
    "compute_grad_norm": Ignored("the global gradient norm is computed when clipping", noop=True),
    "legacy_stage1": Ignored("there is one stage 1", noop=False),
    "cpu_offload_use_pin_memory": Ignored("offloaded state is pinned whenever CUDA is present"),
    "stage3_gather_16bit_weights_on_model_save": Ignored("export_model always writes whole weights", noop=False),
    "gather_16bit_weights_on_model_save": Ignored("export_model always writes whole weights", noop=False),
    "stage3_gather_fp16_weights_on_model_save": Ignored("export_model always writes whole weights", noop=False),
    "load_from_fp32_weights": Ignored("checkpoints always restore the fp32 masters", noop=True),
    "elastic_checkpoint": Ignored("checkpoints load onto any grid", noop=False),
    "ignore_unused_parameters": Ignored("parameters without gradients are always skipped", noop=True),
    "pipeline_loading_checkpoint": Ignored(_KNOB, noop=False),
    "log_trace_cache_warnings": Ignored(_KNOB, noop=False),
    "enable_sanity_checks": Ignored(_KNOB, noop=False),
    "save_muon_momentum_buffer_in_memory": Ignored(_KNOB, noop=False),
    "leaf_module": Ignored(_KNOB, noop=lambda v: not v or v == {}),
    "zero_hpz_partition_size": Unsupported("ZeRO++ hierarchical partitioning of stage-3 weights",
                                           "set it to 1", noop=1),
    "zero_quantized_weights": Unsupported("ZeRO++ quantized weight all-gather", "set it false", noop=False),
    "zero_quantized_nontrainable_weights": Unsupported("ZeRO++ quantized frozen weights", "set it false",
                                                       noop=False),
    "zero_quantized_gradients": Unsupported("ZeRO++ quantized gradient reduction", "set it false", noop=False),
    "zenflow": Unsupported("ZenFlow, stall-free CPU offload of unimportant gradients",
                           'use "offload_optimizer": {"device": "cpu"}', noop=lambda v: v is None),
    **{k: Unsupported("MiCS sharding (removed from DeepSpeed too)", "use ZeRO stage 3")
       for k in ("mics_shard_size", "mics_hierarchical_params_gather")},
}
OFFLOAD_RULES = {
    "pin_memory": Ignored("offloaded state is pinned whenever CUDA is present", noop=True),
    "fast_init": Ignored(_KNOB, noop=False),
    "pipeline_read": Ignored("only for NVMe offload", noop=False),
    "pipeline_write": Ignored("only for NVMe offload", noop=False),
    "nvme_path": Ignored("only for NVMe offload", noop=lambda v: True),
    **{k: Ignored("only for NVMe offload", noop=lambda v: True) for k in ("buffer_count", "buffer_size",
                                                                          "max_in_cpu")},
    "ratio": Unsupported("partial optimizer offload", "set it to 1.0 (offload everything)", noop=1.0),
    "super_offload": Unsupported("SuperOffload's CPU optimizer for superchips", "set it false", noop=False),
    "cpuadam_cores_perc": Ignored("CPU offload steps torch's own optimizer", noop=0.8),
}


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """How ZeroOptimizer partitions and moves model state."""

    stage: int = 2
    """0: averaged gradients (DDP); 1: + sharded optimizer state; 2: + sharded gradients; 3: + sharded parameters."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient bucket (one collective each)."""
    overlap_comm: bool = True
    """Reduce buckets during backward as they fill (False: all at step time)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of the next units (in the recorded order) gathered ahead; 0 turns prefetch off."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    offload_optimizer: bool = False
    """Keep fp32 master shards and optimizer state on the CPU and step there."""
    offload_param: bool = False
    """Stage 3: keep the owned parameter slices on the CPU between uses (any data degree, one included)."""
    delayed_param_update: bool = False
    """With offload_optimizer: step k's CPU update runs during step k+1's forward and backward and is
    applied at step k+1's step() (ZeRO-Offload's DPU; see zero/offload.py). Set here; ds_config has no such key."""
    reduce_every_microbatch: bool = False
    """Stages 2-3: reduce-scatter every backward's gradients into the shard, even inside no_sync or
    a pipeline hold, so no whole gradient outlives its bucket (DeepSpeed ZeRO-2's behaviour; more
    reduce traffic, less memory). False: accumulate whole .grad until the final micro-batch."""
    grad_accum_dtype: torch.dtype | None = None
    """The dtype gradients are summed in between backward and step: torch.float32 under a bf16/fp16
    model adds every micro-batch's gradient into fp32 buckets (DeepSpeed's data_types.grad_accum_dtype;
    its BF16_Optimizer at stage 1). None: the parameters' dtype. At stages 2-3 a wider dtype reduces
    every micro-batch (as reduce_every_microbatch does), so the shard sums each reduced micro-batch in
    it, as DeepSpeed's ZeRO-2/3 do. A tied weight the pipeline holds intact is summed per micro-batch
    in it too, and added up over its owners in it (DeepSpeed's pipeline: its fp32 gradients)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are reduced in over the data group (DeepSpeed's communication_data_type):
    a sum kept in fp32 is rounded to it for the collective and back. None: the parameters' dtype,
    DeepSpeed's default."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroConfig(stage={self.stage!r}): stage must be 0, 1, 2 or 3")
        for name, low in (("reduce_bucket_size", 1), ("stage3_prefetch_bucket_size", 0),
                          ("stage3_param_persistence_threshold", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ZeroConfig({name}={value!r}): must be an integer number of elements >= {low}")
        for name in ("overlap_comm", "offload_optimizer", "offload_param", "reduce_every_microbatch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ZeroConfig({name}={getattr(self, name)!r}): must be True or False")
        if self.reduce_every_microbatch and self.stage < 2:
            raise ValueError(f"ZeroConfig(reduce_every_microbatch=True, stage={self.stage}): only stages 2-3 "
                             "shard gradients; use stage=2, or leave reduce_every_microbatch False")
        if self.delayed_param_update and not self.offload_optimizer:
            raise ValueError("ZeroConfig(delayed_param_update=True, offload_optimizer=False): the delayed update "
                             "overlaps the CPU optimizer step; set offload_optimizer=True or leave it False")
        for name in ("grad_accum_dtype", "reduce_dtype"):
            if getattr(self, name) not in (None, torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"ZeroConfig({name}={getattr(self, name)!r}): expected torch.float32, "
                                 "torch.bfloat16, torch.float16 or None (the parameters' dtype)")
        if self.offload_param and self.stage != 3:
            raise ValueError(f"ZeroConfig(offload_param=True, stage={self.stage}): parameter offload needs "
                             "stage 3; use offload_optimizer for stages 1-2")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None, hidden_size: int | None = None) -> "ZeroConfig":
        """Read DeepSpeed's `zero_optimization` section with DeepSpeed's defaults (see the module docstring)."""
        if isinstance(cfg, bool):  # DeepSpeed's oldest format: "zero_optimization": true means stage 1
            cfg = {"stage": int(cfg)}
        sec = Section(cfg, ("zero_optimization",))
        sec.check(_KEYS, ZERO_RULES)
        stage = sec.int("stage", 0, lo=0, hi=3)
        sizes = _sizes(sec, hidden_size)
        offload_optimizer = _offload(sec, "offload_optimizer", "cpu_offload", stage, lowest=1)
        offload_param = _offload(sec, "offload_param", "cpu_offload_param", stage, lowest=3)
        return cls(stage=stage, overlap_comm=sec.bool("overlap_comm", stage == 3), **sizes,
                   offload_optimizer=offload_optimizer, offload_param=offload_param)


def _sizes(sec: Section, hidden_size: int | None) -> dict[str, int]:
    """The three sizes, each an element count, a float like 5e8, or "auto" (from hidden_size)."""
    out = {}
    for spellings, default, low in ((("reduce_bucket_size",), 500_000_000, 1), (_PREFETCH, 50_000_000, 0),
                                    (_PERSIST, 100_000, 0)):
        key = sec.one_of(*spellings)
        if sec.data.get(key) == AUTO:
            out[spellings[0]] = _auto_size(sec, key, spellings[0], hidden_size)
        else:
            out[spellings[0]] = sec.int(key, default, lo=low)
    return out


def _auto_size(sec: Section, key: str, name: str, hidden_size: int | None) -> int:
    if hidden_size is None:
        raise ConfigError(f'{sec.where(key)} is "auto": pass hidden_size= (the model\'s width) to parse_config, '
                          f"build, initialize or ZeroOptimizer.from_config, so it becomes "
                          f"{'h*h' if name == 'reduce_bucket_size' else '0.9*h*h' if 'prefetch' in name else '10*h'} "
                          f"as Hugging Face fills it, or write the number")
    if not is_int(hidden_size, minimum=1):
        raise ValueError(f"hidden_size={hidden_size!r}: expected the model's width, a positive int")
    return _HF_AUTO[name](hidden_size)


def _offload(sec: Section, key: str, old_key: str, stage: int, lowest: int) -> bool:
    """Whether state goes to the CPU: the offload section, or DeepSpeed's deprecated boolean spelling."""
    if old_key in sec.data:
        if key in sec.data:
            raise ConfigError(f"{sec.path} sets both {old_key!r} (deprecated) and {key!r}: keep {key!r}")
        warn_once(f'{sec.where(old_key)} is deprecated in DeepSpeed: read as "{key}": {{"device": "cpu"}}')
        on = sec.bool(old_key, False)
    else:
        off = sec.section(key)
        off.check(("device",), OFFLOAD_RULES)
        device = off.choice("device", "none", ("none", "cpu", "nvme"))
        if device == "nvme":
            raise ConfigError(f'{off.where("device")} = "nvme": DeepSpeed\'s NVMe offload (ZeRO-Infinity: state '
                              f'kept on NVMe drives) is not supported by pipezero: remove it or use "cpu"')
        on = device == "cpu"
    if on and stage < lowest:
        warn_once(f"{sec.where(key)} is ignored at stage {stage}, as DeepSpeed ignores it: it takes effect from "
                  f"stage {lowest}")
        return False
    return on
