"""Simulate a schedule with per-action costs: timeline, makespan, bubble, peak activations.

Event-driven, in-order execution: every rank runs its list in order; an action starts when
its rank is free and every input it needs has finished (plus `p2p` latency when the input
comes from another rank; sends never block).  Costs are per action, i.e. per chunk: to
compare an interleaved schedule with v chunks against a one-chunk one at equal model size,
give it costs 1/v as large (the bubble *fraction* does not change when every cost is
scaled by the same factor and p2p = 0).

Definitions:

* bubble = idle / (num_stages * makespan), idle = num_stages * makespan - total busy time;
  every rank is counted from time 0 to the makespan.
* live activations: the activations of (chunk, microbatch) on a rank are live from the
  start of its F until the end of its B, or until the end of its W when the backward is
  split (the weight gradient still needs the layer inputs).  `peak_activations[rank]` is
  the largest number of live (chunk, microbatch) pairs; divide by num_chunks
  (`peak_stage_activations`) for units of one whole stage's microbatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

from pipezero.checks import is_number
from pipezero.pipe.schedule.actions import Action, Op
from pipezero.pipe.schedule.validate import check_static, execute, raise_deadlock

__all__ = ["Costs", "Event", "SimResult", "simulate", "idle_fraction"]


@dataclass(frozen=True)
class Costs:
    """Time of one action of one chunk; B (unsplit) costs backward_input + backward_weight."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0  # latency added when an input comes from another rank

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "p2p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Costs.{name}={value!r} must be a number")
            if not is_number(value, minimum=0):  # NaN, inf or negative
                raise ValueError(f"Costs.{name}={value!r} must be a finite number >= 0")

    def of(self, op: Op) -> float:
        """The duration of one action of kind `op`."""
        if op is Op.FORWARD:
            return float(self.forward)
        if op is Op.BACKWARD_INPUT:
            return float(self.backward_input)
        if op is Op.BACKWARD_WEIGHT:
            return float(self.backward_weight)
        return float(self.backward_input + self.backward_weight)


class Event(NamedTuple):
    """One action as simulated: `step` is its index in the rank's list."""

    rank: int
    step: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What simulate() found; see the module docstring for the definitions."""

    timeline: list[Event]          # sorted by (start, rank)
    makespan: float
    busy: dict[int, float]         # rank -> total busy time
    bubble: float                  # idle / (num_stages * makespan)
    peak_activations: dict[int, int]  # rank -> most live (chunk, microbatch) pairs
    num_stages: int
    num_chunks: int

    @property
    def idle(self) -> float:
        """Total idle time of all ranks between 0 and the makespan."""
        return self.num_stages * self.makespan - sum(self.busy.values())

    def peak_stage_activations(self) -> dict[int, float]:
        """peak_activations in units of one whole stage's microbatch (pairs / num_chunks)."""
        return {r: n / self.num_chunks for r, n in self.peak_activations.items()}

    def summary(self) -> dict[str, Any]:
        """Plain numbers, e.g. for logging next to a measured step."""
        return {"makespan": self.makespan, "bubble": self.bubble,
                "peak_activations": dict(self.peak_activations)}


def idle_fraction(busy: Iterable[float], span: float) -> float:
    """The bubble: idle / (ranks x span) = 1 - sum(busy) / (ranks x span), for each rank's busy time.

    The one definition the simulator, the runner's measured timeline and the training metrics share.
    """
    busy = list(busy)
    return 1.0 - sum(busy) / (len(busy) * span) if span > 0 and busy else 0.0


def simulate(actions: Any, num_stages: int | None = None,
             costs: Costs | Mapping[tuple[int, int], Costs] = Costs(),
             placement: Any = "looped", *, channels: str = "kind",
             sends: str = "async") -> SimResult:
    """Validate, then simulate `actions` (a dict rank -> list of Action, or a schedule).

    `placement` is "looped", "v" or a schedule object; a schedule passed as `actions`
    supplies its own placement (and needs num_stages). `channels` and `sends` describe
    the executor as in validate(); "blocking" sends also delay the timeline. `costs` is one
    Costs for every action, or a dict (rank, chunk) -> Costs (e.g. measured on a real step,
    where the stage holding the embedding or the loss costs more than the others).
    """
    table, name = check_static(actions, num_stages, placement, None, channels, sends)
    cost_of, p2p = _cost_table(costs, table)
    events, stuck = execute(table, name, lambda r, a: cost_of[(r, a.chunk)].of(a.op), p2p,
                            blocking_sends=sends == "blocking")
    if stuck:  # whether a rank gets stuck does not depend on the costs
        raise_deadlock(table, name, stuck, sends)
    timeline = sorted((Event(*e) for e in events), key=lambda e: (e.start, e.rank))
    makespan = max((e.end for e in timeline), default=0.0)
    p = len(table)
    busy = {r: 0.0 for r in range(p)}
    for e in timeline:
        busy[e.rank] += e.end - e.start
    return SimResult(
        timeline=timeline, makespan=makespan, busy=busy, bubble=idle_fraction(busy.values(), makespan),
        peak_activations={r: _peak_live(acts) for r, acts in table.items()},
        num_stages=p,
        num_chunks=1 + max(a.chunk for acts in table.values() for a in acts))


def _cost_table(costs: Costs | Mapping[tuple[int, int], Costs], table: dict[int, list[Action]]
                ) -> tuple[dict[tuple[int, int], Costs], float]:
    """(rank, chunk) -> Costs for every chunk the actions use, and the p2p latency (one for all)."""
    used = {(r, a.chunk) for r, acts in table.items() for a in acts}
    if isinstance(costs, Costs):
        return {key: costs for key in used}, float(costs.p2p)
    if not isinstance(costs, Mapping) or not all(isinstance(c, Costs) for c in costs.values()):
        raise TypeError(f"costs must be a Costs(...) or a dict (rank, chunk) -> Costs, got {type(costs).__name__}")
    missing = sorted(used - set(costs))
    if missing:
        raise ValueError(f"costs has no entry for (rank, chunk) {missing}; give every chunk of every rank a Costs")
    p2ps = {float(c.p2p) for key, c in costs.items() if key in used}
    if len(p2ps) > 1:
        raise ValueError(f"per-chunk costs disagree on p2p latency {sorted(p2ps)}; give them all the same p2p")
    return dict(costs), p2ps.pop() if p2ps else 0.0


def _peak_live(acts: list[Action]) -> int:
    """Most (chunk, microbatch) activations live at once on one rank (in-order execution)."""
    live = peak = 0
    for a in acts:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):  # validated: W only when split
            live -= 1
    return peak
