"""The optimizer and scheduler sections of ds_config.json, and the torch objects they describe.

Facts kept from DeepSpeed so its users' configs mean the same here: optimizer "Adam" has
`adam_w_mode` true by default, i.e. decoupled weight decay (AdamW) unless it is set false;
WarmupLR ramps from warmup_min_lr to warmup_max_lr over warmup_num_steps iterations ("log"
ramp: log(i+1)/log(n), "linear": i/n) and then stays there (warmup_max_lr left out: each param
group's own lr, as DeepSpeed's WarmupLR takes it; WarmupDecayLR's default stays 0.001, as
DeepSpeed's); WarmupDecayLR then decays linearly
from warmup_min_lr + delta to warmup_min_lr at total_num_steps (gamma (total - i)/(total - n));
WarmupCosineLR multiplies the optimizer's lr by a ratio that ramps from warmup_min_ratio to 1
and then follows a cosine down to cos_min_ratio at total_num_steps (Loshchilov & Hutter, SGDR,
arXiv:1608.03983). DeepSpeed's engine builds its scheduler at iteration -1 (warmup_min_lr, or
ratio 0 for the cosine) and steps it after each optimizer step, so optimizer step s (from 0)
runs at iteration s - 1: the first two steps both run at the start value. tests/test_config_
deepspeed.py checks every schedule against DeepSpeed's own classes.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler

from pipezero.config_fields import ConfigError, Ignored, Section, Unsupported

__all__ = ["OptimizerConfig", "OptimizerType", "SchedulerConfig", "SchedulerType", "WarmupType",
           "build_optimizer", "build_scheduler", "lr_at"]


class OptimizerType(enum.Enum):
    """Optimizers a config can name."""

    ADAM = "Adam"
    ADAMW = "AdamW"


class SchedulerType(enum.Enum):
    """LR schedules a config can name."""

    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"


class WarmupType(enum.Enum):
    """Shape of the warm-up ramp."""

    LOG = "log"
    LINEAR = "linear"


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """ds_config["optimizer"]: which Adam and its hyper-parameters."""

    type: OptimizerType = OptimizerType.ADAMW
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = True  # AdamW; DeepSpeed's Adam default (adam_w_mode=true)

    @classmethod
    def parse(cls, sec: Section) -> "OptimizerConfig":
        """Read {"type": ..., "params": {...}}; params DeepSpeed would pass to the optimizer, no others."""
        sec.check(("type", "params"), {"legacy_fusion": Ignored("torch's fused kernels are used", noop=False)})
        kind = OptimizerType(_supported_type(sec, "AdamW", [t.value for t in OptimizerType],
                                             "pass your own torch optimizer (initialize(optimizer=...))"))
        p = sec.section("params")
        p.check(("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"), _ADAM_RULES)
        betas = p.raw("betas", [0.9, 0.999])
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"{p.where('betas')} = {betas!r}: expected two numbers in [0, 1), "
                              f"e.g. [0.9, 0.999]")
        decoupled = kind is OptimizerType.ADAMW or p.bool("adam_w_mode", True)
        return cls(type=kind, lr=p.float("lr", 1e-3, lo=0.0), betas=(float(betas[0]), float(betas[1])),
                   eps=p.float("eps", 1e-8, lo=0.0), decoupled_weight_decay=decoupled,
                   weight_decay=p.float("weight_decay", _default_weight_decay(p, decoupled), lo=0.0))


def _default_weight_decay(p: Section, decoupled: bool) -> float:
    """0, FusedAdam's default; with torch_adam DeepSpeed builds torch.optim.AdamW from the params, whose
    default is 0.01 (torch.optim.Adam's is 0)."""
    return 0.01 if decoupled and p.bool("torch_adam", False) else 0.0


_ADAM_RULES = {
    **{k: Ignored("torch's fused kernel on CUDA, its default elsewhere", noop=lambda v: True)
       for k in ("fused", "foreach", "set_grad_none")},
    "amsgrad": Unsupported("AMSGrad's running maximum of the second moment", "set it false", noop=False),
    "bias_correction": Unsupported("Adam without bias correction", "set it true", noop=True),
    "max_grad_norm": Ignored('clipping is the top-level "gradient_clipping" (DeepSpeed ignores it too)',
                             noop=lambda v: v == 0),
}


def _supported_type(sec: Section, default: str, names: list[str], fix: str) -> str:
    """The type name (case-insensitive), or the "not supported" error for DeepSpeed's other types."""
    value = sec.raw("type", default)
    for name in names:
        if isinstance(value, str) and value.lower() == name.lower():
            return name
    raise ConfigError(f"{sec.where('type')} = {value!r}: DeepSpeed's {value} is not supported by pipezero: "
                      f"use one of {', '.join(repr(n) for n in names)}, or {fix}")


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerConfig:
    """ds_config["scheduler"]: a warm-up schedule, then constant, linear decay or cosine."""

    type: SchedulerType = SchedulerType.WARMUP_LR
    warmup_num_steps: int = 1000
    warmup_type: WarmupType = WarmupType.LOG
    warmup_min_lr: float = 0.0        # WarmupLR / WarmupDecayLR (absolute lr)
    warmup_max_lr: float | None = 1e-3  # WarmupLR / WarmupDecayLR (absolute lr); None: the optimizer's lr
    total_num_steps: int | None = None  # WarmupDecayLR / WarmupCosineLR
    warmup_min_ratio: float = 0.0     # WarmupCosineLR (ratio of the optimizer lr)
    cos_min_ratio: float = 1e-4       # WarmupCosineLR (ratio of the optimizer lr)

    @classmethod
    def parse(cls, sec: Section) -> "SchedulerConfig":
        """Read {"type": ..., "params": {...}}; each type accepts only its own params."""
        sec.check(("type", "params"))
        if "type" not in sec.data:
            raise ConfigError(f'{sec.where("type")} is required: one of '
                              f'{", ".join(t.value for t in SchedulerType)}')
        kind = SchedulerType(_supported_type(sec, None, [t.value for t in SchedulerType],
                                             "drive your own torch LR scheduler"))
        p = sec.section("params")
        cosine = kind is SchedulerType.WARMUP_COSINE_LR
        p.check(("warmup_num_steps", "warmup_type",
                 *(("warmup_min_ratio", "cos_min_ratio") if cosine else ("warmup_min_lr", "warmup_max_lr")),
                 *(() if kind is SchedulerType.WARMUP_LR else ("total_num_steps",))),
                {"last_batch_iteration": Ignored("resume restores the schedule position", noop=-1)})
        common = dict(warmup_num_steps=p.int("warmup_num_steps", 1000, lo=1),
                      warmup_type=WarmupType(p.choice("warmup_type", "log", [w.value for w in WarmupType])))
        if cosine:
            extra = dict(warmup_min_ratio=p.float("warmup_min_ratio", 0.0, lo=0.0, hi=1.0),
                         cos_min_ratio=p.float("cos_min_ratio", 1e-4, lo=0.0, hi=1.0))
        else:
            extra = dict(warmup_min_lr=p.float("warmup_min_lr", 0.0, lo=0.0),
                         warmup_max_lr=_warmup_max_lr(p, kind))
        if kind is not SchedulerType.WARMUP_LR:
            if "total_num_steps" not in p.data:
                raise ConfigError(f"{p.where('total_num_steps')} is required by {kind.value}: "
                                  f"set it to the number of optimizer steps of the run")
            total = p.int("total_num_steps", None, lo=1)
            if total < common["warmup_num_steps"]:
                raise ConfigError(f"{p.where('total_num_steps')} = {total} is less than "
                                  f"warmup_num_steps = {common['warmup_num_steps']}: raise it")
            extra["total_num_steps"] = total
        return cls(type=kind, **common, **extra)


def _warmup_max_lr(p: Section, kind: SchedulerType) -> float | None:
    """warmup_max_lr, or None for WarmupLR without one: DeepSpeed's WarmupLR then warms up to each param
    group's own lr (its WarmupDecayLR keeps the default 0.001)."""
    if "warmup_max_lr" not in p.data and kind is SchedulerType.WARMUP_LR:
        return None
    return p.float("warmup_max_lr", 1e-3, lo=0.0)


def _warmup_gamma(i: int, n: int, kind: WarmupType) -> float:
    """Fraction of the warm-up done at iteration i (1.0 once warm-up is over)."""
    if i >= n:
        return 1.0
    if kind is WarmupType.LOG:
        return math.log(i + 1) / math.log(n)
    return i / n


def lr_at(cfg: SchedulerConfig, step: int, base_lr: float) -> float:
    """The learning rate of optimizer step `step` (0-based) for an optimizer whose lr is base_lr,
    as DeepSpeed's engine sets it: at scheduler iteration step - 1 (see the module docstring).
    DeepSpeed's classes warm up over max(2, warmup_num_steps) iterations: one step is two."""
    i, n = step - 1, max(2, cfg.warmup_num_steps)
    cosine = cfg.type is SchedulerType.WARMUP_COSINE_LR
    if i < 0:  # the scheduler has not stepped yet
        return 0.0 if cosine else cfg.warmup_min_lr
    gamma = _warmup_gamma(i, n, cfg.warmup_type)
    if cosine:
        if i < n:
            return base_lr * (cfg.warmup_min_ratio + (1.0 - cfg.warmup_min_ratio) * gamma)
        progress = min(1.0, (i - n + 1) / max(1, cfg.total_num_steps - n))
        cosine_ratio = 0.5 * (1.0 + math.cos(math.pi * progress))
        return base_lr * max(0.0, cfg.cos_min_ratio + (1.0 - cfg.cos_min_ratio) * cosine_ratio)
    if cfg.type is SchedulerType.WARMUP_DECAY_LR and i >= n:
        gamma = max(0.0, (cfg.total_num_steps - i) / max(1, cfg.total_num_steps - n))
    top = base_lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    return cfg.warmup_min_lr + (top - cfg.warmup_min_lr) * gamma


def build_optimizer(cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter] | Iterable[dict]
                    ) -> torch.optim.Optimizer:
    """The plain torch Adam/AdamW a config describes: the innermost link of the optimizer chain.

    On CUDA torch's fused kernel (one pass over each tensor's parameter, gradient and moments),
    as DeepSpeed's "Adam" means FusedAdam on a GPU: on one H200 a 1.34B model's step takes
    ~25 ms in torch's default foreach kernels. Elsewhere torch's default.
    """
    params = list(params)
    cls = torch.optim.AdamW if cfg.decoupled_weight_decay else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
               fused=_all_on_cuda(params) or None)


def _all_on_cuda(params: list) -> bool:
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


class _FunctionLR(LRScheduler):
    """An LRScheduler whose lr is fn(step, initial lr); its state_dict is plain JSON numbers."""

    def __init__(self, optimizer: torch.optim.Optimizer, fn: Callable[[int, float], float]):
        self._fn = fn
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self._fn(self.last_epoch, base) for base in self.base_lrs]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch, self._step_count = int(state_dict["last_epoch"]), int(state_dict["_step_count"])
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """A torch LRScheduler for the config; attach it to the innermost torch optimizer.

    The wrappers of the optimizer chain share that optimizer's `param_groups`, so setting the
    lr there reaches every link. Call `scheduler.step()` after each optimizer step.
    """
    return _FunctionLR(optimizer, functools.partial(_lr_fn, cfg))


def _lr_fn(cfg: SchedulerConfig, step: int, base_lr: float) -> float:
    return lr_at(cfg, step, base_lr)
