"""The vocabulary of schedules: an operation, a chunk and a microbatch.

A schedule is data: for each pipeline rank an ordered list of Actions. Nothing here
touches torch.distributed; the validator, the simulator and the executor all read it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["Op", "Action", "ActionTable", "PipelineSchedule", "Schedule"]


class Op(enum.Enum):
    """What one action does."""

    FORWARD = "F"
    BACKWARD = "B"          # input and weight gradients together
    BACKWARD_INPUT = "I"    # zero-bubble: input gradient only (unblocks the previous stage)
    BACKWARD_WEIGHT = "W"   # zero-bubble: the deferred weight gradient


class Action(NamedTuple):
    """One step of one rank: `op` on virtual `chunk` for `microbatch`."""

    op: Op
    chunk: int
    microbatch: int

    def __str__(self) -> str:  # torch-style cell: "0F3" = chunk 0, forward, microbatch 3
        return f"{self.chunk}{self.op.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read a cell such as "0F3" or "1W0" (chunk, op letter, microbatch)."""
        for op in Op:
            head, sep, tail = text.strip().partition(op.value)
            if sep and head.isdigit() and tail.isdigit():
                return cls(op, int(head), int(tail))
        raise ValueError(f"cannot read action {text!r}: expected <chunk><F|B|I|W><microbatch>, e.g. '0F3'")


ActionTable = dict[int, list[Action]]  # pipeline rank -> its ordered actions
Schedule = ActionTable  # the table's name before a schedule object had its own (kept for imports)


@runtime_checkable
class PipelineSchedule(Protocol):
    """What the runner, the validator and the simulator read from a schedule object.

    pipe/schedule/schedules.py's classes are schedules; so is any user object with these four members
    (tests/test_pipe_runner.py's HandGPipe). `placement` is "looped" or "v" (pipe/schedule/placement.py).
    """

    num_microbatches: int
    num_chunks: int
    placement: str

    def actions(self, num_stages: int) -> ActionTable:
        """Every rank's ordered actions for a pipeline of `num_stages` ranks (pure data)."""
        ...
