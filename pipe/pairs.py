"""Which of a rank's steps run as a pair: a forward beside another microbatch's backward, overlapped.

DualPipeV lists its steady state as pairs, the forward of one chunk beside the backward of the
other, of different microbatches (DeepSeek-V3 technical report, 2024: DualPipe). Under
`PipelineRunner(overlap_pairs=True)` the runner runs such a pair through a relay
(pipe/expert/relay.py): the two take turns at each expert all-to-all launch, so one microbatch's
rows travel while the other's layers compute. The pair's receives are posted before it and its
sends after it: the forward's output leaves only once the backward is done, and the backward's
input must have arrived before the forward starts. Whether every rank's list still runs so is
decided here, once, from the schedule alone (pure, the same answer on every rank): the schedule
executor's model (pipe/schedule/validate.py's `execute`, buffered sends) runs with each pair
merged into one action; when the merged table deadlocks, pairs are kept one by one, in rank and
step order, each only if the table still runs with it. A pair left out runs as two steps, as
without the option. A rank may pair fewer than planned (a rank without experts pairs none):
fewer merged actions only start things earlier, so the table still runs. Under ZeRO-3 both steps'
chunks are gathered before the pair and released after it (with reshard_after_forward, two chunks
whole at once where the steps alone would hold one and prefetch the other).

Candidates: an F directly followed by a B or an I (a split backward's input half; its W stays on its
own) of another (chunk, microbatch). So DualPipeV pairs its steady state, and the other schedules
where they list such neighbours: 1F1B's steady F(i + k) | B(i) on every rank but the last (whose F
and B of one microbatch depend on each other), ZB-V's F | I of its steady state (Megatron-core
overlaps 1F1B's neighbours so, its "combined 1F1B"). The two sides of a same-chunk pair use the same
layers in turns; what they must not share is swapped by the relay (pipe/expert/relay.py).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import torch.distributed as dist

from pipezero.pipe.expert.block import ExpertParallel
from pipezero.pipe.schedule.actions import Action, Op, PipelineSchedule
from pipezero.pipe.schedule.validate import execute, normalize

__all__ = ["candidate_pairs", "expert_chunks", "plan_pairs", "schedule_pairs"]


def candidate_pairs(table: Mapping[int, list[Action]]) -> dict[int, list[int]]:
    """rank -> the steps k whose action is an F and whose next one is a B or I of another (chunk, microbatch)."""
    backwards = (Op.BACKWARD, Op.BACKWARD_INPUT)
    return {r: [k for k in range(len(acts) - 1) if acts[k].op is Op.FORWARD and acts[k + 1].op in backwards
                and acts[k + 1][1:] != acts[k][1:]] for r, acts in table.items()}


def plan_pairs(table: dict[int, list[Action]], placement: str) -> dict[int, tuple[int, ...]]:
    """rank -> the steps k run as one pair with step k + 1 (every candidate when the table still runs with
    all of them merged; else those kept one by one)."""
    candidates = candidate_pairs(table)
    if _runs(table, placement, candidates):
        return {r: tuple(ks) for r, ks in candidates.items()}
    kept: dict[int, list[int]] = {r: [] for r in table}
    for r, ks in candidates.items():
        for k in ks:
            kept[r].append(k)
            if not _runs(table, placement, kept):
                kept[r].pop()
    return {r: tuple(ks) for r, ks in kept.items()}


def schedule_pairs(schedule: PipelineSchedule, num_stages: int) -> dict[int, tuple[int, ...]]:
    """plan_pairs of a schedule's table (already validated by the runner's plan)."""
    return plan_pairs(normalize(schedule, num_stages), schedule.placement)


def _runs(table: dict[int, list[Action]], placement: str, together: Mapping[int, Collection[int]]) -> bool:
    _, stuck = execute(table, placement, lambda r, a: 1.0, 0.0, together=together)
    return not stuck


def expert_chunks(model: Any) -> set[int]:
    """The local chunks holding an expert-parallel layer over a group of more than one rank: only there
    does an all-to-all travel that a pair can hide."""
    split = {id(p) for m in model.modules() if isinstance(m, ExpertParallel) and dist.get_world_size(m.group) > 1
             for p in m.parameters()}
    return {c for c in range(model.num_chunks) if any(id(p) in split for p in model.chunk_parameters(c))}
