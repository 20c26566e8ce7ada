"""ZeRO-3 under the pipeline: when each chunk's parameters are whole, read off the schedule.

A stage-3 optimizer keeps parameters partitioned over the data group; a chunk needs them
whole while any of its actions (F, B, I, W) runs. The schedule is data, so the runner knows
every action before the step starts: a chunk is gathered before its first action, the next
chunk's all-gathers start as soon as the running chunk is whole (they overlap its compute),
and a chunk is released after its last action of the step (its gradients are final then).

`reshard_after_forward` (FSDP's knob of the same name, Zhao et al. 2023, "PyTorch FSDP"):
False keeps a chunk whole from its first to its last action of the step (one all-gather per
chunk and step); True also frees it whenever the next action runs another chunk, and gathers
it again for its next action (less memory held with several chunks per rank, more traffic).
With one chunk per rank both are the same: every action runs that chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from pipezero.pipe.readiness import find_link

__all__ = ["GatherPlan", "ChunkGathering", "NoGathering", "ParamGathering", "chunk_gatherings", "plan_gathers"]


@runtime_checkable
class ParamGathering(Protocol):
    """What the runner needs from an optimizer that partitions parameters (ZeRO-3)."""

    def drive_param_gathering(self) -> bool:
        """The caller gathers and releases from now on; False: nothing is partitioned."""

    def gather_params(self, params: Iterable[torch.Tensor], wait: bool = True) -> None:
        """Make the parameters whole (wait=False: only start the all-gathers)."""

    def release_params(self, params: Iterable[torch.Tensor]) -> None:
        """Partition the parameters again."""


@dataclass(frozen=True)
class GatherPlan:
    """Per step of a rank's action list: what to prefetch once it runs and what to release after."""

    chunks: tuple[int, ...]                    # the chunk each step runs
    prefetch: tuple[int | None, ...]           # the next other chunk to run, gathered early
    release: tuple[tuple[int, ...], ...]       # chunks released after the step


def plan_gathers(chunks: Sequence[int], reshard_after_forward: bool) -> GatherPlan:
    """The gather/release plan of one rank's ordered chunk sequence (a pure function)."""
    last = {c: i for i, c in enumerate(chunks)}
    prefetch, release = [], []
    for i, c in enumerate(chunks):
        prefetch.append(next((d for d in chunks[i + 1:] if d != c), None))
        switch = i + 1 < len(chunks) and chunks[i + 1] != c
        release.append((c,) if last[c] == i or (reshard_after_forward and switch) else ())
    return GatherPlan(tuple(chunks), tuple(prefetch), tuple(release))


class ChunkGathering:
    """Drives a ParamGathering optimizer through one action list of a PipelineModule.

    Tied weights shared with other pipeline ranks are gathered once for the whole step
    (`gather_tied`), before the model swaps in stand-ins that view their storage, and
    released after their gradients were summed over the tie group (`release_tied`).
    """

    def __init__(self, optimizer: ParamGathering, chunk_params: Sequence[list], tied: list,
                 chunks: Sequence[int], reshard_after_forward: bool):
        self.optimizer, self.tied = optimizer, tied
        tied_ids = {id(p) for p in tied}
        self.params = [list(ps) for ps in chunk_params]
        self.untied = [[p for p in ps if id(p) not in tied_ids] for ps in chunk_params]
        self.plan = plan_gathers(chunks, reshard_after_forward)

    def before(self, i: int) -> None:
        """Step i's chunk whole (waits for its gathers), then the next chunk's gathers started."""
        self.optimizer.gather_params(self.params[self.plan.chunks[i]])
        nxt = self.plan.prefetch[i]
        if nxt is not None:
            self.optimizer.gather_params(self.params[nxt], wait=False)

    def after(self, i: int) -> None:
        for c in self.plan.release[i]:
            self.optimizer.release_params(self.untied[c])

    def gather_tied(self) -> None:
        self.optimizer.gather_params(self.tied)

    def release_tied(self) -> None:
        self.optimizer.release_params(self.tied)

    def release_all(self) -> None:
        """Everything partitioned again (after a failure, or an eval step)."""
        self.optimizer.release_params([p for ps in self.params for p in ps])


class NoGathering:
    """Nothing is partitioned (stages 0-2, or no ZeRO): every call is a no-op."""

    def before(self, i: int) -> None: ...
    def after(self, i: int) -> None: ...
    def gather_tied(self) -> None: ...
    def release_tied(self) -> None: ...
    def release_all(self) -> None: ...


def chunk_gatherings(optimizer: Any, model: Any, chunk_lists: dict[bool, Sequence[int]],
                     reshard_after_forward: bool) -> dict[bool, ChunkGathering | NoGathering]:
    """train / eval -> the gatherer of its action list (chunks in order); NoGathering when the
    optimizer partitions no parameters. Takes the gathering over from the optimizer."""
    optimizer = find_link(optimizer, ParamGathering)  # anywhere in the chain, as readiness is
    if optimizer is None or not optimizer.drive_param_gathering():
        return {key: NoGathering() for key in chunk_lists}
    params = [model.chunk_parameters(c) for c in range(model.num_chunks)]
    tied = model.tied_parameters()
    return {key: ChunkGathering(optimizer, params, tied, chunks, reshard_after_forward)
            for key, chunks in chunk_lists.items()}
