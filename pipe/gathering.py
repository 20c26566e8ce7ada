"""When each chunk's parameters are needed, read off the schedule (ZeRO-3 under the pipeline).

A stage-3 optimizer keeps parameters partitioned over the data group; a chunk needs them
whole while any of its actions (F, B, I, W) runs. The schedule is data, so the runner knows
every action before the step starts and tells its listener (pipe/readiness.py): a chunk is
needed before its first action, the next other chunk is named as `upcoming` (its all-gathers
may overlap the running chunk's compute), and the runner is done with a chunk after its last
action of the step (its gradients are final then). How to gather and release (buckets, tied
weights kept whole through the step) is the listener's: zero/ implements it.

`reshard_after_forward` (FSDP's knob of the same name, Zhao et al. 2023, "PyTorch FSDP"):
False keeps a chunk needed from its first to its last action of the step (one all-gather per
chunk and step); True also says it is done with a chunk whenever the next action runs another
chunk, and needs it again for its next action (less memory held with several chunks per
rank, more traffic). With one chunk per rank both are the same: every action runs that chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pipezero.pipe.readiness import StepListener

__all__ = ["GatherPlan", "ChunkGathering", "chunk_gatherings", "plan_gathers"]


@dataclass(frozen=True)
class GatherPlan:
    """Per step of a rank's action list: what to prefetch once it runs and what to release after."""

    chunks: tuple[int, ...]                    # the chunk each step runs
    prefetch: tuple[int | None, ...]           # the next other chunk to run, gathered early
    release: tuple[tuple[int, ...], ...]       # chunks released after the step


def plan_gathers(chunks: Sequence[int], reshard_after_forward: bool) -> GatherPlan:
    """The gather/release plan of one rank's ordered chunk sequence (a pure function)."""
    last = {c: i for i, c in enumerate(chunks)}
    prefetch: list[int | None] = [None] * len(chunks)
    for i in range(len(chunks) - 2, -1, -1):  # the first other chunk after i, in one pass from the end
        prefetch[i] = chunks[i + 1] if chunks[i + 1] != chunks[i] else prefetch[i + 1]
    release = []
    for i, c in enumerate(chunks):
        switch = i + 1 < len(chunks) and chunks[i + 1] != c
        release.append((c,) if last[c] == i or (reshard_after_forward and switch) else ())
    return GatherPlan(tuple(chunks), tuple(prefetch), tuple(release))


class ChunkGathering:
    """Turns one action list's GatherPlan into need_params / done_with_params events.

    Tied weights shared with other pipeline ranks are never announced as done here: their
    gradients are summed after the last action, and the listener keeps them whole until
    step_done (they were named in hold_grad_sync).
    """

    def __init__(self, listener: StepListener, chunk_params: Sequence[list], tied: list,
                 chunks: Sequence[int], reshard_after_forward: bool):
        self.listener = listener
        tied_ids = {id(p) for p in tied}
        self.params = [list(ps) for ps in chunk_params]
        self.untied = [[p for p in ps if id(p) not in tied_ids] for ps in chunk_params]
        self.plan = plan_gathers(chunks, reshard_after_forward)

    def before(self, i: int) -> None:
        """Step i's chunk needed now, the next other chunk soon."""
        nxt = self.plan.prefetch[i]
        self.listener.need_params(self.params[self.plan.chunks[i]], self.params[nxt] if nxt is not None else ())

    def after(self, i: int) -> None:
        for c in self.plan.release[i]:
            self.listener.done_with_params(self.untied[c])


def chunk_gatherings(listener: StepListener, model: Any, chunk_lists: dict[bool, Sequence[int]],
                     reshard_after_forward: bool) -> dict[bool, ChunkGathering]:
    """train / eval -> the need/done events of its action list (chunks in order)."""
    params = [model.chunk_parameters(c) for c in range(model.num_chunks)]
    tied = model.tied_parameters()
    return {key: ChunkGathering(listener, params, tied, chunks, reshard_after_forward)
            for key, chunks in chunk_lists.items()}
