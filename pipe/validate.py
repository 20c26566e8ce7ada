"""Check a schedule before anything runs it: coverage, dependencies, stream order, deadlock.

A schedule is data (rank -> ordered list of Actions), so every mistake in it can be found
without a process group.  The rules, for virtual stage s of S = num_stages * num_chunks
(where each virtual stage lives is given by the placement, see placement.py):

* F of stage s for microbatch i needs F of stage s-1 for i (received from its rank);
* B or I of stage s for i needs its own F for i, and the backward (B or I) of stage s+1
  for i; the last virtual stage's backward needs only its own F;
* W of stage s for i needs its own I for i;
* every rank runs, for each of its chunks and each microbatch, one F and either one B or
  one I and one W, and nothing twice;
* between two virtual stages on different ranks, the receiver takes the activations
  (gradients) in the order the sender sends them: the executor keeps one ordered stream per
  stage boundary and direction;
* run in order on every rank, with sends that never block and receives that wait for their
  data, the schedule finishes (no deadlock).

A failure raises ScheduleError with the step x rank grid (step = position in the rank's
list) and the offending cells in brackets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipezero.pipe.actions import Action, Op
from pipezero.pipe.placement import PLACEMENTS, owner, virtual_stage
from pipezero.pipe.render import to_text

__all__ = ["ScheduleError", "validate"]

_BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)
Key = tuple[int, Action]  # (rank, action): one action of the whole schedule


class ScheduleError(ValueError):
    """A schedule that cannot run; the message holds the step x rank grid, bad cells marked."""

    def __init__(self, reason: str, actions: Mapping[int, Sequence[Action]],
                 marks: Sequence[tuple[int, int]] = ()) -> None:
        self.reason = reason
        self.marks = list(marks)
        grid = to_text(actions, mark=self.marks) if actions else "(no actions)"
        super().__init__(f"{reason}\n{grid}")


def resolve_placement(placement: Any) -> str:
    """A placement name from a name or from anything with a `.placement` (a schedule)."""
    name = getattr(placement, "placement", placement)
    if name not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS} "
                         f"(or a schedule object with a .placement attribute)")
    return name


def normalize(actions: Any, num_stages: int | None = None) -> dict[int, list[Action]]:
    """Check the container (a dict rank -> list of Action, or a schedule) and copy it.

    A schedule object (anything with an `actions(num_stages)` method) is expanded first.
    """
    if callable(getattr(actions, "actions", None)):
        if num_stages is None:
            raise ValueError(f"{actions!r} is a schedule: pass num_stages to expand it")
        actions = actions.actions(num_stages)
    if not isinstance(actions, Mapping):
        raise TypeError(f"actions must be a dict rank -> list of Action, got {type(actions).__name__}")
    p = len(actions) if num_stages is None else num_stages
    if sorted(actions) != list(range(p)):
        raise ValueError(f"actions has ranks {sorted(actions)}, expected exactly 0..{p - 1} "
                         f"for num_stages={p}")
    table = {r: list(actions[r]) for r in range(p)}
    for r, acts in table.items():
        for step, a in enumerate(acts):
            if not isinstance(a, Action):
                raise TypeError(f"rank {r} step {step} holds {a!r}, not an Action "
                                f"(write Action.parse('0F3') or Action(Op.FORWARD, 0, 3))")
            if a.chunk < 0 or a.microbatch < 0:
                raise ScheduleError(f"rank {r} step {step}: {a} has a negative chunk or "
                                    f"microbatch", table, [(r, step)])
    return table


def validate(actions: Any, num_stages: int | None = None, placement: Any = "looped",
             num_microbatches: int | None = None) -> dict[int, list[Action]]:
    """Raise ScheduleError unless `actions` can run; return the checked table.

    `placement` is "looped", "v" or a schedule object (its `.placement` is used); when
    `actions` is itself a schedule object its placement wins. `num_microbatches`, when
    given, must match the microbatches the actions cover.
    """
    if callable(getattr(actions, "actions", None)):
        placement = actions
    name = resolve_placement(placement)
    table = normalize(actions, num_stages)
    p = len(table)
    v, m = _shape(table, num_microbatches)
    _check_coverage(table, v, m)
    _check_local_order(table)
    _check_streams(table, p, name)
    _, stuck = execute(table, name, lambda a: 1.0, 0.0)
    if stuck:
        _raise_deadlock(table, name, stuck)
    return table


def _shape(table: dict[int, list[Action]], num_microbatches: int | None) -> tuple[int, int]:
    """(num_chunks, num_microbatches) the actions use."""
    everything = [a for acts in table.values() for a in acts]
    if not everything:
        raise ScheduleError("the schedule has no actions", table)
    v = 1 + max(a.chunk for a in everything)
    m = 1 + max(a.microbatch for a in everything)
    if num_microbatches is not None and num_microbatches != m:
        raise ScheduleError(f"num_microbatches={num_microbatches} but the actions cover "
                            f"microbatches 0..{m - 1}", table)
    return v, m


def _check_coverage(table: dict[int, list[Action]], v: int, m: int) -> None:
    """Nothing twice; one F and one B (or I and W) per (rank, chunk, microbatch)."""
    for r, acts in table.items():
        where: dict[Action, int] = {}
        for step, a in enumerate(acts):
            if a in where:
                raise ScheduleError(f"rank {r} runs {a} twice (steps {where[a]} and {step})",
                                    table, [(r, where[a]), (r, step)])
            where[a] = step
        for c in range(v):
            for i in range(m):
                _check_one(table, r, c, i, where)


def _check_one(table: dict[int, list[Action]], r: int, c: int, i: int,
               where: dict[Action, int]) -> None:
    has = {op: where.get(Action(op, c, i)) for op in Op}
    f, b, inp, w = (has[Op.FORWARD], has[Op.BACKWARD], has[Op.BACKWARD_INPUT],
                    has[Op.BACKWARD_WEIGHT])
    present = [(r, s) for s in has.values() if s is not None]
    cell = {op: str(Action(op, c, i)) for op in Op}
    if f is None:
        raise ScheduleError(f"rank {r} never runs {cell[Op.FORWARD]} (chunk {c}, microbatch {i}), "
                            f"though the schedule uses {_span(table)}: every rank runs every "
                            f"chunk for every microbatch", table, present)
    if b is not None and (inp is not None or w is not None):
        raise ScheduleError(f"rank {r} runs both {cell[Op.BACKWARD]} and the split backward "
                            f"({cell[Op.BACKWARD_INPUT]}/{cell[Op.BACKWARD_WEIGHT]}): use one or the other",
                            table, present)
    if b is None and (inp is None or w is None):
        need = f"{cell[Op.BACKWARD]}, or {cell[Op.BACKWARD_INPUT]} and {cell[Op.BACKWARD_WEIGHT]}"
        raise ScheduleError(f"rank {r} runs {cell[Op.FORWARD]} but never its backward ({need})",
                            table, present)


def _span(table: dict[int, list[Action]]) -> str:
    """'chunks 0..v-1, microbatches 0..m-1' of a table, for messages."""
    acts = [a for lst in table.values() for a in lst]
    return (f"chunks 0..{max(a.chunk for a in acts)}, "
            f"microbatches 0..{max(a.microbatch for a in acts)}")


def _check_local_order(table: dict[int, list[Action]]) -> None:
    """A rank's backward comes after its own forward, W after its own I."""
    for r, acts in table.items():
        where = {a: s for s, a in enumerate(acts)}
        for s, a in enumerate(acts):
            before = _local_prerequisite(a)
            if before is not None and where[before] > s:
                raise ScheduleError(f"rank {r} step {s}: {a} comes before {before} "
                                    f"(step {where[before]}) that it needs", table,
                                    [(r, s), (r, where[before])])


def _local_prerequisite(a: Action) -> Action | None:
    if a.op in _BACKWARDS:
        return Action(Op.FORWARD, a.chunk, a.microbatch)
    if a.op is Op.BACKWARD_WEIGHT:
        return Action(Op.BACKWARD_INPUT, a.chunk, a.microbatch)
    return None


def _check_streams(table: dict[int, list[Action]], p: int, placement: str) -> None:
    """Across each stage boundary the receiver takes transfers in the sender's order."""
    v = 1 + max(a.chunk for acts in table.values() for a in acts)
    steps = {(r, a): s for r, acts in table.items() for s, a in enumerate(acts)}
    for s in range(p * v - 1):
        lo, hi = owner(s, p, placement), owner(s + 1, p, placement)
        if lo[0] == hi[0]:
            continue  # same rank: no transfer
        _compare(table, steps, "activations", (lo, s), (hi, s + 1), (Op.FORWARD,))
        _compare(table, steps, "gradients", (hi, s + 1), (lo, s), _BACKWARDS)


def _compare(table: dict[int, list[Action]], steps: dict[Key, int], what: str,
             src: tuple[tuple[int, int], int], dst: tuple[tuple[int, int], int],
             ops: tuple[Op, ...]) -> None:
    (sr, sc), s_stage = src
    (dr, dc), d_stage = dst
    sent = [a.microbatch for a in table[sr] if a.chunk == sc and a.op in ops]
    taken = [a.microbatch for a in table[dr] if a.chunk == dc and a.op in ops]
    for k, (x, y) in enumerate(zip(sent, taken)):
        if x != y:
            send_cell = next(a for a in table[sr] if a.chunk == sc and a.op in ops and a.microbatch == x)
            recv_cell = next(a for a in table[dr] if a.chunk == dc and a.op in ops and a.microbatch == y)
            raise ScheduleError(
                f"{what} from virtual stage {s_stage} (rank {sr}) to virtual stage {d_stage} "
                f"(rank {dr}) arrive out of order: transfer #{k} is sent by {send_cell} "
                f"(microbatch {x}) but received by {recv_cell} (microbatch {y}); sender and "
                f"receiver must handle microbatches across a boundary in the same order",
                table, [(sr, steps[(sr, send_cell)]), (dr, steps[(dr, recv_cell)])])


def dependencies(rank: int, a: Action, num_stages: int, num_chunks: int, placement: str,
                 backward_op: Callable[[int, int, int], Op]) -> list[Key]:
    """The (rank, action)s that must finish before `a` on `rank` can start.

    `backward_op(rank, chunk, microbatch)` says whether that chunk's backward is B or I.
    """
    v_stages = num_stages * num_chunks
    s = virtual_stage(rank, a.chunk, num_stages, placement)
    i = a.microbatch
    if a.op is Op.FORWARD:
        if s == 0:
            return []
        r, c = owner(s - 1, num_stages, placement)
        return [(r, Action(Op.FORWARD, c, i))]
    if a.op is Op.BACKWARD_WEIGHT:
        return [(rank, Action(Op.BACKWARD_INPUT, a.chunk, i))]
    deps = [(rank, Action(Op.FORWARD, a.chunk, i))]
    if s < v_stages - 1:
        r, c = owner(s + 1, num_stages, placement)
        deps.append((r, Action(backward_op(r, c, i), c, i)))
    return deps


class _BackwardKind:
    """backward_op for dependencies(): B or I per (rank, chunk, microbatch), from the table."""

    def __init__(self, table: dict[int, list[Action]]) -> None:
        self.split = {(r, a.chunk, a.microbatch) for r, acts in table.items()
                      for a in acts if a.op is Op.BACKWARD_INPUT}
        self.num_chunks = 1 + max((a.chunk for acts in table.values() for a in acts), default=0)

    def __call__(self, rank: int, chunk: int, microbatch: int) -> Op:
        return Op.BACKWARD_INPUT if (rank, chunk, microbatch) in self.split else Op.BACKWARD


def execute(table: dict[int, list[Action]], placement: str,
            duration: Callable[[Action], float], p2p: float
            ) -> tuple[list[tuple[int, int, Action, float, float]], dict[int, int]]:
    """Run every rank's list in order; an action starts when its rank is free and its
    inputs have arrived (a dependency on another rank adds `p2p`).

    Returns the events (rank, step, action, start, end) and, for a deadlock, the step at
    which each unfinished rank is stuck (empty when everything ran).
    """
    p = len(table)
    kind = _BackwardKind(table)
    ptr = {r: 0 for r in table}
    free = {r: 0.0 for r in table}
    end: dict[Key, float] = {}
    events: list[tuple[int, int, Action, float, float]] = []
    progress = True
    while progress:
        progress = False
        for r, acts in table.items():
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                ready = free[r]
                for dr, da in dependencies(r, a, p, kind.num_chunks, placement, kind):
                    t = end.get((dr, da))
                    if t is None:
                        break
                    ready = max(ready, t + (p2p if dr != r else 0.0))
                else:
                    done = ready + duration(a)
                    end[(r, a)], free[r] = done, done
                    events.append((r, ptr[r], a, ready, done))
                    ptr[r] += 1
                    progress = True
                    continue
                break
    stuck = {r: ptr[r] for r, acts in table.items() if ptr[r] < len(acts)}
    return events, stuck


def _raise_deadlock(table: dict[int, list[Action]], placement: str, stuck: dict[int, int]) -> None:
    p = len(table)
    kind = _BackwardKind(table)
    r = min(stuck)
    a = table[r][stuck[r]]
    steps = {(q, x): s for q, acts in table.items() for s, x in enumerate(acts)}
    for dr, da in dependencies(r, a, p, kind.num_chunks, placement, kind):
        if dr in stuck and steps.get((dr, da), -1) >= stuck[dr]:
            blocker = table[dr][stuck[dr]]
            raise ScheduleError(
                f"deadlock: rank {r} step {stuck[r]} ({a}) waits for {da} on rank {dr} "
                f"(step {steps[(dr, da)]}), but rank {dr} is stuck earlier at step "
                f"{stuck[dr]} ({blocker}); no rank can proceed. Reorder the lists so each "
                f"action's inputs are produced before it is reached",
                table, sorted(stuck.items()))
    raise ScheduleError(f"deadlock: rank {r} step {stuck[r]} ({a}) waits for an input that "
                        f"never arrives", table, sorted(stuck.items()))
