"""One call: a ds_config plus layer specs (or a plain model) -> the explicit parts of a training job.

`build(config, specs=..., loss_fn=...)` composes what a user would otherwise write by hand
(README, "The parts"): a Grid, the PipelineModule, the optimizer chain
`ZeroOptimizer(stage, LossScaler(..., Adam))`, the LR scheduler, the schedule and the
PipelineRunner, and returns them in a small dataclass. With an expert axis (ds_config
"expert_parallel") the MoE layers' experts are split over it and reduce over their own group
(pipe/expert/: expert_param_groups), beside a tensor split too (each tensor rank routes its share of the
tokens: pipe/tensor_tokens.py; at any expert degree the MoE blocks' parameters then reduce over a group
holding the tensor ranks, once a step). Nothing is hidden: the loop talks to
the parts directly. With `model=` (a plain nn.Module, e.g. the seed's MLP) there is no
pipeline: the parts are the grid, the model and the optimizer chain (ZeRO stages 0-3).

Every check that can fail on user input runs before the first collective, on every rank.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from pipezero.comm import all_reduce
from pipezero.pipe.compile import CompileConfig, compile_layers, model_blocks
from pipezero.pipe.expert import expert_param_groups, shard_experts
from pipezero.pipe.float8 import Float8Config, to_float8
from pipezero.pipe.memory.offload import HostOffload
from pipezero.pipe.memory.recompute import RecomputeConfig, checkpoint_blocks, compiles_checkpointed
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.schedule.registry import make_schedule
from pipezero.pipe.runner import PipelineRunner
from pipezero.precision import LossScaler, cast_parameters
from pipezero.topology import Grid, init_distributed, process_device
from pipezero.train.config import TrainConfig, parse_config
from pipezero.train.config.optim import OptimizerConfig, build_optimizer, build_scheduler
from pipezero.train.log import get_logger, warn_once
from pipezero.zero import ZeroOptimizer

__all__ = ["Parts", "build", "init_process_group", "model_width", "resolve_precision"]


@dataclass(eq=False)
class Parts:
    """The parts of one training job; `optimizer` is the outermost link of the chain."""

    config: TrainConfig
    grid: Grid
    module: nn.Module                 # a PipelineModule (this rank's layers) or the user's model
    optimizer: ZeroOptimizer          # ZeroOptimizer(stage, LossScaler(..., Adam/AdamW))
    scaler: LossScaler                # the middle link: loss scale, skips, clipping, grad norm
    inner: torch.optim.Optimizer      # the torch optimizer (the scheduler drives its lr)
    scheduler: LRScheduler | None
    schedule: Any = None              # pipeline only
    runner: PipelineRunner | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


def resolve_precision(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The compute dtype to use: fp16 on a device that cannot multiply in fp16 falls back to bf16."""
    if dtype != torch.float16 or device.type != "cpu":
        return dtype
    try:
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
        return dtype
    except RuntimeError:
        warn_once("fp16 is not supported by this CPU's torch build: computing in bf16 instead "
                  '(set "bf16": {"enabled": true} to silence this)', logger=get_logger())
        return torch.bfloat16


def model_width(model: nn.Module) -> int | None:
    """The hidden size that "auto" ZeRO sizes follow, read off a model as DeepSpeed users expect.

    A Hugging Face-style `model.config.hidden_size` (or the largest of `hidden_sizes`) first;
    else the input width most of the model's Linear layers share (the residual width of a
    transformer, whose MLP and head are wider), the larger on a tie; None without Linears.
    """
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None) or max(getattr(config, "hidden_sizes", None) or [0])
    if isinstance(width, int) and width > 0:
        return width
    counts = Counter(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    return max(counts, key=lambda w: (counts[w], w)) if counts else None


init_process_group = init_distributed  # the restart-safe start lives in topology/


def build(config: TrainConfig | str | os.PathLike | Mapping[str, Any], *,
          specs: Sequence[Any] | None = None, model: nn.Module | None = None,
          loss_fn: Callable | None = None, hidden_size: int | None = None, seed: int = 0,
          device: torch.device | str | None = None, optimizer: torch.optim.Optimizer | None = None,
          tensor: int = 1, tensor_plan: Any = None, auto_values: Mapping[str, Any] | None = None,
          compile: Any = None, float8: Any = None) -> Parts:
    """Config + layer specs (a pipeline) or a model (no pipeline) -> Parts.

    `config` is a ds_config path, dict or an already parsed TrainConfig (for the world size
    the process group, or $WORLD_SIZE, has). `hidden_size` resolves "auto" ZeRO bucket sizes and
    `auto_values` any other "auto" (parse_config's argument, e.g. {"gradient_clipping": 1.0}).
    `optimizer` (with model= only): your own torch optimizer over the model's parameters, used
    as the innermost link instead of the config's "optimizer" section. `tensor` > 1 (with specs=)
    shards each layer by `tensor_plan` (PipelineModule's) over the grid's tensor axis.
    `compile` (True, False or a pipe.compile.CompileConfig; default: ds_config "compile", else
    PipelineModule's default: on CUDA without tensor parallelism) compiles each repeated pipeline layer
    and the loss, or with model= the model's repeated blocks (pipe/compile.py, model_blocks).
    `float8` (True or a pipe.float8.Float8Config; default off) trains those blocks' Linears in fp8
    through torchao (pipe/float8.py). Activation checkpointing (ds_config's activation_checkpointing and
    pipeline keys, TrainConfig.recompute) applies to the pipeline's layers, or with model= to those blocks.
    """
    if hidden_size is None and isinstance(model, nn.Module):
        hidden_size = model_width(model)
    cfg = _config(config, hidden_size, tensor, auto_values)
    _check_build_args(cfg, specs, model, loss_fn, optimizer, tensor)
    dev = torch.device(device) if device is not None else process_device()  # the process group's device
    dtype = resolve_precision(cfg.compute_dtype, dev)
    fp8 = Float8Config.of(float8)  # checked where it converts (PipelineModule, to_float8), on every rank
    init_distributed()
    grid = Grid(pipe=cfg.pipeline.stages, data=None, tensor=tensor, sequence=cfg.sequence, expert=cfg.expert)
    schedule = None
    if specs is not None:
        schedule = make_schedule(cfg.pipeline.schedule, cfg.batch.accumulation_steps, cfg.pipeline.chunks)
        module = PipelineModule(list(specs), grid, loss_fn=loss_fn, partition_method=cfg.pipeline.partition_method,
                                num_chunks=cfg.pipeline.chunks, placement=schedule.placement,
                                recompute=cfg.recompute, seed=seed, device=dev, tensor_plan=tensor_plan,
                                compile=cfg.compile if compile is None else compile, float8=fp8)
    else:
        module = model.to(dev)
        if fp8 is not None:  # before compiling: the compiled blocks trace the fp8 Linears
            to_float8(model_blocks(module), fp8, dev)
        if compiles_checkpointed(cfg.recompute):
            _compile_blocks(module, CompileConfig.of(cfg.compile if compile is None else compile, dev))
        _checkpoint_blocks(module, cfg.recompute)
    if cfg.recompute.enabled:
        get_logger().info("activation checkpointing: %s", cfg.recompute.describe())
    cast_parameters(module, dtype)  # buffers (HF rotary frequencies) keep their fp32, as from_pretrained's
    params = _param_groups(module, grid, cfg.expert_overlap)
    inner = optimizer if optimizer is not None else build_optimizer(cfg.optimizer or OptimizerConfig(), params)
    scaler = _scaler(cfg, inner, dtype)
    zero = ZeroOptimizer(scaler, group=grid.data_sequence_group, module=module if cfg.zero.stage == 3 else None,
                         config=cfg.zero)
    scheduler = build_scheduler(cfg.scheduler, inner) if cfg.scheduler is not None else None
    runner = PipelineRunner(module, schedule, optimizer=zero, timeout_s=cfg.pipeline.timeout,
                            reshard_after_forward=cfg.pipeline.reshard_after_forward,
                            overlap_pairs=cfg.expert_pairs) if specs is not None else None
    return Parts(config=cfg, grid=grid, module=module, optimizer=zero, scaler=scaler, inner=inner,
                 scheduler=scheduler, schedule=schedule, runner=runner, dtype=dtype, device=dev)


def _param_groups(module: nn.Module, grid: Grid, overlap: bool) -> list[Any]:
    """The optimizer's parameters: with experts split or beside a tensor split (a MoE block on each tensor
    rank's share of the tokens, summed over the tensor ranks once a step) expert_param_groups', else the
    trainable parameters, one group."""
    if grid.expert_size > 1:
        return _shard_experts(module, grid, overlap)
    if grid.tensor_size > 1:
        return expert_param_groups(module, grid)
    return [p for p in module.parameters() if p.requires_grad]


def _shard_experts(module: nn.Module, grid: Grid, overlap: bool) -> list[dict[str, Any]]:
    """Split every MoE layer's experts over the grid's expert axis (`overlap`: ds_config's "overlap", pipezero's
    key); the param groups that reduce them over their own data group (pipe/expert/groups.py). Refused on
    every rank when no stage has experts."""
    split = torch.tensor([shard_experts(module, grid.expert_group, overlap)], dtype=torch.int64,
                         device=process_device())
    all_reduce(split)  # a stage may hold none (a dense first layer): the whole model must hold some
    if int(split.item()) == 0:
        raise ValueError(f'ds_config "expert_parallel" autoep_size = {grid.expert_size}, but the model has no MoE '
                         "layer whose experts can split (stacked experts, as transformers 5's MoE families hold "
                         'them): set "expert_parallel" off, or train a MoE model (hf_layer_specs of one)')
    return expert_param_groups(module, grid)


def _compile_blocks(model: nn.Module, config: CompileConfig | None) -> None:
    """A whole model's repeated blocks compiled for training, as PipelineModule compiles a stage's."""
    if config is not None:
        blocks = model_blocks(model)
        compile_layers(blocks, config, {type(b) for b in blocks})


def _checkpoint_blocks(model: nn.Module, config: RecomputeConfig) -> None:
    """A whole model's repeated blocks checkpointed as ds_config says, as PipelineModule checkpoints its layers."""
    if not config.enabled:
        return
    blocks = model_blocks(model)
    if not blocks:
        raise ValueError(f"activation checkpointing ({config.mode}) checkpoints a model's repeated blocks (the "
                         f"members of an nn.ModuleList of one class), and {type(model).__name__} has none: "
                         "turn it off, or pass specs= to checkpoint pipeline layers")
    checkpoint_blocks(blocks, config, HostOffload() if config.offload else None)


def _config(config: Any, hidden_size: int | None, tensor: int = 1,
            auto_values: Mapping[str, Any] | None = None) -> TrainConfig:
    if isinstance(config, TrainConfig):
        return config
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    return parse_config(config, world_size=world, hidden_size=hidden_size, tensor=tensor, auto_values=auto_values)


def _check_build_args(cfg: TrainConfig, specs: Any, model: Any, loss_fn: Any, optimizer: Any,
                      tensor: int) -> None:
    """Every user error, before any process group work."""
    if optimizer is not None and (specs is not None or not isinstance(optimizer, torch.optim.Optimizer)):
        raise TypeError("build(optimizer=...) takes a torch.optim.Optimizer over the parameters of model=; with "
                        'specs= the optimizer comes from the config\'s "optimizer" section')
    if (specs is None) == (model is None):
        raise ValueError("build(config, specs=..., model=...): pass exactly one of specs= (a list of "
                         "LayerSpec for a pipeline) or model= (an nn.Module, no pipeline)")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"build(model={type(model).__name__}): expected an nn.Module")
    if specs is not None:
        if loss_fn is None:
            raise ValueError("build(specs=...) needs loss_fn=: the last pipeline stage computes the loss")
        if len(specs) < cfg.pipeline.stages * cfg.pipeline.chunks:
            raise ValueError(f"{len(specs)} layers cannot fill {cfg.pipeline.stages} pipeline stages x "
                             f"{cfg.pipeline.chunks} chunks: use fewer stages/chunks or more layers")
    elif cfg.expert > 1:
        raise ValueError(f'ds_config "expert_parallel" autoep_size = {cfg.expert} splits the experts of pipeline '
                         "layers (pipe/expert/): pass specs= (hf_layer_specs of a MoE model), or turn it off with "
                         "model=")
    elif cfg.pipeline.stages > 1:
        raise ValueError(f'ds_config["pipeline"]["stages"] = {cfg.pipeline.stages} needs specs= (a list of '
                         "LayerSpec) to cut the model into stages; pass specs= or set stages to 1")
    elif cfg.sequence > 1:
        raise ValueError(f'ds_config "sequence_parallel_size" = {cfg.sequence} splits every sequence over pipeline '
                         "layers that exchange slices for heads (pipe/sequence/): pass specs= (hf_layer_specs, "
                         'gpt_specs), or set "sequence_parallel_size" to 1 with model=')
    elif tensor > 1:
        raise ValueError(f"build(tensor={tensor}) shards pipeline layers by tensor_plan: pass specs= (and "
                         "tensor_plan=, e.g. gpt_tensor_plan()), or tensor=1 with model=")
    if cfg.zero.offload_param and not torch.cuda.is_available():
        warn_once("ZeRO-3 parameter offload on a CPU-only machine moves nothing: parameters already live there",
                  logger=get_logger())


def _scaler(cfg: TrainConfig, inner: torch.optim.Optimizer, dtype: torch.dtype) -> LossScaler:
    """The config's loss scaler; fp16 that fell back to bf16 (resolve_precision) takes bf16's defaults."""
    if dtype == cfg.compute_dtype:
        return LossScaler.from_config(inner, cfg.precision.scaler)
    return LossScaler.from_config(inner, {}, dtype=torch.bfloat16, clip_grad_norm=cfg.gradient_clipping)
