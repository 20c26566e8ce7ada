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
  The MLP (from TILE_FROM_ROWS rows) and a Hugging Face layer's norms (from NORM_TILE_FROM_ROWS)
  run in row tiles where the runtime tiles them (pipe/tiled_mlp.py, on the rank's rows): tiled, the
  MLP keeps none of its intermediates and the norms no fp32 copy, and their backward holds one tile's
  (layers.py's terms).
* buffers: the p2p send/receive buffers (the slice that crosses stages: divided by the sequence
  degree too), two reduce buckets in flight (ZeRO 0-2) or, at ZeRO 3, the parameters the schedule
  holds whole at once (zero3.py: the running chunk and the next other one, prefetched; with
  reshard_after_forward off every chunk from its first to its last action: at one or two chunks a
  rank, all of its parameters), the runtime's reserve.

Host memory per rank (HostBreakdown), what the offloads allocate there:
* the offloaded optimizer, per parameter of the rank's shard (zero/offload.py, zero/partition.py): the
  fp32 master (pinned) and Adam's two fp32 moments (the optimizer makes them beside the master), 12
  bytes, and where the reduced gradients land: at stages 0-1 one pinned fp32 buffer (4), at stages 2-3
  a pinned copy in the model's dtype, folded into a pinned fp32 sum (e + 4): OFFLOAD_BYTES. Each pinned
  buffer is one bucket's shard, which CUDA's pinned allocator rounds up to a power of two bytes, so the
  buckets are cut as zero/partition.py cuts them (optimizer_shards; tests/test_plan_kit.py checks them
  against plan_groups): TinyLlama's 4.4 GB of fp32 shards take 5.8 GB pinned, the 8B's 32.1 take 35.4.
  The routed experts' param group is counted at its bytes;
* checkpointed inputs in pinned host memory (pipe/memory/offload.py): every offloaded run's input
  (all of them, or with Layout.host_layers the first ones) that requires a gradient (the hidden
  states; a run that starts at the embedding has token ids) of every micro-batch in flight, at the
  peak all of them; the fused head's run copies its input and drops it at once
  (LayerProfile.keeps_input), one copy more while it lives. Each is a tensor of its own, and
  CUDA's pinned allocator rounds every block up to a power of two bytes (torch's CachingHostAllocator)
  and keeps freed blocks for the next copy;
* the process itself (Hardware.host_reserved_gb).
A node's ranks share its memory: the planner checks the fullest node's mean (planner.node_host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from pipezero.train.plan.hardware import Hardware
from pipezero.train.plan.layout import Layout
from pipezero.pipe.tiled_mlp import NORM_TILE_FROM_ROWS, NORM_TILE_ROWS, TILE_FROM_ROWS, TILE_ROWS
from pipezero.train.plan.model import LayerProfile, bytes_per_element, held_experts, held_params, tied_head

__all__ = ["HostBreakdown", "MemoryBreakdown", "OFFLOAD_BYTES", "STATE_BYTES", "activation_bytes", "backward_peak",
           "host_bytes", "model_state_bytes", "norms_tiled", "optimizer_shards", "pinned", "rank_memory",
           "rank_tokens", "step_bytes", "tiled"]

STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}

# Host bytes per parameter of an offloaded shard, by ZeRO stage: the fp32 master and Adam's two moments
# (12) and the gradients' landing: stages 0-1 land fp32 once a step (4), stages 2-3 land each micro-batch
# in the model's dtype and fold it into an fp32 sum (e + 4); the precision gives e.
OFFLOAD_BYTES = {(stage, precision): 12.0 + (4.0 if stage <= 1 else STATE_BYTES[precision][1] + 4.0)
                 for stage in range(4) for precision in STATE_BYTES}


@dataclass(frozen=True, slots=True)
class HostBreakdown:
    """Bytes one rank keeps in host memory."""

    optimizer: float = 0.0   # the offloaded optimizer's masters, moments and gradient landing
    inputs: float = 0.0      # checkpointed inputs of the micro-batches in flight, pinned
    reserved: float = 0.0    # the process itself

    @property
    def total(self) -> float:
        return self.optimizer + self.inputs + self.reserved


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one device."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    step: float = 0.0      # the optimizer step's transient (alive when the activations are not)
    grads_at_peak: float | None = None  # gradients alive at the activations' peak (None: all of `grads`)
    host: HostBreakdown = HostBreakdown()  # what the rank keeps in host memory

    @property
    def total(self) -> float:
        """The peak: the model state and buffers, plus the larger of the activations (with the gradients made
        by then) and the optimizer step (with every gradient)."""
        at_peak = self.grads if self.grads_at_peak is None else self.grads_at_peak
        return (self.params + self.optimizer + self.buffers
                + max(at_peak + self.activations, self.grads + self.step))

    def fits(self, hw: Hardware) -> bool:
        """Within the device's memory and the host's, both."""
        return self.total <= hw.memory_gb * 1e9 and self.host.total <= hw.host_memory_gb * 1e9

    def misfit(self, hw: Hardware) -> str:
        """What does not fit, in words ("" when it fits): "host 233 GB of 120"."""
        over = [f"{where} {need / 1e9:.3g} GB of {have:g}" for where, need, have in
                (("device", self.total, hw.memory_gb), ("host", self.host.total, hw.host_memory_gb))
                if need > have * 1e9]
        return " and ".join(over)


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


def tiled(layout: Layout, seq_len: int) -> bool:
    """Does the runtime run the MLP in row tiles at this layout (pipe/tiled_mlp.py's rule on the rank's rows)?"""
    rows = rank_tokens(layout, seq_len)
    return rows >= TILE_FROM_ROWS and rows > TILE_ROWS


def norms_tiled(layout: Layout, seq_len: int) -> bool:
    """Does the runtime run a Hugging Face layer's norms in row tiles here (pipe/tiled_mlp.py's norm rule)?"""
    rows = rank_tokens(layout, seq_len)
    return rows >= NORM_TILE_FROM_ROWS and rows > NORM_TILE_ROWS


def _runs(layers: Sequence[int], layout: Layout) -> list[tuple[int, Sequence[int]]]:
    """The rank's layers as the backward meets them, each run with the position of its first layer:
    checkpointed runs of `checkpoint` layers (Layout.checkpoints), or one each."""
    runs, j = [], 0
    while j < len(layers):
        k = layout.checkpoint if layout.checkpoints(j) else 1
        runs.append((j, layers[j:j + k]))
        j += k
    return runs


def _kept(profile: Sequence[LayerProfile], run: Sequence[int], layout: Layout, precision: str, d_model: int,
          tile: bool, norms: bool, checkpointed: bool, on_host: bool) -> float:
    """Bytes per token a run keeps on the device from its forward to its backward (`on_host`: its input waits
    on the host)."""
    t, e = layout.tensor, bytes_per_element(precision)
    if not checkpointed:
        return sum(profile[i].act_bytes(precision, t, tile, norms) for i in run)
    first = profile[run[0]]
    inputs = 0.0 if on_host or first.kind == "Embedding" else d_model * e  # token ids: tiny
    # row tiles keep none of their matmuls' outputs (pipe/memory/recompute.py's recomputed_matmuls)
    selective = sum(profile[i].selective_bytes(precision, t, tile) for i in run) if layout.selective else 0.0
    return inputs + selective + sum(profile[i].loss_bytes for i in run)  # the loss sits outside the checkpoint


def _working(profile: Sequence[LayerProfile], run: Sequence[int], layout: Layout, precision: str, d_model: int,
             tokens: float, tile: bool, norms: bool, checkpointed: bool, before: bool) -> float:
    """Bytes alive only while the run's backward runs: its recompute (when checkpointed), the largest
    backward transient, and the input of the run before where `before` (that one's waits on the host),
    prefetched."""
    t, e = layout.tensor, bytes_per_element(precision)
    total = 0.0
    for i in run:
        p = profile[i]
        backward = min(p.backward_bytes * tokens, p.backward_cap_bytes) + p.backward_fixed_bytes
        if tile and p.act_tiled:  # or, earlier in it, one tile's MLP intermediates, saved and their gradients
            backward = max(backward, 2 * TILE_ROWS * p.act_tiled / (1 if p.tied else t) * e)
        total = max(total, backward, p.norm_backward(precision, tokens, norms, NORM_TILE_ROWS))
    if checkpointed:
        saved = sum(profile[i].act_bytes(precision, t, tile, norms) - profile[i].loss_bytes for i in run)
        kept = sum(profile[i].selective_bytes(precision, t, tile) for i in run) if layout.selective else 0.0
        # offloaded: the input unpacked for the recompute is dropped once it ran (the recomputed ops keep
        # their own tensors); the run before's, prefetched as this recompute starts, waits on the device
        fetched = before * d_model * e if profile[run[0]].kind != "Embedding" else 0
        total += (saved - kept + fetched) * tokens
    return total


def backward_peak(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                  precision: str, d_model: int, seq_len: int,
                  grad_bytes: Sequence[float] | None = None) -> tuple[float, float]:
    """(activations, gradients made so far) at the rank's peak, walking the last micro-batch's backward.

    At each run (last first) what is alive is the other live micro-batches' kept bytes, this one's of the
    runs it has not finished (this one's included), the run's working set (_working) and, with
    `grad_bytes` (per layer of `layers`: the gradient bytes its backward makes), the gradients made by
    the runs so far and this one. The largest sum is the peak.
    """
    if live <= 0:  # no micro-batch in flight (the planner's memory floor)
        return 0.0, 0.0
    tokens, tile, norms = rank_tokens(layout, seq_len), tiled(layout, seq_len), norms_tiled(layout, seq_len)
    runs = _runs(list(layers), layout)
    kept = [_kept(profile, run, layout, precision, d_model, tile, norms, layout.checkpoints(j), layout.on_host(j))
            * tokens for j, run in runs]
    grads = dict(zip(layers, grad_bytes)) if grad_bytes is not None else {}
    others, pending, made = max(live - 1.0, 0.0) * sum(kept), sum(kept), 0.0
    best = (0.0, 0.0)
    for r in range(len(runs) - 1, -1, -1):
        (j, run), before = runs[r], r > 0 and layout.on_host(runs[r - 1][0])
        made += sum(grads.get(i, 0.0) for i in run)
        alive = others + pending + _working(profile, run, layout, precision, d_model, tokens, tile, norms,
                                            layout.checkpoints(j), before)
        if alive + made > sum(best):
            best = (alive, made)
        pending -= kept[r]
    return best


def activation_bytes(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                     precision: str, d_model: int, seq_len: int) -> float:
    """Activations at the rank's peak: `live` micro-batches' kept tensors and one backward's working set."""
    return backward_peak(profile, layers, live, layout, precision, d_model, seq_len)[0]


def _grad_bytes(profile: Sequence[LayerProfile], layers: Sequence[int], layout: Layout, precision: str) -> list[float]:
    """The gradient bytes each layer's backward makes (a tied pair's once, at the head: backward meets it first)."""
    both = {profile[i].kind for i in layers} >= {"Embedding", "Head"} and tied_head(profile)
    g = STATE_BYTES[precision][1]
    return [0.0 if both and profile[i].kind == "Embedding" else
            g * held_params(profile, [i], layout.tensor, layout.expert) for i in layers]


def pinned(nbytes: float) -> float:
    """Bytes CUDA's caching host allocator takes for a pinned tensor of `nbytes`: the next power of two."""
    return 2.0 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0.0


def optimizer_shards(profile: Sequence[LayerProfile], layers: Sequence[int], layout: Layout,
                     d_model: int) -> tuple[int, ...]:
    """The elements of this rank's slice of each ZeRO bucket of the rank's dense parameters (zero/partition.py's
    plan_groups with the planner's ds_config, reduce_bucket_size d_model x d_model): stages 0-2 cut the
    parameters, last first, into buckets of at most that many elements (a larger tensor alone), stage 3 makes
    a bucket of each layer; each bucket split over the reducing ranks (padded to a multiple of them)."""
    both = {profile[i].kind for i in layers} >= {"Embedding", "Head"} and tied_head(profile)
    runs = [[math.ceil(n / (1 if profile[i].tied else layout.tensor))
             for n in (profile[i].tensors or (profile[i].params - profile[i].expert_params,))]
            for i in layers if not (both and profile[i].kind == "Head")]
    parts = layout.reducing if layout.zero >= 1 else 1
    return _shards(tuple(tuple(run) for run in runs), d_model * d_model, parts, layout.zero == 3)


@lru_cache(maxsize=4096)
def _shards(runs: tuple[tuple[int, ...], ...], limit: int, parts: int, per_layer: bool) -> tuple[int, ...]:
    buckets: list[int] = []
    if per_layer:
        buckets = [sum(run) for run in runs if sum(run)]
    else:
        open_ = 0
        for n in (n for run in reversed(runs) for n in reversed(run)):
            if open_ and open_ + n > limit:
                buckets.append(open_)
                open_ = 0
            open_ += n
        buckets += [open_] if open_ else []
    return tuple(-(-b // parts) for b in buckets)


_MEMO: dict[tuple, tuple[Sequence[LayerProfile], float]] = {}  # _offloaded_optimizer's, by profile and rank


def _offloaded_optimizer(profile: Sequence[LayerProfile], layers: Sequence[int], layout: Layout, precision: str,
                         d_model: int) -> float:
    """Host bytes of the rank's offloaded dense buckets: each shard's fp32 master and its gradient's landing
    (stages 0-1 fp32; 2-3 the model's dtype beside an fp32 sum), each a pinned block, and Adam's moments (not
    pinned). Memoised: the planner asks for the same rank under many schedules and micro-batch counts."""
    key = (id(profile), tuple(layers), layout.tensor, layout.reducing, layout.zero, precision, d_model)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    shards = optimizer_shards(profile, layers, layout, d_model)
    landing = (4,) if layout.zero <= 1 else (bytes_per_element(precision), 4)
    total = sum(pinned(4 * s) + sum(pinned(b * s) for b in landing) for s in shards) + 8.0 * sum(shards)
    if len(_MEMO) > 1 << 16:
        _MEMO.clear()
    _MEMO[key] = (profile, total)
    return total


def host_bytes(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
               hw: Hardware, precision: str, d_model: int, seq_len: int) -> HostBreakdown:
    """Host memory of a pipeline rank holding `layers` with `live` micro-batches at its peak (module docstring)."""
    if not hw.host_offload:  # the devices are the host: nothing is offloaded, their memory is counted
        return HostBreakdown()
    optimizer = 0.0
    if layout.offload:
        experts = held_experts(profile, layers, layout.tensor, layout.expert)
        # the experts' own param group (split over the ranks holding the same experts): their bytes
        optimizer = (_offloaded_optimizer(profile, layers, layout, precision, d_model)
                     + OFFLOAD_BYTES[(layout.zero, precision)] * experts / layout.expert_holders)
    inputs = 0.0
    if layout.checkpoint and layout.host_inputs and live > 0:
        one = pinned(rank_tokens(layout, seq_len) * d_model * bytes_per_element(precision))
        firsts = [profile[run[0]] for j, run in _runs(list(layers), layout)
                  if layout.on_host(j) and profile[run[0]].kind != "Embedding"]
        kept = sum(p.keeps_input for p in firsts)
        inputs = (live * kept + (kept < len(firsts))) * one  # a run that keeps none: one copy, briefly
    return HostBreakdown(optimizer, inputs, hw.host_reserved_gb * 1e9)


def rank_memory(profile: Sequence[LayerProfile], layers: Sequence[int], live: float, layout: Layout,
                hw: Hardware, precision: str, d_model: int, seq_len: int,
                gathered: float | None = None) -> MemoryBreakdown:
    """Memory of a pipeline rank holding `layers` with `live` whole-stage micro-batches at its peak.

    `gathered` (ZeRO-3): the parameters whole at once at most, as the schedule gathers them
    (zero3.rank_gathers(...).peak); None: all of the rank's (one chunk, whole through the step).

    With one micro-batch a step and ZeRO 0-2, the gradients appear as the backward makes them (set to
    None after each step), so the peak is the largest of activations + gradients made so far along the
    backward: at long sequences the first block's, where every kept input is alive and few gradients."""
    e = bytes_per_element(precision)
    tokens = rank_tokens(layout, seq_len)
    params = held_params(profile, layers, layout.tensor, layout.expert)
    experts = held_experts(profile, layers, layout.tensor, layout.expert)
    p, g, s = model_state_bytes(params - experts, layout.zero, layout.reducing, precision, layout.offload)
    # the experts' param group reduces and shards over the ranks holding the same experts
    pe, ge, se = model_state_bytes(experts, layout.zero, layout.expert_holders, precision, layout.offload)
    p, g, s = p + pe, g + ge, s + se
    if layout.zero >= 2 and layout.microbatches > 1 and layout.reducing > 1:
        g += STATE_BYTES[precision][1] * (params - experts)  # whole .grad until the last micro-batch
    growing = layout.microbatches == 1 and layout.zero < 3
    shard = layout.reducing if layout.zero == 2 else 1  # stage 2 keeps its shard of what was reduced
    made_per_layer = [b / shard for b in _grad_bytes(profile, layers, layout, precision)] if growing else None
    act, made = backward_peak(profile, layers, live, layout, precision, d_model, seq_len, made_per_layer)
    p2p = 4 * tokens * d_model * e * layout.chunks if layout.pipe > 1 else 0.0
    if layout.zero == 3:  # the chunks whole at once (zero3.py); without the schedule's: every layer, one chunk
        whole = params if gathered is None else gathered
        working = whole * STATE_BYTES[precision][0]
    else:
        working = 2 * d_model * d_model * STATE_BYTES[precision][1] if layout.zero >= 2 else 0.0
    return MemoryBreakdown(p, g, s, act, p2p + working + hw.reserved_gb * 1e9,
                           step_bytes(params, layout, hw, precision), made if growing else None,
                           host_bytes(profile, layers, live, layout, hw, precision, d_model, seq_len))
