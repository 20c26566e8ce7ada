"""Peak memory per device of one layout: model state, activations, buffers.

* model state: the ZeRO formulas over the parameters one pipeline rank holds, divided by the
  tensor degree (tied layers stay whole), N = data x sequence (the ranks that reduce gradients
  and partition ZeRO's state: a sequence rank holds every parameter, as a data rank does;
  topology/grid.py's data_sequence_group) (Rajbhandari et al. 2020,
  section 5; the bytes per parameter tests/test_zero_memory.py checks against ZeroOptimizer):
  stage 0: P + G + S, 1: P + G + S/N, 2: P + (G + S)/N, 3: (P + G + S)/N, with
  (P, G, S) = (4, 4, 8) in fp32 and (2, 2, 12) in bf16/fp16 (fp32 masters and Adam moments).
  Offloading the optimizer moves S to the host. Stages 2-3 with several micro-batches also
  hold every parameter's whole .grad until the last micro-batch's backward reduces it
  (zero/grad_strategies.py, TransientShardSync: reduction waits for the pipeline's
  readiness protocol unless reduce_every_microbatch, which the planner's ds_config leaves
  off), so a whole G sits beside the shard then.
* the optimizer step (beside the model state, when no activation is alive): in bf16/fp16 the
  fp32 copies of the shard's reduced gradients that the masters step on (4 bytes per
  parameter; zero/grad_sync.py hands them over), plus Adam's temporary
  (Hardware.optimizer_temp_bytes: torch's foreach Adam, the default on a GPU, takes the
  square root of the whole shard's second moments at once). Nothing of it on the device
  when the optimizer is offloaded. On one GPU at small micro-batches this step, 24 bytes per
  parameter in bf16, is the peak, not the activations.
* activations: every count is per token of the rank's slice of a micro-batch, micro-batch size x
  sequence length / the sequence degree: Ulysses (pipe/sequence/) holds a slice of the sequence
  outside attention and, inside it, the whole sequence for heads / degree of the heads, the same
  elements either way (Jacobs et al. 2023, arXiv 2309.14509, section 3). Attention keeps
  nothing that grows with the square of the sequence: the fused (flash) kernel saves its output
  and log-sum-exp per token, never the s x s scores, and packed documents attend per document
  (no s x s mask), so memory is linear in the sequence length.
  The simulator's peak live micro-batches of the rank (in whole-stage units)
  x the saved bytes of one micro-batch on it, plus the loss's backward transient of the one
  micro-batch being differentiated (LayerProfile.backward_bytes); with checkpointing every
  live micro-batch keeps each checkpointed run's input and the loss's saved output, and then
  either the loss's backward transient or the run being recomputed with its full activations
  (the loss's backward is over before the first recompute starts).
* buffers: the p2p send/receive buffers (the slice that crosses stages: divided by the sequence
  degree too), two reduce buckets in flight (ZeRO 0-2) or two
  gathered layers (ZeRO 3), the runtime's reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipezero.train.plan.hardware import Hardware
from pipezero.train.plan.layout import Layout
from pipezero.train.plan.model import LayerProfile, bytes_per_element, held_params

__all__ = ["MemoryBreakdown", "STATE_BYTES", "activation_bytes", "model_state_bytes", "rank_memory", "rank_tokens",
           "step_bytes"]

STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one device."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    step: float = 0.0      # the optimizer step's transient (alive when the activations are not)

    @property
    def total(self) -> float:
        """The peak: the model state and buffers, plus the larger of the activations and the step."""
        return self.params + self.grads + self.optimizer + max(self.activations, self.step) + self.buffers


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


def step_bytes(params: float, layout: Layout, hw: Hardware, precision: str) -> float:
    """Bytes the optimizer step allocates on the device for a moment (see the module docstring)."""
    if layout.offload:
        return 0.0
    shard = params / (layout.reducing if layout.zero >= 1 else 1)
    master_grads = 4.0 if bytes_per_element(precision) < 4 else 0.0
    return shard * (master_grads + hw.optimizer_temp_bytes)


def rank_tokens(layout: Layout, seq_len: int) -> float:
    """Tokens of one micro-batch on one rank: its sequence slice (the whole sequence at sequence 1)."""
    return layout.microbatch_size * seq_len / layout.sequence


def activation_bytes(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                     precision: str, d_model: int, seq_len: int) -> float:
    """Activations at the rank's peak: `live` micro-batches' saved tensors, one backward's transient."""
    tokens = rank_tokens(layout, seq_len)
    transient = max(profile[i].backward_bytes for i in layers) * tokens
    saved = [profile[i].act_bytes(precision, layout.tensor) * tokens for i in layers]
    if not layout.checkpoint:
        return live * sum(saved) + transient
    k = layout.checkpoint
    runs = [range(j, min(j + k, len(layers))) for j in range(0, len(layers), k)]
    loss = [profile[i].loss_bytes * tokens for i in layers]  # outside the checkpoint: kept
    kept = len(runs) * tokens * d_model * bytes_per_element(precision) + sum(loss)
    recomputed = max(sum(saved[j] - loss[j] for j in run) for run in runs)
    return live * kept + max(recomputed, transient)  # the loss's backward ends before the first recompute


def rank_memory(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                hw: Hardware, precision: str, d_model: int, seq_len: int) -> MemoryBreakdown:
    """Memory of a pipeline rank holding `layers` with `live` whole-stage micro-batches at its peak."""
    e = bytes_per_element(precision)
    tokens = rank_tokens(layout, seq_len)
    params = held_params(profile, layers, layout.tensor)
    p, g, s = model_state_bytes(params, layout.zero, layout.reducing, precision, layout.offload)
    if layout.zero >= 2 and layout.microbatches > 1 and layout.reducing > 1:
        g += STATE_BYTES[precision][1] * params  # whole .grad held until the last micro-batch (TransientShardSync)
    act = activation_bytes(profile, layers, live, layout, precision, d_model, seq_len)
    p2p = 4 * tokens * d_model * e * layout.chunks if layout.pipe > 1 else 0.0
    if layout.zero == 3:
        largest = max(profile[i].params / (1 if profile[i].tied else layout.tensor) for i in layers)
        working = 2 * largest * STATE_BYTES[precision][0]
    else:
        working = 2 * d_model * d_model * STATE_BYTES[precision][1] if layout.zero >= 2 else 0.0
    return MemoryBreakdown(p, g, s, act, p2p + working + hw.reserved_gb * 1e9,
                           step_bytes(params, layout, hw, precision))
