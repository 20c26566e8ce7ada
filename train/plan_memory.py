"""Peak memory per device of one layout: model state, activations, buffers.

* model state: the ZeRO formulas over the parameters one pipeline rank holds, divided by the
  tensor degree (tied layers stay whole), N = the data degree (Rajbhandari et al. 2020,
  section 5; the bytes per parameter tests/test_zero_memory.py checks against ZeroOptimizer):
  stage 0: P + G + S, 1: P + G + S/N, 2: P + (G + S)/N, 3: (P + G + S)/N, with
  (P, G, S) = (4, 4, 8) in fp32 and (2, 2, 12) in bf16/fp16 (fp32 masters and Adam moments).
  Offloading the optimizer moves S to the host. Stages 2-3 with several micro-batches also
  hold every parameter's whole .grad until the last micro-batch's backward reduces it
  (zero/grad_strategies.py, TransientShardSync: reduction waits for the pipeline's
  readiness protocol unless reduce_every_microbatch, which the planner's ds_config leaves
  off), so a whole G sits beside the shard then.
* activations: the simulator's peak live micro-batches of the rank (in whole-stage units)
  x the saved bytes of one micro-batch on it; with checkpointing only each layer's input
  stays, plus one layer's full activations while it is recomputed.
* buffers: the p2p send/receive buffers, two reduce buckets in flight (ZeRO 0-2) or two
  gathered layers (ZeRO 3), the runtime's reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipezero.train.plan_hardware import Hardware
from pipezero.train.plan_layout import Layout
from pipezero.train.plan_model import LayerProfile, bytes_per_element

__all__ = ["MemoryBreakdown", "STATE_BYTES", "model_state_bytes", "rank_memory"]

STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one device."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        """Everything."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def model_state_bytes(params: float, stage: int, data: int, precision: str = "bf16",
                      offload: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device for `params` parameters by the ZeRO formulas."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage={stage!r}: expected 0, 1, 2 or 3")
    p, g, s = STATE_BYTES[precision]
    n = data
    opt = 0.0 if offload else s * params / (n if stage >= 1 else 1)
    grads = g * params / (n if stage >= 2 else 1)
    return p * params / (n if stage == 3 else 1), grads, opt


def _rank_params(profile: Sequence[LayerProfile], layers: Sequence[int], tensor: int) -> float:
    return sum(profile[i].params / (1 if profile[i].tied else tensor) for i in layers)


def rank_memory(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                hw: Hardware, precision: str, d_model: int, seq_len: int) -> MemoryBreakdown:
    """Memory of a pipeline rank holding `layers` with `live` whole-stage micro-batches at its peak."""
    e = bytes_per_element(precision)
    tokens = layout.microbatch_size * seq_len
    params = _rank_params(profile, layers, layout.tensor)
    p, g, s = model_state_bytes(params, layout.zero, layout.data, precision, layout.offload)
    if layout.zero >= 2 and layout.microbatches > 1 and layout.data > 1:
        g += STATE_BYTES[precision][1] * params  # whole .grad held until the last micro-batch (TransientShardSync)
    per_layer = [profile[i].act_bytes(precision, layout.tensor) * tokens for i in layers]
    if layout.checkpoint:
        kept = len(layers) / layout.checkpoint * tokens * d_model * e
        act = live * kept + max(per_layer) * layout.checkpoint
    else:
        act = live * sum(per_layer)
    p2p = 4 * tokens * d_model * e * layout.chunks if layout.pipe > 1 else 0.0
    if layout.zero == 3:
        largest = max(profile[i].params / (1 if profile[i].tied else layout.tensor) for i in layers)
        working = 2 * largest * STATE_BYTES[precision][0]
    else:
        working = 2 * d_model * d_model * STATE_BYTES[precision][1] if layout.zero >= 2 else 0.0
    return MemoryBreakdown(p, g, s, act, p2p + working + hw.reserved_gb * 1e9)
