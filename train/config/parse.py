"""ds_config.json -> the validated parts of a training job, before any process group exists.

DeepSpeed users' configs are accepted with DeepSpeed 0.19.8's meaning. Each section has one
reader, owned by the package that uses it: precision/ reads fp16/bf16 (`read_precision`), zero/
reads zero_optimization (`ZeroConfig.from_dict`; data_types.py adds the dtypes gradients are summed
and reduced in), and this module reads the rest (batch keys,
gradient_clipping, optimizer, scheduler, tensorboard, wandb (monitor.py), steps_per_print,
wall_clock_breakdown, sequence_parallel_size, expert_parallel (expert.py), pipezero's pipeline
section; activation_checkpointing with the pipeline's checkpointing keys in recompute.py) and sorts the top-level keys (keys.py). Hugging Face's
"auto" values are resolved first, from what the caller knows (`auto_values`, `hidden_size`,
auto.py), so every rank reaches the same verdict without communicating.

    cfg = parse_config("ds_config.json", world_size=4, hidden_size=768)
    scaler = LossScaler.from_config(inner, cfg.precision.scaler)
    zero = ZeroOptimizer(scaler, group=grid.data_sequence_group, config=cfg.zero)
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from pipezero.config_fields import ConfigError, ConfigTypeError, Ignored, Section
from pipezero.pipe.schedule.registry import schedule_entry, schedule_names
from pipezero.precision.config import Precision, read_precision
from pipezero.train.config.auto import fill_auto
from pipezero.pipe.compile import CompileConfig
from pipezero.train.config.batch import BatchConfig, data_degree, resolve_batch
from pipezero.train.config.compile import read_compile
from pipezero.train.config.data_types import read_grad_dtypes
from pipezero.train.config.expert import read_expert
from pipezero.train.config.recompute import read_recompute
from pipezero.train.config.keys import TOP_KEYS, TOP_RULES
from pipezero.train.config.monitor import WandbConfig
from pipezero.train.config.optim import OptimizerConfig, SchedulerConfig
from pipezero.pipe.memory.recompute import RecomputeConfig
from pipezero.zero.config import ZeroConfig

__all__ = ["BatchConfig", "ConfigError", "ConfigTypeError", "PipelineConfig", "TensorBoardConfig", "TrainConfig",
           "parse_config"]

# DeepSpeed's own pipeline keys (it takes the rest of a pipeline in code, from PipelineModule)
_DS_PIPELINE_RULES = {
    "partition": Ignored('pipezero partitions by "partition_method"'),
    "seed_layers": Ignored("layers are seeded per stage", noop=False),
    "pipe_partitioned": Ignored("activations are sent whole between stages", noop=True),
    "grad_partitioned": Ignored("gradients are sent whole between stages", noop=True),
    "use_reentrant": Ignored("checkpointing is non-reentrant", noop=False),
}


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorBoardConfig:
    """ds_config["tensorboard"]: event files go to output_path/job_name."""

    enabled: bool = False
    output_path: str = "runs"
    job_name: str = "pipezero"

    @classmethod
    def parse(cls, sec: Section) -> "TensorBoardConfig":
        """Read the section."""
        sec.check(("enabled", "output_path", "job_name"))
        path, job = sec.raw("output_path", "runs"), sec.raw("job_name", "pipezero")
        for key, value in (("output_path", path), ("job_name", job)):
            if not isinstance(value, str):
                raise ConfigTypeError(f"{sec.where(key)} = {value!r}: expected a string")
        return cls(enabled=sec.bool("enabled", False), output_path=path or "runs", job_name=job or "pipezero")


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineConfig:
    """ds_config["pipeline"]: what DeepSpeed keeps in code (PipelineModule's arguments)."""

    stages: int = 1
    schedule: str = "1f1b"                   # a name of pipe/schedule/registry.py's SCHEDULES
    chunks: int = 1                          # virtual stages per rank (the schedule's default)
    micro_batches: int | None = None         # = gradient_accumulation_steps when given
    activation_checkpoint_interval: int = 0  # layers per checkpointed run (TrainConfig.recompute has the rest:
                                             # "activation_checkpointing": "none" | "full" | "selective")
    partition_method: str | tuple[float, ...] = "parameters"  # "parameters", "uniform", "type:<regex>", costs
    reshard_after_forward: bool = False      # ZeRO-3: free a chunk whenever another chunk runs (pipe/gathering.py)
    timeout: float = 300.0                   # seconds a rank waits for a peer before PipelineTimeout

    @classmethod
    def parse(cls, sec: Section) -> "PipelineConfig":
        """Read the section and check that chunks fit the schedule."""
        sec.check(("stages", "schedule", "chunks", "micro_batches", "activation_checkpoint_interval",
                   "activation_checkpointing", "activation_checkpoint_layers", "offload_activation_layers",
                   "partition_method", "reshard_after_forward", "timeout"), _DS_PIPELINE_RULES)
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
        return cls(stages=sec.int("stages", 1, lo=1), schedule=entry.name, chunks=chunks,
                   micro_batches=micro, partition_method=method,
                   activation_checkpoint_interval=sec.int("activation_checkpoint_interval", 0, lo=0),
                   reshard_after_forward=sec.bool("reshard_after_forward", False),
                   timeout=sec.float("timeout", 300.0, lo=0.001, hi=86400.0))


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
    """The whole ds_config.json, validated and resolved; `raw` keeps the file as read."""

    batch: BatchConfig
    precision: Precision             # compute dtype and the LossScaler's settings (clipping included)
    zero: ZeroConfig
    pipeline: PipelineConfig
    tensorboard: TensorBoardConfig
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = 1.0   # max global grad norm (DeepSpeed's default 1.0); 0 disables clipping
    steps_per_print: int | None = None  # None: DeepSpeed's default, no periodic print
    wall_clock_breakdown: bool = False
    compile: CompileConfig | bool | None = None   # "compile" (compile.py); None: pipezero's default
    sequence: int = 1                # "sequence_parallel_size" (DeepSpeed's key): the grid's sequence axis
    expert: int = 1                  # "expert_parallel"'s "autoep_size" (expert.py): the grid's expert axis
    expert_overlap: bool = False     # "expert_parallel"'s "overlap", pipezero's key: all-to-alls behind compute
    expert_pairs: bool = False       # its "overlap_pairs", pipezero's: a DualPipeV pair's halves in turns
    recompute: RecomputeConfig = RecomputeConfig()  # activation checkpointing (recompute.py)
    wandb: WandbConfig = WandbConfig()            # "wandb" (monitor.py): W&B beside TensorBoard
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in: float16, bfloat16 or float32."""
        return self.precision.dtype


def parse_config(source: str | os.PathLike | Mapping[str, Any], *, world_size: int | None = None,
                 tensor: int = 1, hidden_size: int | None = None,
                 auto_values: Mapping[str, Any] | None = None) -> TrainConfig:
    """Validate a ds_config (path or dict) for a job of world_size processes (default: $WORLD_SIZE or 1).

    `hidden_size` resolves "auto" ZeRO sizes and `auto_values` any other "auto", by DeepSpeed key
    path ({"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4}), as the Hugging Face
    integration fills them from its TrainingArguments. Pure: no process group is touched, so every
    rank raises the same error up front.
    """
    raw = _load(source)
    Section(raw, ()).check(TOP_KEYS, TOP_RULES, strict=False)  # typos first, before any arithmetic
    filled = fill_auto(raw, auto_values or {})
    top = Section(filled, (), auto_default=False)
    pipeline = PipelineConfig.parse(top.section("pipeline"))
    recompute = read_recompute(filled.get("activation_checkpointing"), top.section("pipeline"), tensor)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    sequence = top.int("sequence_parallel_size", 1, lo=1)
    batch = resolve_batch(filled, world_size=world, pipe=pipeline.stages, tensor=tensor,
                          micro_batches=pipeline.micro_batches, sequence=sequence)
    expert, expert_overlap, expert_pairs = read_expert(filled.get("expert_parallel"),
                                         data_degree(world, pipeline.stages, tensor, sequence))
    clip = top.float("gradient_clipping", 1.0, lo=0.0)
    precision = read_precision(filled, clip_grad_norm=clip)
    accum, reduce = read_grad_dtypes(filled, precision.dtype)
    zero = replace(ZeroConfig.from_dict(filled.get("zero_optimization"), hidden_size),
                   grad_accum_dtype=accum, reduce_dtype=reduce)
    precision = _checks_finite(precision, zero)
    return TrainConfig(
        batch=batch, precision=precision, zero=zero,
        pipeline=pipeline, tensorboard=TensorBoardConfig.parse(top.section("tensorboard", auto_default=True)),
        optimizer=OptimizerConfig.parse(top.section("optimizer")) if "optimizer" in filled else None,
        scheduler=SchedulerConfig.parse(top.section("scheduler")) if "scheduler" in filled else None,
        gradient_clipping=clip, steps_per_print=top.int("steps_per_print", None, lo=1),
        wall_clock_breakdown=top.bool("wall_clock_breakdown", False), compile=read_compile(filled.get("compile")),
        sequence=sequence, expert=expert, expert_overlap=expert_overlap, expert_pairs=expert_pairs,
        recompute=recompute,
        wandb=WandbConfig.parse(top.section("wandb", auto_default=True)),
        raw=raw)


def _checks_finite(precision: Precision, zero: ZeroConfig) -> Precision:
    """Whether a step with inf/nan gradients is skipped, as DeepSpeed's optimizer for this stage decides.

    Its ZeRO optimizers (stages 1-3) take every step's gradient norm and skip on a non-finite one, in fp32
    too, clipping or not; bf16 there follows check_grad_overflow. Its stage-0 bf16 wrapper and its
    BF16_Optimizer (stage 1 with fp32 gradient sums) skip regardless of check_grad_overflow. fp32 at stage
    0 steps torch's optimizer as it is; fp16 always checks.
    """
    scaler = precision.scaler
    if precision.dtype == torch.float32 and zero.stage >= 1 and scaler.check_finite is None:
        return replace(precision, scaler=replace(scaler, check_finite=True))
    bf16_wrapper = zero.stage == 0 or (zero.stage == 1 and zero.grad_accum_dtype == torch.float32)
    if precision.dtype == torch.bfloat16 and bf16_wrapper and scaler.check_finite is False:
        return replace(precision, scaler=replace(scaler, check_finite=True))
    return precision


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
