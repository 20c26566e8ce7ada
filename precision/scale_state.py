"""ScaleState: the dynamic loss-scale trajectory, step for step as DeepSpeed's fp16 path moves it.

Mixed-precision training (Micikevicius et al., 2018, "Mixed Precision Training") multiplies the
loss by a scale so small fp16 gradients do not flush to zero, and lowers the scale when gradients
overflow. DeepSpeed's rule, which a DeepSpeed user's `fp16` section expects:
  * overflow: the step is skipped; when the hysteresis is down to 1 (or configured as 1) the scale
    becomes max(scale / 2, min_scale), otherwise the hysteresis left drops by one;
  * clean step: with consecutive_hysteresis the hysteresis refills; when the stable interval
    (iteration - last overflow iteration - 1, the last overflow iteration starting at -1) is
    positive and a multiple of scale_window, the hysteresis refills and the scale doubles. So the
    first growth comes at iteration scale_window, one clean step later than torch's GradScaler,
    and after an overflow at iteration k the next growth is at k + scale_window + 1.
Unlike DeepSpeed, an overflow at the floor never raises here: LossScaler counts and reports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from pipezero.checks import is_int, is_number

__all__ = ["ScaleState"]

_FACTOR = 2.0


@dataclass(slots=True)
class ScaleState:
    """The mutable scale, hysteresis and counters of one LossScaler (JSON-able via as_dict)."""

    scale: float
    hysteresis_left: int
    iteration: int = 0
    last_overflow_iteration: int = -1
    skipped_steps: int = 0
    consecutive_skips_at_floor: int = 0

    def update(self, overflow: bool, *, dynamic: bool, hysteresis: int, scale_window: int,
               min_scale: float, consecutive_hysteresis: bool) -> None:
        """Advance one step: `overflow` says the step was skipped for inf/nan."""
        if overflow:
            self.skipped_steps += 1
            at_floor = not dynamic or self.scale <= min_scale
            self.consecutive_skips_at_floor = self.consecutive_skips_at_floor + 1 if at_floor else 0
        else:
            self.consecutive_skips_at_floor = 0
        if dynamic:
            self._move(overflow, hysteresis, scale_window, min_scale, consecutive_hysteresis)
        self.iteration += 1

    def _move(self, overflow: bool, hysteresis: int, scale_window: int, min_scale: float,
              consecutive_hysteresis: bool) -> None:
        if overflow:
            if hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / _FACTOR, min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
            return
        if consecutive_hysteresis:
            self.hysteresis_left = hysteresis
        stable = self.iteration - self.last_overflow_iteration - 1
        if stable > 0 and stable % scale_window == 0:
            self.hysteresis_left = hysteresis
            self.scale *= _FACTOR

    def as_dict(self) -> dict[str, float | int]:
        """Plain numbers for a checkpoint's JSON metadata."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ScaleState":
        """Rebuild from as_dict(); a missing or unknown key is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"loss-scaler state must have exactly the keys {sorted(names)}, got {got}; "
                             f"pass the 'loss_scaler' entry of LossScaler.state_dict()")
        scale = data["scale"]
        if not is_number(scale, above=0):
            raise ValueError(f"loss-scaler state: scale={scale!r}, expected a finite number > 0 (a checkpoint "
                             f"edited or damaged); load another step or drop its loss-scaler state")
        counts = {k: data[k] for k in names - {"scale"}}
        for key, value in sorted(counts.items()):
            low = -1 if key == "last_overflow_iteration" else 0
            if not is_int(value, minimum=low):
                raise ValueError(f"loss-scaler state: {key}={value!r}, expected an integer >= {low} (a "
                                 f"checkpoint edited or damaged); load another step")
        return cls(scale=float(scale), **counts)
