"""ScalerConfig: the validated settings of a LossScaler, and the one reader of DeepSpeed's fp16/bf16 sections.

One small typed dataclass owns every knob (so LossScaler's constructor and from_config share one
validation). `read_precision` is the only reader of ds_config's `fp16` and `bf16` (old name
`bfloat16`) sections, with DeepSpeed 0.19.8's defaults and coercions; `parse_config` (train/)
and `LossScaler.from_config` both call it, so they cannot disagree. A DeepSpeed user's config
gives the same dtype, scale trajectory and overflow skipping here as there: bf16 skips steps
with inf/nan gradients by default (`check_grad_overflow`, true in DeepSpeed's ZeRO bf16 path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from pipezero.checks import is_int, is_number
from pipezero.config_fields import ConfigError, Ignored, Section, Unsupported

__all__ = ["BF16_RULES", "FP16_RULES", "Precision", "ScalerConfig", "read_precision"]

_FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale")
FP16_RULES = {
    "auto_cast": Ignored("inputs are not cast for you; cast them with x.to(engine.dtype)", noop=False),
    "fp16_master_weights_and_grads": Unsupported(
        "fp16 master weights and gradients, with DeepSpeedCPUAdam", "leave it false (masters are fp32)", noop=False),
}
_BF16_KEYS = ("enabled", "check_grad_overflow")
BF16_RULES = {
    "immediate_grad_update": Ignored("gradients are added into their buckets as they arrive either way (in fp32 "
                                     'with "data_types": {"grad_accum_dtype": "fp32"})', noop=False),
    "bf16_master_weights_and_grads": Unsupported(
        "bf16 master weights and gradients in ZeRO", "leave it false (masters are fp32)", noop=False),
    "bf16_optimizer_states": Unsupported(
        "bf16 optimizer state in ZeRO", "leave it false (optimizer state is fp32)", noop=False),
}


@dataclass(kw_only=True, slots=True)
class ScalerConfig:
    """How a LossScaler scales, skips and clips."""

    init_scale: float = 2.0 ** 16
    """The loss scale of the first step (the fixed scale when `dynamic` is False)."""
    dynamic: bool = True
    """Halve the scale on overflow (after `hysteresis`), double it after `scale_window` clean steps."""
    scale_window: int = 1000
    """Clean steps since the last overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (DeepSpeed's delayed shift); refilled on growth."""
    min_scale: float = 1.0
    """The floor of the dynamic scale; at the floor an overflow still skips the step."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every clean step, so only consecutive overflows count down."""
    max_consecutive_skips: int = 0
    """Raise after this many consecutive skipped steps at the floor scale; 0 never raises."""
    clip_grad_norm: float = 0.0
    """Clip gradients to this global L2 norm (DeepSpeed's `gradient_clipping`); 0 disables."""
    check_finite: bool | None = None
    """Skip steps whose gradients hold inf/nan. None: yes when scaling (fp16), no for the fp32 no-op
    path (as DeepSpeed at ZeRO stage 0; parse_config sets it for fp32 under ZeRO 1-3, whose DeepSpeed
    optimizers skip); bf16 sets it from `check_grad_overflow`. A clipped step always skips on a
    non-finite norm."""

    def __post_init__(self) -> None:
        _check_number("init_scale", self.init_scale, "a positive finite number, e.g. 2.0**16")
        _check_number("min_scale", self.min_scale, "a positive finite number, e.g. 1.0")
        for name in ("scale_window", "hysteresis"):
            value = getattr(self, name)
            if not is_int(value, minimum=1):
                raise ValueError(f"ScalerConfig({name}={value!r}): must be an integer >= 1")
        skips = self.max_consecutive_skips
        if not is_int(skips, minimum=0):
            raise ValueError(f"ScalerConfig(max_consecutive_skips={skips!r}): must be an integer >= 0 "
                             f"(0 = keep training at the floor scale)")
        clip = self.clip_grad_norm
        if not is_number(clip, minimum=0):
            raise ValueError(f"ScalerConfig(clip_grad_norm={clip!r}): must be a finite number >= 0 "
                             f"(0 disables clipping)")
        if self.dynamic and self.min_scale > self.init_scale:
            raise ValueError(f"ScalerConfig(init_scale={self.init_scale}, min_scale={self.min_scale}): "
                             f"the initial scale is below the floor; lower min_scale")
        for name in ("dynamic", "consecutive_hysteresis"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ScalerConfig({name}={getattr(self, name)!r}): must be True or False")
        if self.check_finite is not None and not isinstance(self.check_finite, bool):
            raise TypeError(f"ScalerConfig(check_finite={self.check_finite!r}): must be True, False or None")
        if self.dynamic and self.check_finite is False:
            raise ValueError("ScalerConfig(dynamic=True, check_finite=False): a dynamic scale moves on "
                             "overflows it must see; leave check_finite=None")

    @property
    def is_noop(self) -> bool:
        """True when there is nothing to scale: static scale 1 (bf16/fp32)."""
        return not self.dynamic and self.init_scale == 1.0

    @property
    def checks_finite(self) -> bool:
        """Whether a step looks for inf/nan gradients (and skips on them)."""
        return (not self.is_noop) if self.check_finite is None else self.check_finite

    @classmethod
    def from_fp16(cls, section: Mapping[str, Any], **extra: Any) -> "ScalerConfig":
        """Read DeepSpeed's `fp16` section (enabled unless it says false): `loss_scale` 0 = dynamic."""
        sec = Section(section, ("fp16",))
        if not sec.bool("enabled", True):
            return cls(init_scale=1.0, dynamic=False, **extra)
        return _read_fp16(sec, extra)

    @classmethod
    def from_bf16(cls, section: Mapping[str, Any], **extra: Any) -> "ScalerConfig":
        """Read DeepSpeed's `bf16` section: no scaling; inf/nan steps skipped unless check_grad_overflow is false."""
        return _read_bf16(Section(section, ("bf16",)), extra)


@dataclass(frozen=True, slots=True)
class Precision:
    """What ds_config's fp16/bf16 sections ask for: the compute dtype and the loss scaler's settings."""

    dtype: torch.dtype
    scaler: ScalerConfig


def read_precision(ds_config: Mapping[str, Any], *, clip_grad_norm: float = 0.0) -> Precision:
    """The fp16 and bf16 (or bfloat16) sections of a whole ds_config -> Precision (fp32 when neither is on).

    `clip_grad_norm` is DeepSpeed's top-level `gradient_clipping` (read by train/).
    """
    if "bf16" in ds_config and "bfloat16" in ds_config:
        raise ConfigError('ds_config has both "bf16" and its old name "bfloat16": keep only "bf16"')
    fp16 = Section(ds_config.get("fp16"), ("fp16",))
    bf16 = Section(ds_config.get("bf16", ds_config.get("bfloat16")),
                   ("bfloat16",) if "bfloat16" in ds_config else ("bf16",))
    fp16.check(_FP16_KEYS, FP16_RULES)
    bf16.check(_BF16_KEYS, BF16_RULES)
    fp16_on, bf16_on = fp16.bool("enabled", False), bf16.bool("enabled", False)
    if fp16_on and bf16_on:
        raise ConfigError(f'{fp16.where("enabled")} and {bf16.where("enabled")} are both true: enable at most one')
    extra = {"clip_grad_norm": clip_grad_norm}
    if fp16_on:
        return Precision(torch.float16, _read_fp16(fp16, extra))
    if bf16_on:
        return Precision(torch.bfloat16, _read_bf16(bf16, extra))
    return Precision(torch.float32, ScalerConfig(init_scale=1.0, dynamic=False, **extra))


def _read_fp16(sec: Section, extra: dict) -> ScalerConfig:
    """DeepSpeed's fp16 keys and defaults (min_loss_scale may be fractional here; DeepSpeed wants an int)."""
    sec.check(_FP16_KEYS, FP16_RULES)
    loss_scale = sec.float("loss_scale", 0.0, lo=0.0)
    power = sec.int("initial_scale_power", 16, lo=0, hi=127)
    dynamic = loss_scale == 0
    window = sec.int("loss_scale_window", 1000, lo=1 if dynamic else None)
    min_scale = sec.float("min_loss_scale", 1.0, lo=0.0)
    if dynamic and min_scale <= 0:
        raise ConfigError(f"{sec.where('min_loss_scale')} = {min_scale}: expected a value > 0 with a dynamic "
                          f"loss scale (loss_scale 0)")
    return ScalerConfig(init_scale=2.0 ** power if dynamic else loss_scale, dynamic=dynamic,
                        scale_window=max(window, 1), hysteresis=sec.int("hysteresis", 2, lo=1),
                        min_scale=min_scale if dynamic else 1.0,
                        consecutive_hysteresis=sec.bool("consecutive_hysteresis", False), **extra)


def _read_bf16(sec: Section, extra: dict) -> ScalerConfig:
    sec.check(_BF16_KEYS, BF16_RULES)
    extra = {"check_finite": sec.bool("check_grad_overflow", True), **extra}
    return ScalerConfig(init_scale=1.0, dynamic=False, **extra)


def _check_number(name: str, value: Any, expected: str) -> None:
    if not is_number(value, above=0):
        raise ValueError(f"{name}={value!r}: expected {expected}")
