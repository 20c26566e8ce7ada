"""LossScaler: static or dynamic loss scaling, a world-wide skip on inf/nan, and optional clipping.

fp16 gradients underflow unless the loss is scaled up before backward (Micikevicius et al., 2018,
"Mixed Precision Training"); the optimizer then has to unscale them, skip steps whose gradients
overflowed, and move the scale (see scale_state.py for DeepSpeed's rule). With pipeline stages
and data shards every rank must skip the same step, so the inf/nan check and the gradient norm
for clipping travel in ONE two-number all-reduce over the whole world (clip.py).

bf16 and fp32 need none of this: a static scale of 1 without clipping is a pass-through to the
inner optimizer (no multiply, no check, no collective), as DeepSpeed's bf16 path checks nothing;
`check_finite=True` (or DeepSpeed's bf16 `check_grad_overflow`) turns the world-wide skip back on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any, Mapping

import torch

from pipezero.comm import all_reduce
from pipezero.chain import ChainWrapper, chain_step, describe
from pipezero.precision.clip import comm_device, grad_stats, grouped_grads
from pipezero.precision.config import ScalerConfig
from pipezero.precision.scale_state import ScaleState

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)
_MODES = ("dynamic", "static", "off")


class LossScaler(ChainWrapper):
    """Scale the loss, unscale and check the gradients, skip together on overflow, clip, step.

    `step()` returns False (and sets `last_step_skipped`) when any rank of `group` (default:
    the whole world) saw an inf/nan gradient; parameters and optimizer state are then untouched.
    Numbers for logging: `loss_scale`, `skipped_steps`, `last_grad_norm` (the global norm of the
    unscaled gradients before clipping; computed only when clipping, else nan).
    """

    def __init__(self, inner: Any, init_scale: float = 2.0 ** 16, dynamic: bool = True,
                 scale_window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0,
                 consecutive_hysteresis: bool = False, *, max_consecutive_skips: int = 0,
                 clip_grad_norm: float = 0.0, check_finite: bool | None = None, group: Any = None):
        config = ScalerConfig(init_scale=init_scale, dynamic=dynamic, scale_window=scale_window,
                              hysteresis=hysteresis, min_scale=min_scale,
                              consecutive_hysteresis=consecutive_hysteresis,
                              max_consecutive_skips=max_consecutive_skips, clip_grad_norm=clip_grad_norm,
                              check_finite=check_finite)
        super().__init__(inner)
        self.config = config
        self.group = group
        self.scale_state = ScaleState(scale=float(config.init_scale), hysteresis_left=config.hysteresis)
        self.last_grad_norm = math.nan

    @classmethod
    def from_config(cls, inner: Any, section: Mapping[str, Any] | ScalerConfig, *,
                    dtype: torch.dtype = torch.float16, clip_grad_norm: float = 0.0,
                    group: Any = None) -> "LossScaler":
        """Build from DeepSpeed's `fp16` section, or its `bf16` one with dtype=torch.bfloat16.

        `clip_grad_norm` takes DeepSpeed's top-level `gradient_clipping`; a ScalerConfig is used as is.
        """
        if isinstance(section, ScalerConfig):
            config = section
        elif dtype == torch.float16:
            config = ScalerConfig.from_fp16(section, clip_grad_norm=clip_grad_norm)
        elif dtype == torch.bfloat16:
            config = ScalerConfig.from_bf16(section, clip_grad_norm=clip_grad_norm)
        else:
            raise ValueError(f"LossScaler.from_config(dtype={dtype}): expected torch.float16 (an fp16 "
                             f"section) or torch.bfloat16 (a bf16 section)")
        return cls(inner, **asdict(config), group=group)

    # -- the user-facing numbers ------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The scale the next backward uses."""
        return self.scale_state.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan so far."""
        return self.scale_state.skipped_steps

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * loss_scale` in fp32 (an fp16 loss times 2**16 would overflow); the loss itself at scale 1."""
        if self.config.is_noop:
            return loss
        return loss.float() * self.loss_scale

    # -- the step ---------------------------------------------------------------------
    def step(self, closure: Any = None) -> bool:
        """Unscale, agree on overflow across the world, clip, step the inner optimizer; False if skipped."""
        if closure is not None:
            raise TypeError("LossScaler.step() takes no closure: run scaler.backward(loss) before step()")
        self.prepare_grads()
        if self._pass_through():
            return self._finish(chain_step(self.inner))
        finite = self._unscale_and_check()
        stepped = finite and chain_step(self.inner)
        return self._finish(stepped, overflow=not finite)

    def _pass_through(self) -> bool:
        config = self.config
        return config.is_noop and config.clip_grad_norm == 0 and not config.checks_finite

    def _params(self):
        return (p for group in self.param_groups for p in group["params"])

    def _unscale_and_check(self) -> bool:
        """Unscale (and clip) the grads in place; return whether every rank's grads are finite."""
        inv_scale = 1.0 / self.loss_scale
        groups = grouped_grads(self._params())
        if self.config.clip_grad_norm > 0:
            stats = grad_stats(groups, self.group, scale=self.loss_scale)
            self.last_grad_norm = stats.norm
            if stats.finite:
                factor = inv_scale * stats.clip_coef(self.config.clip_grad_norm)
                if factor != 1.0:
                    for grads, _ in groups.values():
                        torch._foreach_mul_(grads, factor)
            return stats.finite
        if not self.config.checks_finite:
            for grads, _ in groups.values():
                torch._foreach_mul_(grads, inv_scale)
            return True
        return self._fused_unscale_and_check(groups, inv_scale)

    def _fused_unscale_and_check(self, groups: dict, inv_scale: float) -> bool:
        """torch's fused unscale + inf/nan check per (device, dtype), then one all-reduce of the count."""
        found = torch.zeros(1, device=comm_device(self.group))
        for (device, _), (grads, _) in groups.items():
            found_here = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_here, torch.full((1,), inv_scale, device=device))
            found += found_here.to(found.device)
        all_reduce(found, group=self.group)
        return found.item() == 0

    def _finish(self, stepped: bool, overflow: bool = False) -> bool:
        config = self.config
        self.scale_state.update(overflow, dynamic=config.dynamic, hysteresis=config.hysteresis,
                                   scale_window=config.scale_window, min_scale=config.min_scale,
                                   consecutive_hysteresis=config.consecutive_hysteresis)
        self.last_step_skipped = not stepped
        if overflow:
            self._report_floor()
        return stepped

    def _report_floor(self) -> None:
        """Warn at 1, 2, 4, 8... consecutive skips at the floor; raise past max_consecutive_skips."""
        count = self.scale_state.consecutive_skips_at_floor
        if count == 0:
            return
        limit = self.config.max_consecutive_skips
        if limit and count >= limit:
            raise RuntimeError(
                f"LossScaler: {count} consecutive steps skipped for inf/nan gradients at the floor scale "
                f"{self.loss_scale} (max_consecutive_skips={limit}); the model diverged or min_scale is too "
                f"high: lower the learning rate or min_scale, or pass max_consecutive_skips=0 to keep going")
        if count & (count - 1) == 0:
            log.warning("LossScaler: %d consecutive step(s) skipped for inf/nan gradients at the floor "
                        "scale %s", count, self.loss_scale)

    # -- checkpoints ------------------------------------------------------------------
    def link_state_dict(self) -> dict:
        """{"loss_scaler": plain numbers (scale, hysteresis, counters) and the "mode" that moved them};
        state_dict() adds "inner"."""
        return {"loss_scaler": {**self.scale_state.as_dict(), "mode": self._mode()}}

    def _load_link(self, state: Mapping[str, Any]) -> None:
        """Restore what link_state_dict() returned, by the rule of `resumed_scale_state`."""
        saved = dict(state["loss_scaler"])
        mode = saved.pop("mode", None)
        if mode is not None and mode not in _MODES:
            raise ValueError(f"loss-scaler state: mode={mode!r}, expected one of {list(_MODES)} (a checkpoint "
                             f"edited or damaged); load another step")
        self.scale_state = self.resumed_scale_state(ScaleState.from_dict(saved), mode)

    def resumed_scale_state(self, saved: ScaleState, mode: str | None) -> ScaleState:
        """The state a resume continues from: the configured scaler decides what the checkpoint may set.

        The scale is configuration unless it moves: a dynamic scaler continues a dynamic
        checkpoint's trajectory (scale, hysteresis, counters), but starts afresh, as a new fp16 run,
        when the checkpoint's scaler was static or off (an fp32/bf16 run resumed in fp16 must not
        train at the no-op scale 1.0); a static or no-op scaler keeps its configured scale and
        takes only the step and skip counters. `mode` None (a checkpoint written before the mode
        was recorded) is taken to be this scaler's own.
        """
        mine = self._mode()
        if mine == "dynamic" and mode in (None, "dynamic"):
            return saved
        fresh = ScaleState(scale=float(self.config.init_scale), hysteresis_left=self.config.hysteresis)
        if mine == "dynamic":
            log.info("LossScaler: the checkpoint's loss scaler was %s; the configured dynamic scaler starts at "
                     "%g", mode, fresh.scale)
            return fresh
        fresh.iteration, fresh.skipped_steps = saved.iteration, saved.skipped_steps
        return fresh

    def _mode(self) -> str:
        return "dynamic" if self.config.dynamic else "off" if self.config.is_noop else "static"

    def __repr__(self) -> str:
        config = self.config
        if config.dynamic:
            mode = "dynamic"
        elif config.is_noop:
            mode = "off"
        else:
            mode = f"static={config.init_scale:g}"
        clip = f", clip={config.clip_grad_norm:g}" if config.clip_grad_norm else ""
        return f"LossScaler({mode}{clip}, {describe(self.inner)})"
