"""Step time of one layout: the pipeline simulator per rank, then data-parallel traffic and the optimizer.

* compute: each layer's forward + backward seconds per token x the micro-batch's tokens,
  split F : I : W = 1 : 1 : 1 (backward = two matmuls per forward one: input and weight
  gradients; under a schedule that splits backward, I + W is what measure_profile timed the
  runner's split to cost, which on a GPU at small micro-batches is more than B), divided by
  the tensor degree except for tied layers, which stay whole, plus a
  fixed launch overhead per layer and action (Hardware.layer_overhead_us), which is what
  makes small micro-batches slower on a GPU;
  checkpointing adds the recompute to the backward: one forward, or what measure_profile
  timed a checkpointed block to add (on a GPU at small micro-batches the recompute's launches
  and torch.utils.checkpoint's own work cost more than the forward's kernels), less the MLP's
  share where its row tiles recompute it anyway (the layer's recompute stops before them);
* tensor parallel: Megatron's two all-reduces of the block's output in forward and two in
  backward, ring time 2(t-1)/t x bytes / bandwidth, not overlapped; plus what the split's hooks
  and collective calls add to a block per micro-batch (measure_profile), which is host time that
  does not shrink with the micro-batch or the tensor degree;
* sequence parallel (Ulysses, pipe/sequence/; Jacobs et al. 2023, arXiv 2309.14509, section 3.2):
  every block's attention turns its sequence slice into head shards and back with all-to-alls:
  queries, keys and values before it and the output after it, 4 in the forward and 4 of their
  gradients in the backward (4 more in the recompute under checkpointing). Each moves the
  rank's slice, b x s/P x d/T elements (b the micro-batch, s the sequence, d the model width,
  P the degree, T the tensor degree: a tensor rank exchanges only its heads / T), of which
  (P-1)/P leave the rank: per block and micro-batch
  8 x (P-1)/P x b x s/P x d/T x bytes per element over the sequence group's link, plus P-1
  latencies per all-to-all, not overlapped. (The paper counts a layer's messages as 3Nh for
  q, k, v and Nh for the output, 4Nh/P per device; the backward moves their gradients alike.)
  The layers' compute is the rank's slice: s/P tokens (inside attention the whole sequence for
  heads/P of the heads, the same FLOPs);
* expert parallel (pipe/expert/, a MoE's experts over the expert axis): each MoE block sends every
  token's hidden state to its top-k experts' ranks and back, dispatch and combine, each
  tokens x d x top-k x bytes per element of which (E-1)/E leave the rank, plus E-1 latencies: 2
  all-to-alls forward, 2 backward (2 more recomputed under checkpointing), not overlapped (the
  runner's opt-in overlap_pairs, neighbouring F / B in turns, is not counted until measured); beside
  a tensor split each tensor rank dispatches its share of the tokens (pipe/tensor_tokens.py: the block's gather back counted as the MLP's
  all-reduce); the experts' gradients are all-reduced over the ranks that hold the same experts
  (data x sequence x tensor, also without an expert axis: the whole experts' tensor sum joins that
  reduction, once a step), the dense ones over data x expert x sequence;
* the memory kit: the MLP in row tiles (from TILE_FROM_ROWS tokens a micro-batch, as the runtime
  does) adds one MLP forward to the backward; a selective recompute re-runs only the elementwise
  ops, whose cost is their bytes read and written once at the device's memory bandwidth
  (Hardware.memory_gbps), or where the profile was measured what the block cost more under it, as
  PipelineModule runs it (eager, its ops through torch's dispatch mode: LayerProfile.selective_seconds);
  checkpointed inputs in host memory cross PCIe out in the forward and
  back in the backward, on a side stream: what a block's copy takes beyond its own compute shows;
* p2p: one activation (tokens x d_model, the sequence slice under a sequence axis) per hop,
  latency + bytes / bandwidth of the link
  between neighbouring stages (inter-node when a stage's tensor x data ranks fill a node);
* pipe/schedule/simulate.py runs the schedule with those per-(rank, chunk) costs: makespan, bubble,
  peak live micro-batches;
* data parallel (per pipeline rank, its own parameters, over data x sequence: the sequence ranks
  hold gradients of different slices of the same batch): ZeRO 0 all-reduces the gradients,
  1-2 reduce-scatter them and all-gather the updated parameters, 3 gathers each layer as often as
  the schedule's action list makes its chunk whole again (zero3.py: once a step with
  reshard_after_forward off, once per run of a chunk's actions with it on) and reduce-scatters
  each layer's gradient once a step. Gradient reduction overlaps the rank's last micro-batch
  backward (overlap_comm); ZeRO-3's gathers overlap the compute (the next chunk is prefetched)
  except the step's first chunk's; the parameter all-gather after the step (ZeRO 1-2) is exposed;
  ZeRO 0-2's collectives run in buckets of d_model^2 elements (reduce_bucket_size "auto"),
  ZeRO-3's one per layer, each paying the ring's latency;
* optimizer: Adam over the rank's shard on the device, or on the host plus the PCIe
  round trip when offloaded. On a GPU the step is memory-bound: per parameter in bf16 the
  fp32 copy of the reduced gradient (read 2, write 4 bytes), the clipping norm (4) and scale
  (8), torch's foreach AdamW (lerp of m 12, v x beta2 8, v + g^2 12, sqrt(v) 8, / bias
  correction 8, + eps 8, the update 16: 72), the master copied into the bf16 parameter (6),
  the gradient buffer zeroed (2): 98 bytes (hardware.H200_STEP_BYTES), four times the
  36 of one fused pass, which is what the GPU measured (41 ms for 1.32B parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple, Sequence

from pipezero.pipe.schedule.actions import Op
from pipezero.pipe.partition import partition
from pipezero.pipe.schedule.placement import owner
from pipezero.pipe.schedule.registry import make_schedule, schedule_entry
from pipezero.pipe.schedule.simulate import Costs, SimResult, simulate
from pipezero.train.plan.hardware import Hardware
from pipezero.train.plan.layout import Layout
from pipezero.train.plan.memory import rank_tokens, tiled
from pipezero.train.plan.model import LayerProfile, bytes_per_element, held_experts, held_params
from pipezero.train.plan.zero3 import Gathers, layout_gathers

__all__ = ["TimeBreakdown", "all_to_all_seconds", "buckets", "chunk_layers", "data_parallel_seconds",
           "expert_all_to_all_seconds", "kit_seconds", "optimizer_seconds", "ring_seconds",
           "Sim", "simulate_layout", "step_time", "step_time_floor"]


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    """Seconds of one optimizer step and where they go."""

    compute: float        # the busiest pipeline rank's busy time (incl. tensor-parallel comm, p2p wait excluded)
    pipeline: float       # simulated makespan of the schedule
    tensor_comm: float    # part of compute spent in tensor-parallel all-reduces
    data_comm: float      # data-parallel traffic in all
    exposed_comm: float   # the part of it that is not hidden behind compute
    optimizer: float      # optimizer step (and offload transfers)
    bubble: float         # the simulator's idle fraction
    sequence_comm: float = 0.0  # part of compute spent in the sequence axis' all-to-alls (the busiest rank's)
    expert_comm: float = 0.0    # part of compute spent in the expert axis' dispatch / combine (the busiest rank's)

    @property
    def total(self) -> float:
        """Step time."""
        return self.pipeline + self.exposed_comm + self.optimizer


def ring_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float, factor: float = 1.0,
                 calls: int = 1) -> float:
    """Ring collective moving factor x (n-1)/n x nbytes per rank (all-reduce: factor 2), in `calls` pieces.

    Each piece pays the ring's factor x (n-1) hops of latency, which is what makes many small
    buckets over many ranks slow (ZeRO-3 at data 512 is latency-bound, not bandwidth-bound).
    """
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * nbytes / bandwidth + calls * factor * (ranks - 1) * latency


@lru_cache(maxsize=256)
def _bounds(weights: tuple[float, ...], pipe: int, chunks: int, placement: str) -> tuple[int, ...]:
    parts = pipe * chunks
    ranks = [owner(s, pipe, placement)[0] for s in range(parts)]
    return tuple(partition(list(weights), parts, list(weights), ranks=ranks))


def chunk_layers(profile: Sequence[LayerProfile], layout: Layout, placement: str) -> dict[tuple[int, int], range]:
    """(rank, chunk) -> the layer indices it holds, balanced on measured or modelled seconds."""
    weights = tuple(max(p.seconds, 1e-12) for p in profile)
    bounds = _bounds(weights, layout.pipe, layout.chunks, placement)
    return {owner(s, layout.pipe, placement): range(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)}


def all_to_all_seconds(layout: Layout, hw: Hardware, precision: str, d_model: int, seq_len: int) -> float:
    """One Ulysses all-to-all of a block (queries, keys, values or the output): the rank's slice of
    b x s/P x d/T elements (its tensor rank's heads), (P-1)/P of it sent, over the sequence group's link
    (module docstring)."""
    sp, width = layout.sequence, d_model / layout.tensor
    bw, lat = hw.link(layout.tensor * sp)
    return ring_seconds(rank_tokens(layout, seq_len) * width * bytes_per_element(precision), sp, bw, lat)


def expert_all_to_all_seconds(layout: Layout, hw: Hardware, precision: str, d_model: int, seq_len: int,
                              top_k: int) -> float:
    """One dispatch (or combine) of a MoE block: the rank's share of the tokens (1 / tensor of them) x d x top-k
    elements, (E-1)/E of them sent, over the expert group's link (E ranks inside the data axis, tensor x
    sequence apart)."""
    e = layout.expert
    bw, lat = hw.link(layout.tensor * layout.sequence * e)
    share = rank_tokens(layout, seq_len) / layout.tensor
    return ring_seconds(share * d_model * top_k * bytes_per_element(precision), e, bw, lat)


def kit_seconds(p: LayerProfile, layout: Layout, hw: Hardware, precision: str, d_model: int, seq_len: int,
                forward: float, position: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds the memory kit adds to one layer and micro-batch (module docstring):
    `forward` is the layer's own forward seconds, under which a host copy hides; `position`: the layer's in
    its chunk (Layout.checkpoints and on_host: whether it is checkpointed, its input on the host)."""
    tokens, e = rank_tokens(layout, seq_len), bytes_per_element(precision)
    back = 0.0
    if tiled(layout, seq_len) and p.act_tiled and p.flops:
        back += p.seconds * p.mlp_flops / p.flops / 3 * tokens * hw.compute_slowdown / (1 if p.tied else layout.tensor)
    if layout.checkpoints(position) and layout.selective and p.selective_seconds is not None:  # measured
        back += p.selective_seconds * tokens * hw.compute_slowdown / (1 if p.tied else layout.tensor)
    elif layout.checkpoints(position) and layout.selective:
        redone = p.act_bytes(precision, layout.tensor, tiled(layout, seq_len)) - p.selective_bytes(
            precision, layout.tensor, tiled(layout, seq_len)) - p.loss_bytes
        back += 2 * redone * tokens / (hw.memory_gbps * 1e9)
    if layout.on_host(position) and p.kind != "Embedding":
        copy = tokens * d_model * e / (hw.pcie_gbps * 1e9)
        return max(0.0, copy - forward), back + max(0.0, copy - forward)
    return 0.0, back


def _chunk_costs(profile: Sequence[LayerProfile], layers: range, layout: Layout, hw: Hardware,
                 precision: str, d_model: int, seq_len: int, p2p: float) -> tuple[Costs, float]:
    tokens = rank_tokens(layout, seq_len)
    t = layout.tensor

    def seconds(per_token) -> float:  # the chunk's layers, tensor-parallel ones split t ways
        each = sum(per_token(profile[i]) / (1 if profile[i].tied else t) for i in layers)
        return each * tokens * hw.compute_slowdown
    sec = seconds(lambda p: p.seconds)
    backward = 2 * sec / 3
    if schedule_entry(layout.schedule).cls.split_backward:  # I + W as the runner's own split measured
        split = seconds(lambda p: p.seconds if p.split_seconds is None else p.split_seconds) - sec / 3
        backward = split if split > 0 else backward  # a split timed faster than the forward: a busy machine's noise
    launches = len(layers) * hw.layer_overhead_us * 1e-6
    if t > 1:  # the split's host work, per layer and micro-batch whatever its size, a third per action
        launches += sum(profile[i].tensor_overhead for i in layers if not profile[i].tied) * hw.compute_slowdown / 3
    blocks = sum(1 for i in layers if not profile[i].tied and profile[i].flops > 0)
    bw, lat = hw.link(t)
    one = ring_seconds(tokens * d_model * bytes_per_element(precision), t, bw, lat, factor=2.0)
    a2a = 4 * blocks * all_to_all_seconds(layout, hw, precision, d_model, seq_len)  # q, k, v, out
    fwd, tp = sec / 3 + launches + 2 * blocks * one + a2a, 4 * blocks * one
    back, weight = backward / 2 + launches + 2 * blocks * one + a2a, backward / 2 + launches
    moe = [profile[i] for i in layers if profile[i].expert_params]
    if moe and layout.expert > 1:
        dispatch = 2 * len(moe) * expert_all_to_all_seconds(layout, hw, precision, d_model, seq_len, moe[0].moe_top_k)
        fwd, back = fwd + dispatch, back + dispatch
        a2a += dispatch / 2  # recomputed under checkpointing with the rest of the forward's exchanges
    k = layout.checkpoint or 1
    redone = [i for j, i in enumerate(layers) if layout.checkpoints(j - j % k)]  # the checkpointed layers
    share = len(redone) / len(layers) if layers else 0.0  # of the chunk's exchanges and launches, recomputed
    if redone and not layout.selective:  # the recompute: measured, or one more forward
        tile = tiled(layout, seq_len)
        back += sum(_recompute_seconds(profile[i], tile) / (1 if profile[i].tied else t)
                    for i in redone) * tokens * hw.compute_slowdown
        back += (launches + 2 * blocks * one + a2a) * share
    elif redone:  # selective: the matmuls' outputs kept, the exchanges and elementwise ops re-run
        back += a2a * share
    for j, i in enumerate(layers):
        p = profile[i]
        own_forward = p.seconds / 3 * tokens * hw.compute_slowdown / (1 if p.tied else t)
        added = kit_seconds(p, layout, hw, precision, d_model, seq_len, own_forward, j - j % k)
        fwd, back = fwd + added[0], back + added[1]
    return Costs(forward=fwd, backward_input=back, backward_weight=weight, p2p=p2p), tp * layout.microbatches


def _recompute_seconds(p: LayerProfile, tile: bool) -> float:
    """Per token, what checkpointing adds to a layer's backward: measured, or one more forward; with its
    MLP in row tiles, less the MLP's share (the recompute stops before the tiles, which recompute
    themselves in their own backward: pipe/tiled_mlp.py)."""
    whole = p.seconds / 3 if p.recompute_seconds is None else p.recompute_seconds
    return whole * (1 - p.mlp_flops / p.flops) if tile and p.act_tiled and p.flops else whole


class Sim(NamedTuple):
    """What the time and memory models need from a simulated schedule."""

    makespan: float
    busy: dict[int, float]           # rank -> busy seconds
    bubble: float
    live: dict[int, float]           # rank -> peak live micro-batches, whole-stage units
    last_backward: dict[int, float]  # rank -> seconds of the last micro-batch's backward


def _summarise(result: SimResult) -> Sim:
    last_mb = max(e.action.microbatch for e in result.timeline)
    last = {r: 0.0 for r in result.busy}
    for e in result.timeline:
        if e.action.op is not Op.FORWARD and e.action.microbatch == last_mb:
            last[e.rank] += e.end - e.start
    return Sim(result.makespan, dict(result.busy), result.bubble, result.peak_stage_activations(), last)


def _run(layout: Layout, m: int, costs: dict) -> Sim:
    chunks = layout.chunks if layout.schedule == "interleaved_1f1b" else None
    return _summarise(simulate(make_schedule(layout.schedule, m, chunks), layout.pipe, costs=costs))


def _extrapolated(layout: Layout, costs: dict) -> Sim:
    """Simulate at two smaller micro-batch counts and extend linearly: past a few times the
    stages, every built-in schedule repeats one steady period per micro-batch, so makespan,
    busy time and peak live activations (constant, or m for GPipe) are linear in m."""
    m = layout.microbatches
    if layout.pipe == 1:  # plain accumulation: one micro-batch after another, one live at a time
        c = costs[(0, 0)]
        per, back = c.forward + c.backward_input + c.backward_weight, c.backward_input + c.backward_weight
        return Sim(m * per, {0: m * per}, 0.0, {0: 1.0}, {0: back})
    m1, m2 = 2 * layout.pipe, 3 * layout.pipe
    if m <= m2:
        return _run(layout, m, costs)
    a, b = _run(layout, m1, costs), _run(layout, m2, costs)
    x = (m - m1) / (m2 - m1)
    line = lambda u, v: u + (v - u) * x  # noqa: E731
    busy = {r: line(a.busy[r], b.busy[r]) for r in a.busy}
    makespan = max(line(a.makespan, b.makespan), *busy.values())  # no rank finishes before its own work
    bubble = 1.0 - sum(busy.values()) / (layout.pipe * makespan)
    return Sim(makespan, busy, bubble, {r: line(a.live[r], b.live[r]) for r in a.live},
               b.last_backward)


def simulate_layout(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, precision: str,
                    d_model: int, seq_len: int, memo: dict | None = None
                    ) -> tuple[Sim, dict[tuple[int, int], range], float]:
    """The simulated schedule of the layout, the layers of each (rank, chunk), the worst rank's TP seconds.

    `memo` (a dict the caller keeps for one model and hardware) shares the simulation between
    layouts that differ only in ZeRO stage or offload, which do not change the schedule.
    """
    key = replace(layout, zero=0, offload=False, reshard=False)
    if memo is not None and key in memo:
        return memo[key]
    placement = schedule_entry(layout.schedule).placement
    held = chunk_layers(profile, layout, placement)
    span = layout.tensor * layout.reducing + 1  # neighbours on the pipe axis are t x s x d ranks apart
    bw, lat = hw.link(span if layout.pipe > 1 else 1)
    p2p = lat + rank_tokens(layout, seq_len) * d_model * bytes_per_element(precision) / bw
    costs, tp = {}, {}
    for k, layers in held.items():
        costs[k], tp[k] = _chunk_costs(profile, layers, layout, hw, precision, d_model, seq_len, p2p)
    tensor_by_rank: dict[int, float] = {}
    for (rank, _), seconds in tp.items():
        tensor_by_rank[rank] = tensor_by_rank.get(rank, 0.0) + seconds
    out = (_extrapolated(layout, costs), held, max(tensor_by_rank.values()))
    if memo is not None:
        memo[key] = out
    return out


def data_parallel_seconds(params: float, layout: Layout, hw: Hardware, precision: str,
                          last_backward: float, compute: float, buckets: int = 1,
                          experts: float = 0.0, gathers: Gathers | None = None) -> tuple[float, float]:
    """(all traffic, exposed part) of one rank's data-parallel collectives per step, in `buckets` pieces each:
    the dense parameters over data x expert x sequence, `experts` (of `params`: the rank's routed experts)
    all-reduced over the ranks holding the same experts (Layout.expert_holders: beside a tensor split at any
    expert degree their sum over the tensor ranks, once a step, pipe/tensor_tokens.py; the router and shared
    experts, small, are counted with the dense parameters). ZeRO-3 moves what `gathers` (zero3.py) counts:
    the schedule's all-gathers, one per layer gathered (the first action's exposed, the rest behind the
    rank's compute), and one reduce-scatter per layer after its last backward (behind the last micro-batch's
    backward); without `gathers`, every parameter gathered once and reduced once."""
    n = layout.reducing
    nbytes = (params - experts) * bytes_per_element(precision)
    bw, lat = hw.link(layout.tensor * n)
    own = ring_seconds(experts * bytes_per_element(precision), layout.expert_holders, bw, lat, 2.0, 1) \
        if experts else 0.0
    if layout.zero == 0:
        reduce, gather = ring_seconds(nbytes, n, bw, lat, 2.0, buckets) + own, 0.0
    elif layout.zero < 3:
        reduce, gather = ring_seconds(nbytes, n, bw, lat, 1.0, buckets) + own, ring_seconds(nbytes, n, bw, lat, 1.0,
                                                                                              buckets)
    else:
        e = bytes_per_element(precision)
        calls = (gathers.calls, gathers.elements * e, gathers.first * e) if gathers else (buckets, nbytes, nbytes)
        whole = ring_seconds(calls[1], n, bw, lat, 1.0, calls[0])
        first = whole * calls[2] / calls[1] if calls[1] else 0.0
        reduce = ring_seconds(nbytes, n, bw, lat, 1.0, gathers.reduce_calls if gathers else buckets) + own
        exposed = first + max(0.0, whole - first - compute) + max(0.0, reduce - last_backward)
        return whole + reduce, exposed
    return reduce + gather, max(0.0, reduce - last_backward) + gather


def buckets(params: float, d_model: int) -> int:
    """Collectives per phase: ZeRO's reduce_bucket_size "auto" is d_model x d_model elements
    (zero/config.py), and the planner's ds_config writes that number."""
    return max(1, math.ceil(params / (d_model * d_model)))


def optimizer_seconds(params: float, layout: Layout, hw: Hardware, precision: str, experts: float = 0.0) -> float:
    """Adam over this rank's shard, on the device or offloaded: under ZeRO 1-3 the dense parameters are
    sharded over data x expert x sequence and `experts` (of `params`) over their own ZeRO group, the ranks
    holding the same experts (Layout.expert_holders; expert_param_groups' zero_group)."""
    sharded = layout.zero >= 1
    shard = (params - experts) / (layout.reducing if sharded else 1) + experts / (layout.expert_holders
                                                                                 if sharded else 1)
    if not layout.offload:
        return shard * hw.optimizer_ns_per_param * 1e-9
    round_trip = 2 * shard * bytes_per_element(precision) / (hw.pcie_gbps * 1e9)
    return shard * hw.cpu_adam_ns_per_param * 1e-9 + round_trip


def step_time(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, precision: str, d_model: int,
              seq_len: int, memo: dict | None = None) -> tuple[TimeBreakdown, Sim, dict[tuple[int, int], range]]:
    """The step time of `layout`, its simulation and the layers each (rank, chunk) holds."""
    result, held, tensor_comm = simulate_layout(profile, layout, hw, precision, d_model, seq_len, memo)
    sequence_comm = _sequence_seconds(profile, held, layout, hw, precision, d_model, seq_len)
    data_comm = exposed = opt = 0.0
    for rank in range(layout.pipe):
        layers = [i for (r, _), rng in held.items() if r == rank for i in rng]
        params, experts = _held(profile, layers, layout)
        last = result.last_backward[rank]
        comm, hidden_not = data_parallel_seconds(params, layout, hw, precision, last, result.busy[rank],
                                                 buckets(params, d_model), experts,
                                                 layout_gathers(profile, layout, held, rank))
        step = optimizer_seconds(params, layout, hw, precision, experts)
        if hidden_not + step > exposed + opt:
            data_comm, exposed, opt = comm, hidden_not, step
    return (TimeBreakdown(compute=max(result.busy.values()), pipeline=result.makespan, tensor_comm=tensor_comm,
                          data_comm=data_comm, exposed_comm=exposed, optimizer=opt, bubble=result.bubble,
                          sequence_comm=sequence_comm, expert_comm=_expert_seconds(profile, held, layout, hw,
                                                                                   precision, d_model, seq_len)),
            result, held)


def _held(profile: Sequence[LayerProfile], layers: Sequence[int], layout: Layout) -> tuple[float, float]:
    """(parameters, of them routed experts) one rank holds."""
    return (held_params(profile, layers, layout.tensor, layout.expert),
            held_experts(profile, layers, layout.tensor, layout.expert))


def _expert_seconds(profile: Sequence[LayerProfile], held: dict[tuple[int, int], range], layout: Layout,
                    hw: Hardware, precision: str, d_model: int, seq_len: int) -> float:
    """The busiest pipeline rank's dispatch and combine seconds per step: 4 per MoE block and micro-batch,
    6 when checkpointed (the recompute's forward exchanges again)."""
    moe = [p for p in profile if p.expert_params]
    if not moe or layout.expert == 1:
        return 0.0
    one = expert_all_to_all_seconds(layout, hw, precision, d_model, seq_len, moe[0].moe_top_k)
    blocks = {rank: 0 for rank, _ in held}
    for (rank, _), layers in held.items():
        blocks[rank] += sum(1 for i in layers if profile[i].expert_params)
    return max(blocks.values()) * (6 if layout.checkpoint else 4) * one * layout.microbatches


def _sequence_seconds(profile: Sequence[LayerProfile], held: dict[tuple[int, int], range], layout: Layout,
                      hw: Hardware, precision: str, d_model: int, seq_len: int) -> float:
    """The busiest pipeline rank's all-to-all seconds per step: 8 per block and micro-batch, 12 when
    checkpointed (the recompute's forward exchanges again)."""
    per_block = (12 if layout.checkpoint else 8) * all_to_all_seconds(layout, hw, precision, d_model, seq_len)
    blocks = {rank: 0 for rank, _ in held}
    for (rank, _), layers in held.items():
        blocks[rank] += sum(1 for i in layers if not profile[i].tied and profile[i].flops > 0)
    return max(blocks.values()) * per_block * layout.microbatches


def step_time_floor(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, precision: str,
                    d_model: int, seq_len: int, memo: dict | None = None) -> float:
    """A lower bound of step_time(...).total, from the per-chunk costs alone (no simulation).

    No schedule finishes before its busiest rank has run every action (makespan >= busy), and
    none hides the parameter all-gather after the step or the optimizer; the floor is that
    busiest rank's compute plus the largest such tail. plan() simulates layouts in the order of
    their floors and stops once a floor exceeds the step time of the table's last row.
    """
    held = chunk_layers(profile, layout, schedule_entry(layout.schedule).placement)
    # predict_fitted may offload or checkpoint fewer layers than the layout (planner.py): the floor takes the
    # fewest, one
    layout = (replace(layout, host_layers=1) if layout.may_offload_fewer else
              replace(layout, checkpoint_layers=1) if layout.may_checkpoint_fewer else layout)
    key = replace(layout, zero=0, offload=False, reshard=False)  # `memo`: the busy part, the same for every ZeRO stage
    busy: dict[int, float] = {} if memo is None or key not in memo else memo[key]
    for (rank, _), layers in held.items() if not busy else ():
        c, _ = _chunk_costs(profile, layers, layout, hw, precision, d_model, seq_len, 0.0)
        busy[rank] = busy.get(rank, 0.0) + layout.microbatches * (c.forward + c.backward_input + c.backward_weight)
    if memo is not None:
        memo[key] = busy
    tail = 0.0
    for rank in range(layout.pipe):
        params, experts = _held(profile, [i for (r, _), rng in held.items() if r == rank for i in rng], layout)
        _, unhidden = data_parallel_seconds(params, layout, hw, precision, float("inf"), float("inf"),
                                            buckets(params, d_model), experts,
                                            layout_gathers(profile, layout, held, rank))
        tail = max(tail, unhidden + optimizer_seconds(params, layout, hw, precision, experts))
    return max(busy.values()) + tail
