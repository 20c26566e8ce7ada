"""The executor's plan of one rank: each action with the messages it receives and sends.

Built once, when the runner is made, from the validated schedule and validate's transfer
table (pipe/schedule/validate.py), so the runner and the validator cannot disagree about who sends
what. Messages between two ranks are received in the order they were sent (nccl matches
point-to-point operations by order), so an action that needs a message first receives every
earlier message of that sender it has not received yet, and the runner keeps those until
their action runs (ZeroBubbleV needs this). The plan also says after which action each
parameter's gradient is final: the optimizer may start reducing it then.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from pipezero.pipe.schedule.actions import Action, Op, PipelineSchedule
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.schedule.placement import virtual_stage
from pipezero.pipe.schedule.validate import Move, Transfer, channel_order, transfer_table, validate

__all__ = ["Message", "Step", "StepPlan", "plan_steps"]


class Message(NamedTuple):
    """What one virtual stage hands the next for one microbatch: its output activation
    (forward) or its input gradient (backward). Keys what the runner keeps between actions."""

    kind: str        # "activation" or "gradient", as validate.Transfer
    stage: int       # the virtual stage that produced it
    microbatch: int

    @classmethod
    def of(cls, t: Transfer) -> Message:
        return cls(t.kind, t.src_stage, t.microbatch)

    @property
    def stream(self) -> str:
        """The p2p stream key, one per kind and producing stage ("a3", "g4"): its metadata
        travels once."""
        return f"{self.kind[0]}{self.stage}"


class Step(NamedTuple):
    """One action of this rank with its transfers (None and (): the peer stage is local)."""

    action: Action
    stage: int                        # virtual stage of the action's chunk
    send: Transfer | None             # what the action sends to another rank after it runs
    recvs: tuple[Transfer, ...] = ()  # what to receive before it, in each sender's order


class StepPlan(NamedTuple):
    """One rank's steps for a training step and for a forward-only step."""

    train: list[Step]
    forward: list[Step]
    last_weight_use: dict[int, list]  # train step index -> parameters whose gradient is final after it


def plan_steps(schedule: PipelineSchedule, model: PipelineModule) -> StepPlan:
    """Check and validate `schedule` for `model`, then plan this rank's steps.

    Pure (no process group), so a bad schedule raises the same error on every rank.
    """
    _check_schedule(schedule, model)
    table = validate(schedule, model.num_stages, num_microbatches=schedule.num_microbatches)
    used = 1 + max(a.chunk for acts in table.values() for a in acts)
    if used != model.num_chunks:
        raise ValueError(f"{type(schedule).__name__}.actions uses chunks 0..{used - 1} but "
                         f"PipelineModule(num_chunks={model.num_chunks}); make them equal")
    moves = transfer_table(table, model.placement)  # every message of the schedule, computed once
    rows = {r: list(zip(table[r], moves[r])) for r in table}
    forward = {r: [(a, move) for a, move in row if a.op is Op.FORWARD] for r, row in rows.items()}
    train = _rank_steps(rows, model)
    return StepPlan(train, _rank_steps(forward, model), _last_weight_use(train, model))


def _check_schedule(schedule: PipelineSchedule, model: PipelineModule) -> None:
    if not isinstance(model, PipelineModule):
        raise TypeError(f"PipelineRunner(model={type(model).__name__}): expected a PipelineModule")
    if not isinstance(schedule, PipelineSchedule):
        missing = [m for m in ("num_microbatches", "num_chunks", "placement", "actions") if not hasattr(schedule, m)]
        raise TypeError(f"PipelineRunner: schedule {schedule!r} has no {missing}; expected a PipelineSchedule "
                        "(pipe/schedule/actions.py): an object with num_microbatches, num_chunks, placement and "
                        "actions(num_stages)")
    m = schedule.num_microbatches
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"schedule.num_microbatches={m!r}: expected a positive integer")
    if schedule.num_chunks != model.num_chunks:
        raise ValueError(f"{type(schedule).__name__} runs {schedule.num_chunks} chunks per rank but "
                         f"PipelineModule(num_chunks={model.num_chunks}); make them equal")
    if schedule.placement != model.placement:
        raise ValueError(f"{type(schedule).__name__} places chunks {schedule.placement!r} but "
                         f"PipelineModule(placement={model.placement!r}); make them equal")


def _rank_steps(rows: dict[int, list[tuple[Action, Move]]], model: PipelineModule) -> list[Step]:
    """This rank's steps; `rows`: every rank's actions with their (receive, send)."""
    rank = model.grid.pipe_rank
    sent, _ = channel_order({r: [move for _, move in row] for r, row in rows.items()}, "pair")
    taken: dict[int, int] = {}  # sender -> how many of its messages to this rank are received
    steps = []
    for action, (recv, send) in rows[rank]:
        stage = virtual_stage(rank, action.chunk, model.num_stages, model.placement)
        recvs = _receive_up_to(recv, [t for t, _ in sent.get((recv.src, rank), [])], taken) if recv else ()
        steps.append(Step(action, stage, send, recvs))
    return steps


def _receive_up_to(want: Transfer, seq: list[Transfer], taken: dict[int, int]) -> tuple[Transfer, ...]:
    """The messages to receive for `want`: those of its sender up to it not received yet."""
    start = taken.get(want.src, 0)
    if want in seq[:start]:
        return ()  # arrived with an earlier action's receives
    end = seq.index(want, start) + 1  # validate() guarantees the sender sends it
    taken[want.src] = end
    return tuple(seq[start:end])


def _last_weight_use(steps: Sequence[Step], model: PipelineModule) -> dict[int, list]:
    """Step index -> the (untied) parameters whose last gradient contribution that step makes.

    A parameter's gradient is final after the last B (or W, when backward is split) of the
    last chunk using it; that is when the optimizer may start reducing it.
    """
    weight_ops = (Op.BACKWARD, Op.BACKWARD_WEIGHT)
    last_of_chunk = {s.action.chunk: i for i, s in enumerate(steps) if s.action.op in weight_ops}
    tied = {id(t) for t in model.tied_parameters()}
    final: dict[int, tuple[int, Any]] = {}
    for chunk, index in last_of_chunk.items():
        for param in model.chunk_parameters(chunk):
            if id(param) not in tied and index >= final.get(id(param), (-1, None))[0]:
                final[id(param)] = (index, param)
    out: dict[int, list] = {}
    for index, param in final.values():
        out.setdefault(index, []).append(param)
    return out
