"""ScalerConfig: the validated settings of a LossScaler, and the DeepSpeed sections they come from.

One small typed dataclass owns every knob (so LossScaler's constructor and from_config share one
validation), and two readers translate DeepSpeed's `fp16` / `bf16` sections into it: a DeepSpeed
user's config gives the same scale trajectory here as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ScalerConfig", "FP16_KEYS", "BF16_KEYS"]

# DeepSpeed fp16 keys. `auto_cast` and `fp16_master_weights_and_grads` belong to the model and
# ZeRO glue (train/, zero/), not to loss scaling: accepted here and left to them.
FP16_KEYS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                       "fp16_master_weights_and_grads"})
# DeepSpeed bf16 keys: bf16 needs no scaling; `check_grad_overflow` asks for the inf/nan skip anyway.
BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow"})


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
    """Skip steps whose gradients hold inf/nan. None: yes when scaling (fp16), no for the bf16/fp32
    no-op path (as DeepSpeed's bf16 path); a clipped step always skips on a non-finite norm."""

    def __post_init__(self) -> None:
        _check_number("init_scale", self.init_scale, "a positive finite number, e.g. 2.0**16")
        _check_number("min_scale", self.min_scale, "a positive finite number, e.g. 1.0")
        for name in ("scale_window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ScalerConfig({name}={value!r}): must be an integer >= 1")
        skips = self.max_consecutive_skips
        if isinstance(skips, bool) or not isinstance(skips, int) or skips < 0:
            raise ValueError(f"ScalerConfig(max_consecutive_skips={skips!r}): must be an integer >= 0 "
                             f"(0 = keep training at the floor scale)")
        clip = self.clip_grad_norm
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
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
        """Read DeepSpeed's `fp16` section: `loss_scale` 0 = dynamic from 2**initial_scale_power."""
        _check_keys("fp16", section, FP16_KEYS)
        if not _flag("fp16", section, "enabled", True):
            return cls(init_scale=1.0, dynamic=False, **extra)
        loss_scale = section.get("loss_scale", 0)
        power = section.get("initial_scale_power", 16)
        if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 127:
            raise ValueError(f"fp16.initial_scale_power={power!r}: must be an integer in 0..127 (16 means 2**16)")
        _check_number("fp16.loss_scale", loss_scale, "0 for dynamic scaling or a positive static scale",
                      allow_zero=True)
        dynamic = loss_scale == 0
        return cls(init_scale=2.0 ** power if dynamic else float(loss_scale), dynamic=dynamic,
                   scale_window=section.get("loss_scale_window", 1000),
                   hysteresis=section.get("hysteresis", 2),
                   min_scale=float(_numeric("fp16.min_loss_scale", section.get("min_loss_scale", 1.0))),
                   consecutive_hysteresis=_flag("fp16", section, "consecutive_hysteresis", False), **extra)

    @classmethod
    def from_bf16(cls, section: Mapping[str, Any], **extra: Any) -> "ScalerConfig":
        """Read DeepSpeed's `bf16` section: no scaling; inf/nan skipping only if asked for."""
        _check_keys("bf16", section, BF16_KEYS)
        _flag("bf16", section, "enabled", True)
        _flag("bf16", section, "immediate_grad_update", False)
        check = _flag("bf16", section, "check_grad_overflow", False)
        extra.setdefault("check_finite", check)
        return cls(init_scale=1.0, dynamic=False, **extra)


def _check_keys(name: str, section: Mapping[str, Any], known: frozenset) -> None:
    if not isinstance(section, Mapping):
        raise TypeError(f"the {name} config section must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the {name} config section; "
                         f"known keys: {sorted(known)}")


def _flag(name: str, section: Mapping[str, Any], key: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name}.{key}={value!r}: must be true or false "
                         f"(resolve \"auto\" values before building the scaler)")
    return value


def _numeric(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: must be a number (resolve \"auto\" values first)")
    return value


def _check_number(name: str, value: Any, expected: str, allow_zero: bool = False) -> None:
    _numeric(name, value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r}: expected {expected}")
