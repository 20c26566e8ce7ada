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
* messages between two ranks are taken in the order they are sent, per ordered channel:
  channels="kind" (default) keeps one channel per (sender, receiver, activation|gradient),
  channels="pair" one per (sender, receiver), as a single untagged transport does;
* run in order on every rank, with receives that wait for their data, the schedule
  finishes (no deadlock). sends="async" (default): a send never holds up its rank;
  sends="blocking": the rank's next action waits until the receiver has posted the
  receive (it posts it once the action before the consuming one is done), which is how
  a batched send+receive that waits for both behaves when the transport (nccl, large
  messages) cannot buffer. ZB-V needs channels="kind"; ZB-V and interleaved 1F1B with
  m > p need sends="async"; GPipe, 1F1B and ZB-H1 pass every model (ZB-H1 loses its gain
  under blocking sends, see bench/RESULTS.md).

A failure raises ScheduleError with the step x rank grid (step = position in the rank's
list) and the offending cells in brackets.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from pipezero.pipe.schedule.actions import Action, Op
from pipezero.pipe.schedule.placement import PLACEMENTS, owner, virtual_stage
from pipezero.pipe.schedule.render import to_text

__all__ = ["ScheduleError", "validate", "check_static", "execute", "raise_deadlock", "Transfer",
           "transfers", "transfer_table", "channel_order", "dependencies", "normalize", "resolve_placement"]

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
             num_microbatches: int | None = None, *, channels: str = "kind",
             sends: str = "async") -> dict[int, list[Action]]:
    """Raise ScheduleError unless `actions` can run; return the checked table.

    `placement` is "looped", "v" or a schedule object (its `.placement` is used); when
    `actions` is itself a schedule object its placement wins. `num_microbatches`, when
    given, must match the microbatches the actions cover.

    The executor model: `channels` "kind" (one ordered channel per sender, receiver and
    activation/gradient) or "pair" (one per sender and receiver); `sends` "async" (a send
    never holds up its rank) or "blocking" (the rank's next action waits until the
    receiver has posted the receive, i.e. has finished the action before the consumer).
    """
    table, name = check_static(actions, num_stages, placement, num_microbatches, channels, sends)
    _, stuck = execute(table, name, lambda r, a: 1.0, 0.0, blocking_sends=sends == "blocking")
    if stuck:
        raise_deadlock(table, name, stuck, sends)
    return table


def check_static(actions: Any, num_stages: int | None, placement: Any,
                 num_microbatches: int | None, channels: str, sends: str
                 ) -> tuple[dict[int, list[Action]], str]:
    """Every check of validate() but the deadlock run; returns (table, placement name)."""
    if callable(getattr(actions, "actions", None)):
        placement = actions
    name = resolve_placement(placement)
    _check_mode(channels=channels, sends=sends)
    table = normalize(actions, num_stages)
    v, m = _shape(table, num_microbatches)
    _check_coverage(table, v, m)
    _check_local_order(table)
    _check_channels(table, name, channels)
    return table, name


_MODES = {"channels": ("kind", "pair"), "sends": ("async", "blocking")}


def _check_mode(**given: str) -> None:
    for name, value in given.items():
        if value not in _MODES[name]:
            raise ValueError(f"{name}={value!r} is not one of {_MODES[name]}")


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
    if f is not None and (b is None) != (inp is None and w is None) and (inp is None) == (w is None):
        return  # one F and either B or I and W
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


class Transfer(NamedTuple):
    """One message between ranks: `kind` "activation" or "gradient" from virtual stage
    `src_stage` to `dst_stage` for `microbatch`."""

    src: int
    dst: int
    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int


def transfers(rank: int, a: Action, num_stages: int, num_chunks: int,
              placement: str) -> tuple[Transfer | None, Transfer | None]:
    """(what `a` on `rank` receives, what it sends); None when the peer stage is local."""
    s = virtual_stage(rank, a.chunk, num_stages, placement)
    last = num_stages * num_chunks - 1
    if a.op is Op.FORWARD:
        kind, before, after = "activation", s - 1, s + 1
    elif a.op in _BACKWARDS:
        kind, before, after = "gradient", s + 1, s - 1
    else:
        return None, None
    recv = send = None
    if 0 <= before <= last and owner(before, num_stages, placement)[0] != rank:
        recv = Transfer(owner(before, num_stages, placement)[0], rank, kind, before, s, a.microbatch)
    if 0 <= after <= last and owner(after, num_stages, placement)[0] != rank:
        send = Transfer(rank, owner(after, num_stages, placement)[0], kind, s, after, a.microbatch)
    return recv, send


Move = tuple[Transfer | None, Transfer | None]  # what one action receives, what it sends
Moves = dict[int, list[Move]]  # rank -> one Move per step
Book = dict[tuple, list[tuple[Transfer, int]]]  # channel -> (message, step), in one side's order


def transfer_table(table: Mapping[int, Sequence[Action]], placement: str,
                   num_chunks: int | None = None) -> Moves:
    """Every action's (receive, send), per rank in list order: all messages of the schedule.

    `num_chunks` defaults to the chunks the actions use.
    """
    p, v = len(table), _num_chunks(table) if num_chunks is None else num_chunks
    return {r: [transfers(r, a, p, v, placement) for a in acts] for r, acts in table.items()}


def channel_order(moves: Moves, channels: str) -> tuple[Book, Book]:
    """(sent, taken): per channel, the messages with their step, in the sender's and in the
    receiver's order. A channel is (src, dst, kind) for channels="kind", (src, dst) for "pair"."""
    sent: Book = {}
    taken: Book = {}
    for row in moves.values():
        for step, (recv, send) in enumerate(row):
            for t, book in ((send, sent), (recv, taken)):
                if t is not None:
                    key = (t.src, t.dst) if channels == "pair" else (t.src, t.dst, t.kind)
                    book.setdefault(key, []).append((t, step))
    return sent, taken


def _check_channels(table: dict[int, list[Action]], placement: str, channels: str) -> None:
    """On every channel the receiver takes the messages in the order the sender sends them.

    channels="kind": one ordered channel per (sender, receiver, activation|gradient);
    channels="pair": one per (sender, receiver) for both kinds (a single untagged channel).
    """
    sent, taken = channel_order(transfer_table(table, placement), channels)
    for key in sorted(set(sent) | set(taken)):
        for k, ((x, sx), (y, sy)) in enumerate(zip(sent.get(key, []), taken.get(key, []))):
            if x != y:
                what = "" if channels == "pair" else f" ({x.kind}s)"
                raise ScheduleError(
                    f"rank {x.src} -> rank {x.dst}{what} out of order: message #{k} is sent by "
                    f"{table[x.src][sx]} ({x.kind} of microbatch {x.microbatch}, stage "
                    f"{x.src_stage}->{x.dst_stage}) but the receiver's #{k} receive is "
                    f"{table[y.dst][sy]} ({y.kind} of microbatch {y.microbatch}, stage "
                    f"{y.src_stage}->{y.dst_stage}); both ranks must handle the messages "
                    f"of a channel in the same order (channels={channels!r})",
                    table, [(x.src, sx), (y.dst, sy)])


def _num_chunks(table: dict[int, list[Action]]) -> int:
    return 1 + max((a.chunk for acts in table.values() for a in acts), default=0)


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
            duration: Callable[[int, Action], float], p2p: float, blocking_sends: bool = False,
            together: Mapping[int, Collection[int]] | None = None
            ) -> tuple[list[tuple[int, int, Action, float, float]], dict[int, int]]:
    """Run every rank's list in order; an action starts when its rank is free and its
    inputs have arrived (a dependency on another rank adds `p2p`). With `blocking_sends`
    an action also waits until the messages of the rank's previous action were taken.
    `together`: rank -> steps k run as one with step k + 1 (a pair: both inputs received
    before either starts, both outputs sent after both end), as an executor that pairs them runs.

    Returns the events (rank, step, action, start, end) and, for a deadlock, the step at
    which each unfinished rank is stuck (empty when everything ran).
    """
    waits = _waits(table, placement, blocking_sends)
    for r, steps in (together or {}).items():
        for k in steps:  # k waits for k + 1's inputs too; k + 1 then runs at once, before any other rank sees k
            waits[(r, k)] = waits[(r, k)] + [w for w in waits[(r, k + 1)] if w != (r, table[r][k])]
    ptr = {r: 0 for r in table}
    free = {r: 0.0 for r in table}
    end: dict[Key, float] = {}
    events: list[tuple[int, int, Action, float, float]] = []
    progress = True
    while progress:
        progress = False
        for r, acts in table.items():
            while ptr[r] < len(acts):
                ready = free[r]
                for key in waits[(r, ptr[r])]:
                    if key not in end:
                        break
                    ready = max(ready, end[key] + (p2p if key[0] != r else 0.0))
                else:
                    a = acts[ptr[r]]
                    end[(r, a)] = free[r] = ready + duration(r, a)
                    events.append((r, ptr[r], a, ready, free[r]))
                    ptr[r] += 1
                    progress = True
                    continue
                break
    stuck = {r: ptr[r] for r, acts in table.items() if ptr[r] < len(acts)}
    return events, stuck


def _waits(table: dict[int, list[Action]], placement: str, blocking_sends: bool
           ) -> dict[tuple[int, int], list[Key]]:
    """(rank, step) -> the actions that must have ended before that step can start."""
    p, v = len(table), _num_chunks(table)
    kind = _BackwardKind(table)
    waits = {(r, k): dependencies(r, a, p, v, placement, kind)
             for r, acts in table.items() for k, a in enumerate(acts)}
    if blocking_sends:
        step_of = {(r, a): k for r, acts in table.items() for k, a in enumerate(acts)}
        for r, row in transfer_table(table, placement, v).items():
            for k in range(1, len(row)):
                send = row[k - 1][1]
                if send is None:
                    continue
                c = owner(send.dst_stage, p, placement)[1]
                op = Op.FORWARD if send.kind == "activation" else kind(send.dst, c, send.microbatch)
                at = step_of.get((send.dst, Action(op, c, send.microbatch)), 0)
                if at > 0:  # the receiver posts its receive once its previous action is done
                    waits[(r, k)].append((send.dst, table[send.dst][at - 1]))
    return waits


def raise_deadlock(table: dict[int, list[Action]], placement: str, stuck: dict[int, int],
                   sends: str) -> None:
    """Raise the ScheduleError for a run of execute() that got `stuck`."""
    waits = _waits(table, placement, sends == "blocking")
    r = min(stuck)
    a = table[r][stuck[r]]
    steps = {(q, x): s for q, acts in table.items() for s, x in enumerate(acts)}
    data = set(dependencies(r, a, len(table), _num_chunks(table), placement, _BackwardKind(table)))
    for dr, da in waits[(r, stuck[r])]:
        if dr in stuck and steps.get((dr, da), -1) >= stuck[dr]:
            why = (f"waits for {da} on rank {dr} (step {steps[(dr, da)]})" if (dr, da) in data
                   else f"waits for rank {dr} to take the message of step {stuck[r] - 1} "
                        f"({table[r][stuck[r] - 1]}), which it does after its step "
                        f"{steps[(dr, da)]} ({da}) (sends='blocking')")
            raise ScheduleError(
                f"deadlock: rank {r} step {stuck[r]} ({a}) {why}, but rank {dr} is stuck "
                f"earlier at step {stuck[dr]} ({table[dr][stuck[dr]]}); no rank can proceed. "
                f"Reorder the lists so each action's inputs are produced before it is reached",
                table, sorted(stuck.items()))
    raise ScheduleError(f"deadlock: rank {r} step {stuck[r]} ({a}) waits for an input that "
                        f"never arrives", table, sorted(stuck.items()))
