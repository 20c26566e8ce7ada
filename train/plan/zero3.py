"""ZeRO-3 as the runtime runs it inside a pipeline: which chunk is whole when, read off the schedule.

What pipezero does (pipe/gathering.py, zero/stage3.py, zero/optimizer.py; counted on CPU with comm's
TRAFFIC, tests/test_zero3_pipe.py):
* every model runs through PipelineRunner, one stage included (the planner's "1f1b" at pipe 1), so
  ZeRO-3 is always driven by the schedule, never by per-layer module hooks: the hooks stand down and
  DeepSpeed's stage3_prefetch_bucket_size / stage3_max_live_parameters do not apply;
* the unit of a gather is a layer (zero/partition.py: one partitioned bucket per block of the
  PipelineModule); its tensors below stage3_param_persistence_threshold stay whole (the planner's
  ds_config leaves DeepSpeed's default, 1e5 elements: PERSISTENCE; norms and biases), never
  gathered (memory.py still counts them at ZeRO-3's 1/N: a large model's are < 0.1% of it); a
  chunk is needed whole while any of its actions runs, so all its layers are gathered before its
  first action of a run, one all-gather each;
* before each action the runner also starts the gathers of the next *other* chunk in the rank's
  action list (the prefetch), so it is whole while the current chunk computes;
* `reshard_after_forward` False (build()'s and the ds_config "pipeline" section's default): a chunk
  stays whole from its first to its last action of the step, one gather per layer and step; True:
  it is freed whenever the next action runs another chunk, so every run of consecutive actions on
  one chunk gathers it again (interleaved 1F1B's and the V schedules' runs alternate chunks, a
  few actions each: measured at pipe 2 x 4 micro-batches, 11 gathers instead of 3 under interleaved
  1F1B, 26 instead of 4 under ZB-V, 30 instead of 4 under DualPipeV). With one or two chunks a rank
  both settings hold every chunk at the peak (the running one and the prefetched other), so
  resharding only pays off from 3 chunks a rank;
* a layer two chunks of one rank share (a tied embedding and head both on rank 0 under the V
  placement) is freed with whichever chunk ends first and gathered again by the other;
  weights tied across pipeline ranks are gathered once at the step's start and stay whole;
* gradients: one reduce-scatter per layer and step, once its last micro-batch's backward is done
  (held whole until then, reduce_every_microbatch off as the planner's ds_config leaves it);
* after the optimizer step nothing is gathered (the next step's first action gathers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Hashable, Mapping, Sequence

from pipezero.pipe.gathering import plan_gathers
from pipezero.pipe.schedule.registry import make_schedule, schedule_entry
from pipezero.train.plan.layout import Layout
from pipezero.train.plan.model import LayerProfile, tied_head

__all__ = ["PERSISTENCE", "Gathers", "layout_gathers", "partitioned", "pipeline_gathers", "rank_gathers"]

_TIED = "tied"  # the key of a tied embedding / head pair, one bucket wherever it sits
PERSISTENCE = 100_000  # stage3_param_persistence_threshold when a ds_config names none (zero/config.py)


@dataclass(frozen=True, slots=True)
class Gathers:
    """One rank's ZeRO-3 parameter traffic and residency in one step, in elements."""

    calls: int            # all-gathers (one per layer gathered)
    elements: float       # elements they make whole
    first: float          # of them, the step's first action's (nothing computes before it: exposed)
    peak: float           # elements whole at once at most (tied weights included)
    reduce_calls: int     # reduce-scatters (one per layer)
    reduce_elements: float


@lru_cache(maxsize=1024)
def _walk(chunks: tuple[int, ...], keys: tuple[tuple[Hashable, ...], ...], reshard: bool,
          tied: tuple[Hashable, ...]) -> tuple[dict, frozenset, frozenset]:
    """(gathers per key, keys gathered for the first action, every set of keys whole at once): the
    runtime's plan walked over keys (a chunk's own layers, each shared layer), sizes left out so that
    one walk serves every layout of the same schedule."""
    plan = plan_gathers(chunks, reshard)
    whole, counts, first, sets = set(tied), dict.fromkeys(tied, 1), frozenset(), set()
    for i, chunk in enumerate(plan.chunks):
        for c in (chunk,) if plan.prefetch[i] is None else (chunk, plan.prefetch[i]):
            for key in keys[c]:
                if key not in whole:
                    whole.add(key)
                    counts[key] = counts.get(key, 0) + 1
        if i == 0:
            first = frozenset(counts)
        sets.add(frozenset(whole))
        for done in plan.release[i]:
            whole.difference_update(k for k in keys[done] if k not in tied)
    return counts, first, frozenset(sets)


def pipeline_gathers(chunks: Sequence[int], layers: Mapping[int, Mapping[Hashable, float]],
                     reshard_after_forward: bool, tied: Mapping[Hashable, float] | None = None) -> Gathers:
    """What one rank's action list gathers, as the runtime plans it (pipe/gathering.py's plan_gathers).

    `chunks`: the chunk of each action in order; `layers`: chunk -> {layer: its elements}, a layer two
    chunks share under the same key; `tied`: layers tied to another pipeline rank (whole all step).
    """
    tied = dict(tied or {})
    seen: dict[Hashable, int] = {}
    for ls in layers.values():
        for k in ls:
            seen[k] = seen.get(k, 0) + 1
    shared = {k for k, n in seen.items() if n > 1} | set(tied)
    size: dict[Hashable, float] = dict(tied)
    count: dict[Hashable, int] = dict.fromkeys(tied, 1)
    keys = []
    for c in range(max(chunks) + 1):  # a chunk's own layers move together: one key for all of them
        own = {k: n for k, n in layers.get(c, {}).items() if k not in shared}
        group = ((("chunk", c),) if own else ()) + tuple(k for k in layers.get(c, {}) if k in shared)
        size |= {k: n for k, n in layers.get(c, {}).items() if k in shared} | ({("chunk", c): sum(own.values())}
                                                                             if own else {})
        count |= dict.fromkeys((k for k in group if k in shared), 1) | ({("chunk", c): len(own)} if own else {})
        keys.append(group)
    counts, first, sets = _walk(tuple(chunks), tuple(keys), reshard_after_forward, tuple(tied))
    used = {k for c in set(chunks) for k in keys[c]} | set(tied)
    return Gathers(sum(n * count[k] for k, n in counts.items()), sum(n * size[k] for k, n in counts.items()),
                   sum(size[k] for k in first), max(sum(size[k] for k in s) for s in sets),
                   sum(count[k] for k in used), sum(size[k] for k in used))


@lru_cache(maxsize=256)
def _actions(schedule: str, microbatches: int, chunks: int | None, pipe: int) -> dict[int, tuple[int, ...]]:
    table = make_schedule(schedule, microbatches, chunks).actions(pipe)
    return {r: tuple(a.chunk for a in acts) for r, acts in table.items()}


def partitioned(p: LayerProfile, tensor: int = 1, expert: int = 1, threshold: int = PERSISTENCE) -> float:
    """Elements of one layer that ZeRO-3 partitions on a rank: its tensors (each tensor rank's part) of at
    least `threshold` elements, and its routed experts."""
    split = 1 if p.tied else tensor
    dense = p.tensors or (p.params - p.expert_params,)
    return sum(t / split for t in dense if t / split >= threshold) + p.expert_params / expert


def rank_gathers(profile: Sequence[LayerProfile], chunk_layers: Mapping[int, Sequence[int]], rank: int,
                 schedule: str, pipe: int, microbatches: int, chunks: int, tensor: int = 1, expert: int = 1,
                 reshard_after_forward: bool = False) -> Gathers:
    """pipeline_gathers of one planner rank: its chunks' layers (chunk -> layer indices), each layer one
    bucket of its partitioned elements; a tied embedding / head is one bucket on a rank holding both, and
    gathered once for the whole step on a rank holding one of them beside another pipeline rank."""
    layers = {c: list(ls) for c, ls in chunk_layers.items()}
    mine = [i for ls in layers.values() for i in ls]
    pair = tied_head(profile) and {profile[i].kind for i in mine} >= {"Embedding", "Head"}
    tied_here = tied_head(profile) and pipe > 1 and not pair
    embedding = [i for i in mine if profile[i].kind == "Embedding"]
    shared = sum(partitioned(profile[i], tensor, expert) for i in embedding[:1])  # the pair's: the embedding's
    tied: dict[Hashable, float] = {}
    keyed: dict[int, dict[Hashable, float]] = {}
    for c, ls in layers.items():
        keyed[c] = {}
        for i in ls:
            n = partitioned(profile[i], tensor, expert)
            if profile[i].kind in ("Embedding", "Head") and profile[i].tied and tied_here:
                tied[_TIED] = n
            elif profile[i].kind in ("Embedding", "Head") and profile[i].tied and pair:
                keyed[c][_TIED] = shared
            elif n:
                keyed[c][i] = n
    variable = schedule_entry(schedule).variable_chunks

    def at(m: int) -> Gathers:
        order = _actions(schedule, m, chunks if variable else None, pipe)[rank] if pipe > 1 else \
            (0,) * (2 * m)  # one stage: plain accumulation, one chunk
        return pipeline_gathers(order, keyed, reshard_after_forward, tied)
    m1, m2 = 2 * pipe, 3 * pipe
    if microbatches <= m2:
        return at(microbatches)
    # past a few times the stages every schedule repeats one period per micro-batch (as step_time's
    # _extrapolated): the gathers grow linearly, what is whole at once does not change
    a, b = at(m1), at(m2)
    x = (microbatches - m1) / (m2 - m1)
    return replace(b, calls=round(a.calls + (b.calls - a.calls) * x),
                   elements=a.elements + (b.elements - a.elements) * x)


def layout_gathers(profile: Sequence[LayerProfile], layout: Layout, held: Mapping[tuple[int, int], Sequence[int]],
                   rank: int) -> Gathers | None:
    """rank_gathers of one rank of a planner layout (`held`: step_time.chunk_layers'), None below ZeRO 3."""
    if layout.zero != 3:
        return None
    mine = {c: layers for (r, c), layers in held.items() if r == rank}
    key = (id(profile), rank, tuple(sorted((c, tuple(ls)) for c, ls in mine.items())), layout.schedule, layout.pipe,
           layout.microbatches, layout.chunks, layout.tensor, layout.expert, layout.reshard)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    out = rank_gathers(profile, mine, rank, layout.schedule, layout.pipe, layout.microbatches, layout.chunks,
                       layout.tensor, layout.expert, layout.reshard)
    if len(_MEMO) > 1 << 16:
        _MEMO.clear()
    _MEMO[key] = (profile, out)
    return out


# layout_gathers' answers by profile and rank: the planner asks for the same rank under every ZeRO-3 variant
_MEMO: dict[tuple, tuple[Sequence[LayerProfile], Gathers]] = {}
