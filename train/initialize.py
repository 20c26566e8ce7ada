"""A DeepSpeed-shaped entry point for migrating a loop: `initialize(model=..., config=...)`.

A DeepSpeed user's loop is `engine, optimizer, _, scheduler = deepspeed.initialize(...)`, then
`engine(x)`, `engine.backward(loss)`, `engine.step()` once per micro-batch. Here `initialize`
returns the same four things, where the engine is a thin view of the explicit parts
(`engine.parts`): calling it runs the model, `backward` scales the loss through the optimizer
chain, `step` steps the chain and the LR schedule and clears the gradients (train/loop.py's
optimizer_step, the rule the main job's and finetune's loop takes). With
gradient_accumulation_steps = k, as in DeepSpeed's engine, `backward` divides the loss by k and
`step` steps only every k-th call (the accumulation boundary; the calls between only count);
ZeRO stages 0-1 reduce the gradients once, at the boundary (no_sync before it), stages 2-3 on
every backward, as DeepSpeed's do. Nothing else lives in it; for pipelines use
`build(config, specs=...)` and the runner directly, or compose the parts by hand as
examples/train_gpt.py does.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipezero.train.build import Parts, build
from pipezero.train.config import TrainConfig
from pipezero.train.config.optim import OptimizerConfig, build_optimizer
from pipezero.train.log import get_logger, warn_once
from pipezero.train.loop import optimizer_step
from pipezero.train.checkpoint import has_checkpoint
from pipezero.train.checkpoint.from_deepspeed import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from pipezero.train.checkpoint.state import load_state, save_state

__all__ = ["Engine", "initialize"]


class Engine:
    """`engine(x)` = `parts.module(x)`; `backward(loss)` and `step()` once per micro-batch.

    `micro_steps` counts step() calls; `global_steps`, the accumulation boundaries passed, the
    optimizer steps taken (skipped ones included).
    """

    def __init__(self, parts: Parts):
        self.parts = parts
        self.module, self.optimizer, self.lr_scheduler = parts.module, parts.optimizer, parts.scheduler
        self.micro_steps = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (DeepSpeed's counter; a skipped inf/nan step counts)."""
        return self.micro_steps // self.gradient_accumulation_steps()

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (ds_config's gradient_accumulation_steps)."""
        return self.parts.config.batch.accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() steps the optimizer (the last micro-batch of an accumulation)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide the loss by the accumulation steps, scale it (fp16) and run backward; returns the
        divided loss. Before the boundary, stages 0-1 keep the gradients local (reduced once, then)."""
        steps = self.gradient_accumulation_steps()
        if steps > 1:
            loss = loss / steps
        local = not self.is_gradient_accumulation_boundary() and self.parts.config.zero.stage <= 1
        with self.optimizer.no_sync() if local else nullcontext():
            self.optimizer.backward(loss)
        return loss

    def step(self) -> bool:
        """At the accumulation boundary step the optimizer chain and the LR schedule, then clear the
        gradients; True when the optimizer stepped (False: not a boundary, or an inf/nan skip)."""
        stepped = False
        if self.is_gradient_accumulation_boundary():  # the loop's rule: a skipped step leaves the lr
            stepped = optimizer_step(self.optimizer, self.lr_scheduler)
        self.micro_steps += 1
        return stepped

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> Path:
        """DeepSpeed's save_checkpoint on pipezero's checkpoints (train/checkpoint/state.py: every rank calls it;
        it loads onto another grid). `tag` names the checkpoint: None (this optimizer step), a number or
        DeepSpeed's "global_step<N>"; the step counters are saved apart from it, as DeepSpeed's are.
        `client_state`: JSON values, returned by load_checkpoint. `save_latest=False` leaves `latest`
        where it was; `exclude_frozen_parameters` writes no parameter with requires_grad=False."""
        step = _step_of(tag, self.global_steps)
        _check_json(client_state)
        data = {_CLIENT: dict(client_state or {}), _COUNTERS: {"micro_steps": self.micro_steps,
                                                             "global_steps": self.global_steps}}
        return save_state(self.parts, save_dir, step, data, latest=save_latest,
                          frozen=not exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[str, dict[str, Any]] | tuple[None, None]:
        """DeepSpeed's load_checkpoint: (the checkpoint's path, its client_state); `tag` None follows
        `latest`, and without one nothing is loaded: (None, None), as DeepSpeed's first run of a resuming loop
        sees. Weights, optimizer state (loss scale and param-group settings included), LR schedule
        and global_steps resume (a fresh accumulation starts, as in DeepSpeed's, so global_steps holds under
        another world size's gradient_accumulation_steps); `load_optimizer_states=False` /
        `load_lr_scheduler_states=False` leave those as they are, `load_module_only=True` loads the weights
        alone (counters kept). A folder DeepSpeed's own save_checkpoint wrote (ZeRO 1-3, or ds_to_universal's
        output) loads the same way, onto this grid (train/checkpoint/from_deepspeed.py), its client_state as
        DeepSpeed's load_checkpoint returns it."""
        _check_load_args(load_module_strict, custom_load_fn)
        if is_deepspeed_checkpoint(load_dir, tag):
            return self._load_deepspeed(load_dir, tag, load_optimizer_states and not load_module_only,
                                        load_lr_scheduler_states and not load_module_only, load_module_only)
        if tag is None and not has_checkpoint(load_dir):
            get_logger().warning("load_checkpoint(%s): no 'latest' file there, nothing loaded; returning (None, None) "
                                 "as DeepSpeed does (pass tag= to load a checkpoint saved with save_latest=False)",
                                 load_dir)
            return None, None
        meta = load_state(self.parts, load_dir, None if tag is None else _step_of(tag, None),
                          optimizer=load_optimizer_states and not load_module_only,
                          scheduler=load_lr_scheduler_states and not load_module_only,
                          rng=not load_module_only)
        if not load_module_only:  # as DeepSpeed: global_steps alone, whatever the accumulation steps are now
            counters = meta["data"].get(_COUNTERS)
            self.micro_steps = (counters["global_steps"] if counters else meta["step"]) * \
                self.gradient_accumulation_steps()
        return meta["path"], dict(meta["data"].get(_CLIENT, {}))

    def _load_deepspeed(self, load_dir: str | os.PathLike, tag: Any, optimizer: bool, scheduler: bool,
                        module_only: bool) -> tuple[str, dict[str, Any]]:
        """A checkpoint DeepSpeed's own engine wrote (train/checkpoint/from_deepspeed.py), onto this grid."""
        meta = load_deepspeed_checkpoint(self.parts, load_dir, tag, optimizer=optimizer, scheduler=scheduler)
        if not module_only:
            self.micro_steps = meta["global_steps"] * self.gradient_accumulation_steps()
        return meta["path"], meta["client_state"]

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: cast inputs to it (`x.to(engine.dtype)`)."""
        return self.parts.dtype

    @property
    def local_rank(self) -> torch.device:
        """Where inputs go (`x.to(engine.local_rank)`, as DeepSpeed loops write it): this process's device."""
        return self.parts.device


_CLIENT = "client_state"  # where save_checkpoint keeps DeepSpeed's client_state in the checkpoint's meta
_COUNTERS = "engine"      # and the engine's step counters (DeepSpeed's global_steps), apart from the tag


def _check_load_args(strict: bool, custom_load_fn: Any) -> None:
    """The load_checkpoint arguments pipezero does not take, refused with what to do instead."""
    if strict is not True:
        raise ValueError("load_checkpoint(load_module_strict=False): pipezero loads every parameter by name "
                         "and refuses a checkpoint of another model; load the weights you want yourself "
                         "(safetensors.torch.load_file of export_model's file, then "
                         "model.load_state_dict(..., strict=False))")
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint(custom_load_fn=...): not supported; load the model's weights from "
                         "export_model's safetensors file with your own function instead")


def _step_of(tag: Any, default: int | None) -> int:
    """A checkpoint tag as pipezero's step number: None (the default), an int, "global_step<N>", or the
    folder name that `latest` holds ("step_<N>"), which DeepSpeed scripts read and pass back as the tag."""
    if tag is None and default is not None:
        return default
    if isinstance(tag, int) and not isinstance(tag, bool) and tag >= 0:
        return tag
    for prefix in ("global_step", "step_"):
        if isinstance(tag, str) and tag.removeprefix(prefix).isdigit():
            return int(tag.removeprefix(prefix))
    raise ValueError(f"checkpoint tag={tag!r}: pipezero names checkpoints by optimizer step; pass None, a step "
                     f"number, DeepSpeed's default form 'global_step<N>' or what `latest` holds ('step_<N>')")


def _check_json(client_state: Mapping[str, Any] | None) -> None:
    """Refuse (on every rank, before any collective) a client_state the checkpoint's JSON meta cannot hold,
    or would give back changed: JSON turns a dict key 1 into "1" (load_checkpoint's client_state[1] fails)."""
    try:
        json.dumps(dict(client_state or {}))
    except (TypeError, ValueError) as err:
        raise TypeError(f"save_checkpoint(client_state=...): {err}; pipezero keeps client_state as JSON "
                        "(numbers, strings, lists, dicts): save tensors in the model or optimizer") from None
    where = _non_string_keys(dict(client_state or {}), "client_state")
    if where:
        raise TypeError(f"save_checkpoint(client_state=...): {where[0]} is a dict key that is not a string; "
                        "pipezero keeps client_state as JSON, which would load it back as a string "
                        f"({len(where)} such key(s)); use string keys")


def _non_string_keys(value: Any, path: str) -> list[str]:
    """The paths of the dict keys in `value` that are not strings (e.g. "client_state['best'][1]")."""
    if isinstance(value, Mapping):
        return [found for k, v in value.items() for found in
                ([f"{path}[{k!r}]"] if not isinstance(k, str) else []) + _non_string_keys(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [found for i, v in enumerate(value) for found in _non_string_keys(v, f"{path}[{i}]")]
    return []


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: str | os.PathLike | Mapping[str, Any] | TrainConfig | None = None,
               mesh_param: Any = None, config_params: Any = None, *, hidden_size: int | None = None,
               auto_values: Mapping[str, Any] | None = None, float8: Any = None) -> tuple[Engine, Any, Any, Any]:
    """(engine, optimizer chain, data loader, lr scheduler), like deepspeed.initialize, with its arguments.

    The optimizer is yours if given, else the config's "optimizer" section over
    `model_parameters` (default: every trainable parameter). `lr_scheduler`: your scheduler, or a
    callable that makes one from the optimizer (DeepSpeed calls it with the torch optimizer; so does
    this), used instead of the config's. `training_data` (with `collate_fn`): a DataLoader over this
    data rank's share (a DistributedSampler over the data group), micro-batch sized, as DeepSpeed's;
    else the third item is None. `args`: DeepSpeed's argparse namespace, whose `deepspeed_config`
    is the config when `config` is not given. `config_params` is DeepSpeed's older name for
    `config`; `distributed_port` and `dist_init_required` are accepted (torchrun's environment
    starts the process group). `hidden_size` resolves "auto" ZeRO sizes (read off the model by
    default, `build.model_width`); `auto_values` any other Hugging Face "auto" (see parse_config).
    `float8` (True or a pipe.float8.Float8Config; pipezero's own, no ds_config key) trains the
    model's repeated blocks' Linears in fp8 (build's).
    A model wrapped in DistributedDataParallel is unwrapped: the optimizer chain reduces gradients
    itself (DDP's would reduce them a second time).
    """
    config = _config_of(args, config if config is not None else config_params)
    _refuse_unsupported(model, mpu, mesh_param)
    if isinstance(model, DistributedDataParallel):
        warn_once("initialize(model=DistributedDataParallel(...)): training its .module; pipezero's optimizer "
                  "chain averages gradients over the data group itself", logger=get_logger())
        model = model.module
    if optimizer is None and model_parameters is not None:
        from pipezero.train.build import _config, model_width

        cfg = _config(config, hidden_size if hidden_size is not None else model_width(model),
                      auto_values=auto_values)
        optimizer = build_optimizer(cfg.optimizer or OptimizerConfig(), model_parameters)
        config = cfg
    parts = build(config, model=model, hidden_size=hidden_size, optimizer=optimizer, auto_values=auto_values,
                  float8=float8)
    if lr_scheduler is not None:
        parts.scheduler = _client_scheduler(lr_scheduler, parts)
    engine = Engine(parts)
    loader = _data_loader(training_data, collate_fn, parts) if training_data is not None else None
    return engine, parts.optimizer, loader, parts.scheduler


def _config_of(args: Any, config: Any) -> Any:
    """The config, or DeepSpeed's `args.deepspeed_config` (its older name `deepscale_config`)."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ValueError(f"initialize(args=..., config=...): both give a ds_config (args.deepspeed_config="
                         f"{from_args!r}); pass only one, as DeepSpeed requires")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize(config=None): pass a ds_config path or dict (or args with deepspeed_config)")
    return config


def _refuse_unsupported(model: Any, mpu: Any, mesh_param: Any) -> None:
    if model is None:
        raise ValueError("initialize(model=None): pass the nn.Module to train")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): pipezero has no Megatron model-parallel unit; for tensor "
                         "parallelism use pipezero.train.build(config, specs=..., tensor=N, tensor_plan=...)")
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...): not supported; the grid comes from the config's "
                         "pipeline stages and the world size (pipezero.topology.Grid)")


def _client_scheduler(lr_scheduler: Any, parts: Parts) -> Any:
    """The user's LR scheduler (DeepSpeed prefers it to the config's), or the one its callable makes."""
    if parts.scheduler is not None:
        warn_once('initialize(lr_scheduler=...): using it; the config\'s "scheduler" section is ignored, as '
                  "DeepSpeed ignores it", logger=get_logger())
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(parts.inner)
    raise TypeError(f"initialize(lr_scheduler={type(lr_scheduler).__name__}): expected a torch LR scheduler or "
                    "a callable that makes one from the optimizer")


def _data_loader(dataset: Any, collate_fn: Any, parts: Parts) -> torch.utils.data.DataLoader:
    """DeepSpeed's training_data: micro-batches of this data rank's share of the dataset (by data x expert
    rank: with an expert axis, each of those ranks reads its own rows)."""
    from torch.utils.data import DataLoader, DistributedSampler

    grid = parts.grid
    sampler = DistributedSampler(dataset, num_replicas=grid.data_expert_size, rank=grid.data_expert_rank)
    return DataLoader(dataset, batch_size=parts.config.batch.micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn)
