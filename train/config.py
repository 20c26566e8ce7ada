"""ds_config.json -> small typed dataclasses, validated whole before any process group exists.

DeepSpeed users' configs are accepted as written. Every key is either read into a field,
listed as cosmetic (ignored with a one-time warning, see COSMETIC_KEYS and
ZERO_COSMETIC_KEYS), or an error that names the key and the fix. Batch arithmetic
(train_batch_size = micro batch x accumulation steps x data degree) and ZeRO's "auto" sizes
are resolved here, from numbers the caller passes in (world size, hidden size), so every rank
reaches the same verdict without communicating.

    cfg = parse_config("ds_config.json", world_size=4, hidden_size=768)
    scaler = LossScaler.from_config(inner, cfg.fp16.to_dict())
    zero = ZeroOptimizer.from_config(scaler, cfg.zero.to_dict(), group=grid.data_group)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from pipezero.pipe.registry import schedule_entry, schedule_names
from pipezero.train.config_batch import BatchConfig, resolve_batch
from pipezero.train.config_fields import AUTO, ConfigError, ConfigTypeError, Section
from pipezero.train.config_optim import OptimizerConfig, SchedulerConfig

__all__ = ["BF16Config", "BatchConfig", "COSMETIC_KEYS", "ConfigError", "ConfigTypeError",
           "FP16Config", "OffloadConfig", "OffloadDevice", "PipelineConfig",
           "TensorBoardConfig", "TrainConfig", "ZERO_COSMETIC_KEYS", "ZeroOptimizationConfig",
           "parse_config"]

# Keys that change nothing we compute: accepted with a one-time warning (key -> why).
COSMETIC_KEYS: dict[str, str] = {
    "memory_breakdown": "peak memory is always logged to TensorBoard",
    "dump_state": "print the TrainConfig instead",
    "flops_profiler": "MFU is logged from examples/gpt.py's FLOPs count",
    "comms_logger": "bytes moved per collective are always counted (pipezero.comm.TRAFFIC)",
    "wandb": "only TensorBoard is written",
    "csv_monitor": "only TensorBoard is written",
    "zero_allow_untested_optimizer": "any torch optimizer may be wrapped",
    "zero_force_ds_cpu_optimizer": "CPU offload steps torch's own optimizer",
}
ZERO_COSMETIC_KEYS: dict[str, str] = {
    key: "a DeepSpeed tuning knob with no counterpart here" for key in (
        "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "round_robin_gradients", "elastic_checkpoint", "load_from_fp32_weights",
        "ignore_unused_parameters", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
        "allgather_partitions")}
_OFFLOAD_COSMETIC = {k: "a DeepSpeed tuning knob with no counterpart here"
                     for k in ("buffer_count", "buffer_size", "max_in_cpu", "fast_init")}
_UNSUPPORTED = {
    "amp": "use the fp16 or bf16 section",
    "activation_checkpointing": 'use "pipeline": {"activation_checkpoint_interval": N}',
    "prescale_gradients": "gradients are averaged after reduction; remove the key",
    "gradient_predivide_factor": "gradients are averaged after reduction; remove the key",
    "communication_data_type": "gradients are reduced in their own dtype; remove the key",
    **{k: "pipezero does not offer it; remove the section" for k in (
        "sparse_attention", "elasticity", "compression_training", "data_efficiency",
        "curriculum_learning", "autotuning", "aio", "nebula", "checkpoint")},
}


class OffloadDevice(enum.Enum):
    """Where ZeRO keeps offloaded optimizer state or parameters."""

    NONE = "none"
    CPU = "cpu"


@dataclass(kw_only=True, slots=True, frozen=True)
class FP16Config:
    """ds_config["fp16"]: fp16 compute with a static (loss_scale > 0) or dynamic (0) loss scale."""

    enabled: bool = False
    loss_scale: float = 0.0          # 0: dynamic, else the static scale
    initial_scale_power: int = 16    # dynamic scale starts at 2**power
    loss_scale_window: int = 1000    # overflow-free steps before the scale doubles
    hysteresis: int = 2              # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False

    @classmethod
    def parse(cls, sec: Section) -> "FP16Config":
        """Read the section (all DeepSpeed keys)."""
        cfg = cls(enabled=sec.bool("enabled", False), loss_scale=sec.float("loss_scale", 0.0, lo=0.0),
                  initial_scale_power=sec.int("initial_scale_power", 16, lo=0, hi=64),
                  loss_scale_window=sec.int("loss_scale_window", 1000, lo=1),
                  hysteresis=sec.int("hysteresis", 2, lo=1),
                  consecutive_hysteresis=sec.bool("consecutive_hysteresis", False),
                  min_loss_scale=sec.float("min_loss_scale", 1.0, lo=0.0),
                  auto_cast=sec.bool("auto_cast", False))
        sec.finish(known={"fp16_master_weights_and_grads": "master weights are always fp32"})
        return cfg

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale adapts to overflows."""
        return self.loss_scale == 0

    def to_dict(self) -> dict[str, Any]:
        """The section with DeepSpeed's key names, for LossScaler.from_config."""
        return dataclasses.asdict(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class BF16Config:
    """ds_config["bf16"] (or its old name "bfloat16"): bf16 compute, no loss scale needed."""

    enabled: bool = False
    check_grad_overflow: bool = False    # skip steps with inf/nan gradients even without scaling
    immediate_grad_update: bool = False  # accepted for DeepSpeed configs; gradients accumulate in fp32

    @classmethod
    def parse(cls, sec: Section) -> "BF16Config":
        """Read the section."""
        cfg = cls(enabled=sec.bool("enabled", False),
                  check_grad_overflow=sec.bool("check_grad_overflow", False),
                  immediate_grad_update=sec.bool("immediate_grad_update", False))
        sec.finish()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The section with DeepSpeed's key names, for LossScaler.from_config."""
        return dataclasses.asdict(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class OffloadConfig:
    """ds_config["zero_optimization"]["offload_optimizer" | "offload_param"]."""

    device: OffloadDevice = OffloadDevice.NONE
    pin_memory: bool = False

    @classmethod
    def parse(cls, sec: Section) -> "OffloadConfig":
        """Read the section; NVMe is refused with the fix."""
        if sec.raw("device") == "nvme":
            raise ConfigError(f'{sec.where("device")} = "nvme" is not supported: use "cpu" or "none"')
        cfg = cls(device=OffloadDevice(sec.choice("device", "none", [d.value for d in OffloadDevice])),
                  pin_memory=sec.bool("pin_memory", False))
        sec.finish(cosmetic=_OFFLOAD_COSMETIC,
                   known={"nvme_path": 'NVMe offload is not offered; use "device": "cpu"',
                          "ratio": "partial offload is not offered; offload everything or nothing"})
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed's form: {"device": "cpu", "pin_memory": true}."""
        return {"device": self.device.value, "pin_memory": self.pin_memory}


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroOptimizationConfig:
    """ds_config["zero_optimization"]: ZeRO stage, offload, overlap and bucket sizes.

    Bucket sizes are element counts, as in DeepSpeed. "auto" sizes follow the model's hidden
    size h (as the HuggingFace integration fills them in): reduce_bucket_size = h*h,
    stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h.
    """

    stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int | str = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int | str = 50_000_000
    stage3_param_persistence_threshold: int | str = 100_000

    _AUTO_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

    @classmethod
    def parse(cls, sec: Section) -> "ZeroOptimizationConfig":
        """Read the section and check that offload fits the stage."""
        if "cpu_offload" in sec.data:
            raise ConfigError(f'{sec.where("cpu_offload")} is DeepSpeed\'s old spelling: write '
                              f'"offload_optimizer": {{"device": "cpu"}}')
        stage = sec.int("stage", 0, lo=0, hi=3)
        cfg = cls(stage=stage, offload_optimizer=OffloadConfig.parse(sec.section("offload_optimizer")),
                  offload_param=OffloadConfig.parse(sec.section("offload_param")),
                  overlap_comm=sec.bool("overlap_comm", stage == 3),
                  contiguous_gradients=sec.bool("contiguous_gradients", True),
                  reduce_scatter=sec.bool("reduce_scatter", True),
                  reduce_bucket_size=sec.int("reduce_bucket_size", 500_000_000, lo=1, auto=True),
                  allgather_bucket_size=sec.int("allgather_bucket_size", 500_000_000, lo=1),
                  stage3_prefetch_bucket_size=sec.int("stage3_prefetch_bucket_size", 50_000_000,
                                                      lo=0, auto=True),
                  stage3_param_persistence_threshold=sec.int("stage3_param_persistence_threshold",
                                                             100_000, lo=0, auto=True))
        if cfg.offload_param.device is not OffloadDevice.NONE and stage != 3:
            raise ConfigError(f'{sec.where("offload_param")} needs "stage": 3 (stage is {stage}): '
                              f"parameters are only partitioned at stage 3")
        if cfg.offload_optimizer.device is not OffloadDevice.NONE and stage == 0:
            raise ConfigError(f'{sec.where("offload_optimizer")} needs "stage" >= 1 (stage is 0): '
                              f"only partitioned optimizer state is offloaded")
        sec.finish(cosmetic=ZERO_COSMETIC_KEYS)
        return cfg

    @property
    def has_auto(self) -> bool:
        """Whether some size is still "auto"."""
        return any(getattr(self, k) == AUTO for k in self._AUTO_KEYS)

    def resolve_auto(self, hidden_size: int) -> "ZeroOptimizationConfig":
        """A copy with every "auto" size computed from the model's hidden size."""
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r}: expected the model's width, a positive int")
        h = hidden_size
        sizes = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                 "stage3_param_persistence_threshold": 10 * h}
        return dataclasses.replace(self, **{k: v for k, v in sizes.items() if getattr(self, k) == AUTO})

    def to_dict(self) -> dict[str, Any]:
        """The section with DeepSpeed's key names, for ZeroOptimizer.from_config."""
        for key in self._AUTO_KEYS:
            if getattr(self, key) == AUTO:
                raise ConfigError(f'ds_config["zero_optimization"]["{key}"] is still "auto": pass '
                                  f"hidden_size= to parse_config (or call resolve_auto) first")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["offload_optimizer"] = self.offload_optimizer.to_dict()
        out["offload_param"] = self.offload_param.to_dict()
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorBoardConfig:
    """ds_config["tensorboard"]: event files go to output_path/job_name."""

    enabled: bool = False
    output_path: str = "runs"
    job_name: str = "pipezero"

    @classmethod
    def parse(cls, sec: Section) -> "TensorBoardConfig":
        """Read the section."""
        path, job = sec.raw("output_path", "runs"), sec.raw("job_name", "pipezero")
        for key, value in (("output_path", path), ("job_name", job)):
            if not isinstance(value, str):
                raise ConfigTypeError(f"{sec.where(key)} = {value!r}: expected a string")
        cfg = cls(enabled=sec.bool("enabled", False), output_path=path or "runs", job_name=job or "pipezero")
        sec.finish()
        return cfg


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineConfig:
    """ds_config["pipeline"]: what DeepSpeed keeps in code (PipelineModule's arguments)."""

    stages: int = 1
    schedule: str = "1f1b"                   # a name of pipe/registry.py's SCHEDULES
    chunks: int = 1                          # virtual stages per rank (the schedule's default)
    micro_batches: int | None = None         # = gradient_accumulation_steps when given
    activation_checkpoint_interval: int = 0  # 0: no activation checkpointing
    partition_method: str | tuple[float, ...] = "parameters"  # "parameters", "uniform", "type:<regex>", costs
    timeout: float = 300.0                   # seconds a rank waits for a peer before PipelineTimeout

    @classmethod
    def parse(cls, sec: Section) -> "PipelineConfig":
        """Read the section and check that chunks fit the schedule."""
        name = sec.raw("schedule", "1f1b")
        try:
            entry = schedule_entry(name)
        except ValueError:
            raise ConfigError(f'{sec.where("schedule")} = {name!r}: expected one of '
                              f'{", ".join(repr(n) for n in schedule_names())}') from None
        chunks = sec.int("chunks", None, lo=1) if sec.raw("chunks") is not None else None
        try:
            chunks = entry.check_chunks(chunks)
        except ValueError as e:
            raise ConfigError(f'{sec.where("chunks")} = {chunks}: {e}') from None
        micro = sec.int("micro_batches", None, lo=1) if sec.raw("micro_batches") is not None else None
        method = _check_partition(sec.raw("partition_method", "parameters"), sec.where("partition_method"))
        cfg = cls(stages=sec.int("stages", 1, lo=1), schedule=entry.name, chunks=chunks,
                  micro_batches=micro, partition_method=method,
                  activation_checkpoint_interval=sec.int("activation_checkpoint_interval", 0, lo=0),
                  timeout=sec.float("timeout", 300.0, lo=0.001, hi=86400.0))
        sec.finish()
        return cfg


def _check_partition(method: Any, where: str) -> str | tuple[float, ...]:
    """A method name, or a list of per-layer costs (kept as a tuple; its length is checked
    against the layers when the pipeline is built)."""
    if isinstance(method, list):
        if not method or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                                 and c >= 0 for c in method) or not any(method):
            raise ConfigError(f"{where} = {method!r}: a list of per-layer costs needs finite numbers >= 0, "
                              "not all 0 (e.g. measured with pipezero.pipe.measure_layer_costs)")
        return tuple(float(c) for c in method)
    if not isinstance(method, str):
        raise ConfigTypeError(f"{where} = {method!r}: expected a string or a list of per-layer costs")
    if method.lower().startswith("type:"):
        try:
            re.compile(method[5:])
        except re.error as err:
            raise ConfigError(f"{where} = {method!r}: the regex after 'type:' does not compile ({err})")
    elif method.lower() not in ("parameters", "uniform"):
        raise ConfigError(f'{where} = {method!r}: expected "parameters", "uniform", "type:<regex>" '
                          "or a list of per-layer costs")
    return method


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """The whole ds_config.json, validated; `raw` keeps the file as read."""

    batch: BatchConfig
    fp16: FP16Config
    bf16: BF16Config
    zero: ZeroOptimizationConfig
    pipeline: PipelineConfig
    tensorboard: TensorBoardConfig
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = 0.0   # max global grad norm; 0 disables clipping
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in: float16, bfloat16 or float32."""
        return torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16.enabled else torch.float32


def parse_config(source: str | os.PathLike | Mapping[str, Any], *, world_size: int | None = None,
                 tensor: int = 1, hidden_size: int | None = None) -> TrainConfig:
    """Validate a ds_config (path or dict) for a job of world_size processes (default: $WORLD_SIZE or 1).

    Pure: no process group is touched, so every rank raises the same error up front.
    """
    raw = _load(source)
    top = Section(raw, "ds_config")
    fp16, bf16 = FP16Config.parse(top.section("fp16")), _parse_bf16(top)
    if fp16.enabled and bf16.enabled:
        raise ConfigError('ds_config["fp16"]["enabled"] and ds_config["bf16"]["enabled"] are both true: '
                          "enable at most one")
    pipeline = PipelineConfig.parse(top.section("pipeline"))
    zero = ZeroOptimizationConfig.parse(top.section("zero_optimization"))
    if hidden_size is not None:
        zero = zero.resolve_auto(hidden_size)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    batch = resolve_batch(top, world_size=world, pipe=pipeline.stages, tensor=tensor,
                          micro_batches=pipeline.micro_batches)
    cfg = TrainConfig(
        batch=batch, fp16=fp16, bf16=bf16, zero=zero, pipeline=pipeline,
        tensorboard=TensorBoardConfig.parse(top.section("tensorboard")),
        optimizer=OptimizerConfig.parse(top.section("optimizer")) if top.has("optimizer") else None,
        scheduler=SchedulerConfig.parse(top.section("scheduler")) if top.has("scheduler") else None,
        gradient_clipping=top.float("gradient_clipping", 0.0, lo=0.0),
        steps_per_print=top.int("steps_per_print", 10, lo=1),
        wall_clock_breakdown=top.bool("wall_clock_breakdown", False), raw=raw)
    top.finish(cosmetic=COSMETIC_KEYS, known=_UNSUPPORTED)
    return cfg


def _parse_bf16(top: Section) -> BF16Config:
    if top.has("bf16") and top.has("bfloat16"):
        raise ConfigError('ds_config has both "bf16" and its old name "bfloat16": keep only "bf16"')
    return BF16Config.parse(top.section("bfloat16" if top.has("bfloat16") else "bf16"))


def _load(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"parse_config({source!r}): expected a path to ds_config.json or a dict")
    try:
        with open(source, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"ds_config file {os.fspath(source)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"ds_config file {os.fspath(source)!r} is not valid JSON: {err}") from None
