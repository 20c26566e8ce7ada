"""Pipeline schedules as data: each returns every rank's ordered list of actions.

A schedule is a small frozen dataclass; `actions(num_stages)` is a pure function of
(stages, microbatches, chunks) and touches no process group, so the same lists feed the
validator, the simulator and the executor.  Chunk c on rank r holds the virtual stage that
`placement.virtual_stage(r, c, num_stages, placement)` names.

Papers: GPipe (Huang et al. 2019); 1F1B / PipeDream-flush (Narayanan et al. 2019/2021);
interleaved 1F1B (Narayanan et al. 2021, "Efficient large-scale language model training on
GPU clusters using Megatron-LM"); ZB-H1 and ZB-V (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism"; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pipezero.checks import is_int
from pipezero.pipe.schedule.actions import Action, ActionTable, Op
from pipezero.pipe.schedule.placement import PLACEMENTS

__all__ = ["GPipe", "OneFOneB", "Interleaved1F1B", "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV",
           "Custom"]

F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def _check_count(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if not is_int(value):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be an int")
    if value < minimum:
        raise ValueError(f"{owner}({name}={value}): {name} must be >= {minimum}")


class _Base:
    """Shared checks; subclasses are frozen dataclasses with a `num_microbatches` field."""

    num_microbatches: int
    num_chunks: int
    placement: ClassVar[str] = "looped"
    split_backward: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_count(type(self).__name__, "num_microbatches", self.num_microbatches)

    def actions(self, num_stages: int) -> ActionTable:
        """Every rank's ordered actions for a pipeline of `num_stages` ranks."""
        _check_count(f"{self!r}.actions", "num_stages", num_stages)
        return {r: self._rank(r, num_stages) for r in range(num_stages)}

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        raise NotImplementedError


@dataclass(frozen=True)
class GPipe(_Base):
    """All forwards, then all backwards: simple, but holds all m microbatches' activations.

    Bubble (p-1)/(m+p-1). Huang et al. 2019, "GPipe".
    """

    num_microbatches: int
    num_chunks: ClassVar[int] = 1

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        m = self.num_microbatches
        return [Action(F, 0, i) for i in range(m)] + [Action(B, 0, i) for i in range(m)]


@dataclass(frozen=True)
class OneFOneB(_Base):
    """1F1B (PipeDream-flush): GPipe's bubble, but at most p microbatches live on stage 0.

    Rank r runs p-r-1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. Narayanan et al. 2019/2021.
    """

    num_microbatches: int
    num_chunks: ClassVar[int] = 1

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        m = self.num_microbatches
        warm = min(num_stages - rank - 1, m)
        out = [Action(F, 0, i) for i in range(warm)]                       # warm-up
        for i in range(m - warm):                                          # steady 1F1B
            out += [Action(F, 0, warm + i), Action(B, 0, i)]
        out += [Action(B, 0, i) for i in range(m - warm, m)]               # cool-down
        return out


@dataclass(frozen=True)
class Interleaved1F1B(_Base):
    """Megatron's interleaved 1F1B: v looped chunks per rank cut the bubble by v.

    Bubble (p-1)/(v*m+p-1) at about 1F1B's memory (in whole-stage units), for v times the
    p2p messages. Rank r runs its chunk-actions in groups of p microbatches per chunk; warm-up
    is 2(p-r-1) + (v-1)p forwards. Needs num_microbatches to be a multiple of num_stages.
    Narayanan et al. 2021, "Efficient large-scale language model training ... Megatron-LM".
    """

    num_microbatches: int
    num_chunks: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count(type(self).__name__, "num_chunks", self.num_chunks, minimum=2)

    def actions(self, num_stages: int) -> ActionTable:
        _check_count(f"{self!r}.actions", "num_stages", num_stages)
        m, p = self.num_microbatches, num_stages
        if m % p:
            lower, upper = m - m % p, m + p - m % p
            near = f"{lower} or {upper}" if lower >= p else f"{upper}"
            raise ValueError(
                f"{self!r} on num_stages={p}: num_microbatches must be a multiple of "
                f"num_stages (e.g. {near}), or use OneFOneB / ZeroBubbleV")
        return super().actions(num_stages)

    def _unit(self, k: int, p: int, backward: bool) -> tuple[int, int]:
        """(chunk, microbatch) of the k-th forward (or backward) chunk-action of a rank."""
        v = self.num_chunks
        group, pos = divmod(k, p * v)
        chunk = pos // p
        return (v - 1 - chunk if backward else chunk), group * p + pos % p

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        p, v = num_stages, self.num_chunks
        total = self.num_microbatches * v
        warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
        fwd = [Action(F, *self._unit(k, p, False)) for k in range(total)]
        bwd = [Action(B, *self._unit(k, p, True)) for k in range(total)]
        out = fwd[:warm]                                                   # warm-up
        for k in range(total - warm):                                      # steady 1F1B
            out += [fwd[warm + k], bwd[k]]
        return out + bwd[total - warm:]                                    # cool-down


@dataclass(frozen=True)
class ZeroBubbleH1(_Base):
    """ZB-H1: 1F1B with the backward split into I (input grad) and a deferred W.

    Rank r keeps 1F1B's p-r-1 warm-up forwards and lets each W trail its I by r
    microbatches, so the W's fill the cool-down bubble: with F = I = W the idle time is a
    third of 1F1B's, and the peak memory (activations live until W) stays at p
    microbatches, 1F1B's peak. Qi et al. 2023, "Zero Bubble Pipeline Parallelism".
    """

    num_microbatches: int
    num_chunks: ClassVar[int] = 1
    split_backward: ClassVar[bool] = True

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        m = self.num_microbatches
        warm = min(num_stages - rank - 1, m)
        lag = rank
        out = [Action(F, 0, i) for i in range(warm)]                       # warm-up
        for i in range(m):                                                 # steady + cool-down
            if warm + i < m:
                out.append(Action(F, 0, warm + i))
            out.append(Action(I, 0, i))
            if i >= lag:
                out.append(Action(W, 0, i - lag))
        out += [Action(W, 0, i) for i in range(max(m - lag, 0), m)]        # deferred W's
        return out


@dataclass(frozen=True)
class ZeroBubbleV(_Base):
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), split backward.

    The V puts the first and last virtual stage on rank 0, so the backward starts on the
    rank that finished the forward; with F = I = W and m >= 2p-1 the bubble is close to
    zero at 1F1B's peak memory (2p chunk activations = p whole-stage ones).
    Qi et al. 2024, "Pipeline Parallelism with Controllable Memory" (ZB-V).
    """

    num_microbatches: int
    num_chunks: ClassVar[int] = 2
    placement: ClassVar[str] = "v"
    split_backward: ClassVar[bool] = True

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        # Built for n >= 2p-1 microbatches (the V's warm-up needs that many), then the
        # microbatches >= m are dropped: dependencies never cross microbatches, so the
        # remaining lists still run in order.
        p, m = num_stages, self.num_microbatches
        ops = _VOps(max(m, 2 * p - 1))
        for _ in range(2 * (p - rank) - 1):                                # warm-up: down the V
            ops.emit(F, 0)
        for _ in range(rank):
            ops.emit(F, 1), ops.emit(F, 0)
        for _ in range(p - rank):                                          # first turns of the V
            ops.emit(F, 1), ops.emit(I, 1), ops.emit(W, 1)
        while ops.left(F, 0) or ops.left(F, 1):                            # steady
            ops.emit(F, 0), ops.emit(I, 0), ops.emit(W, 0)
            ops.emit(F, 1), ops.emit(I, 1), ops.emit(W, 1)
        for _ in range(rank):                                              # cool-down
            ops.emit(I, 0), ops.emit(I, 1)
        for _ in range(p - rank):
            ops.emit(I, 0), ops.emit(W, 0)
        ops.drain(W, 1), ops.drain(W, 0)
        return [a for a in ops.out if a.microbatch < m]


@dataclass(frozen=True)
class DualPipeV(_Base):
    """DualPipeV: the V placement of ZB-V, with the steady state pairing a forward of one
    chunk with a backward of the other (the pairs an executor can overlap to hide
    communication), full backwards in the middle and split ones at both ends.

    Listed in order (each pair as F then B); needs num_microbatches >= 2 * num_stages.
    DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (DualPipe); the V ("cut-in-half")
    variant of Qi et al.
    """

    num_microbatches: int
    num_chunks: ClassVar[int] = 2
    placement: ClassVar[str] = "v"
    split_backward: ClassVar[bool] = True  # some backwards are split into I and W

    def actions(self, num_stages: int) -> ActionTable:
        _check_count(f"{self!r}.actions", "num_stages", num_stages)
        if self.num_microbatches < 2 * num_stages:
            raise ValueError(f"{self!r} on num_stages={num_stages}: needs num_microbatches >= "
                             f"2 * num_stages = {2 * num_stages}, or use ZeroBubbleV")
        return super().actions(num_stages)

    def _rank(self, rank: int, num_stages: int) -> list[Action]:
        p, m, r = num_stages, self.num_microbatches, rank
        ops = _VOps(m)
        for _ in range(2 * (p - r - 1)):                                   # warm-up: down the V
            ops.emit(F, 0)
        for _ in range(r + 1):
            ops.emit(F, 0), ops.emit(F, 1)
        for _ in range(p - r - 1):                                         # first turns, split
            ops.backward(1, split=True), ops.weight(), ops.emit(F, 1)
        for _ in range(m - 2 * p + r + 1):                                 # steady: F/B pairs
            ops.emit(F, 0), ops.backward(1), ops.emit(F, 1), ops.backward(0)
        for _ in range(p - r - 1):
            ops.backward(1), ops.emit(F, 1), ops.backward(0)
        half = (r + 1) // 2                                                # drain: split from here
        for i in range(r + 1):
            ops.backward(1, split=i > half or (i == half and r % 2 == 1))
            ops.backward(0, split=i >= half)
        for _ in range(p - r - 1):
            ops.weight(), ops.backward(0, split=True)
        while ops.deferred:
            ops.weight()
        return ops.out


class _VOps:
    """Per-(op, chunk) counters that emit the next microbatch, up to n of each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.next: dict[tuple[Op, int], int] = {}
        self.out: list[Action] = []
        self.deferred: list[Action] = []  # W's owed by split backwards, oldest first

    def left(self, op: Op, chunk: int) -> bool:
        return self.next.get((op, chunk), 0) < self.n

    def emit(self, op: Op, chunk: int) -> None:
        i = self.next.get((op, chunk), 0)
        if i < self.n:
            self.out.append(Action(op, chunk, i))
            self.next[(op, chunk)] = i + 1

    def drain(self, op: Op, chunk: int) -> None:
        while self.left(op, chunk):
            self.emit(op, chunk)

    def backward(self, chunk: int, split: bool = False) -> None:
        """The chunk's next backward: B, or I with its W deferred (see weight())."""
        i = self.next.get((B, chunk), 0)
        self.out.append(Action(I if split else B, chunk, i))
        self.next[(B, chunk)] = i + 1
        if split:
            self.deferred.append(Action(W, chunk, i))

    def weight(self) -> None:
        """The oldest deferred W."""
        self.out.append(self.deferred.pop(0))


@dataclass(frozen=True)
class Custom(_Base):
    """A hand-written schedule: fixed lists per rank, validated and simulated like the rest.

    Build it from a dict rank -> cells (`Custom({0: ["0F0", "0B0"], ...})`) or from a text
    grid (`Custom.from_text(...)`). `num_microbatches` and `num_chunks` are read from the
    actions; `split_backward` is True when any I or W appears.
    """

    table: tuple[tuple[Action, ...], ...]
    placement: str = "looped"  # type: ignore[misc]
    num_microbatches: int = field(init=False)
    num_chunks: int = field(init=False)
    split_backward: bool = field(init=False)  # type: ignore[misc]

    def __init__(self, table: Mapping[int, Sequence[Action | str]], placement: str = "looped") -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"Custom(placement={placement!r}): expected one of {PLACEMENTS}")
        if not isinstance(table, Mapping) or sorted(table) != list(range(len(table))) or not table:
            raise ValueError("Custom(table) needs a dict with ranks 0..p-1 as keys, "
                             f"got keys {sorted(table) if isinstance(table, Mapping) else table!r}")
        rows = tuple(tuple(_as_action(x) for x in table[r]) for r in range(len(table)))
        everything = [a for row in rows for a in row]
        if not everything:
            raise ValueError("Custom(table) has no actions")
        set_ = object.__setattr__
        set_(self, "table", rows)
        set_(self, "placement", placement)
        set_(self, "num_microbatches", 1 + max(a.microbatch for a in everything))
        set_(self, "num_chunks", 1 + max(a.chunk for a in everything))
        set_(self, "split_backward", any(a.op in (I, W) for a in everything))

    @classmethod
    def from_text(cls, text: str, placement: str = "looped") -> "Custom":
        """Read a step x rank grid as to_text() prints it, or one row of cells per step.

        With a "step  rank 0  rank 1 ..." header, cells are read by column position
        (blank = idle) and the step labels are ignored; without one, each line holds one
        whitespace-separated cell per rank, "." for idle. Brackets around cells are ignored.
        """
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            raise ValueError("Custom.from_text got no lines")
        if lines[0].split()[0] == "step":
            grid = _read_columns(lines)
        else:
            grid = _read_rows(lines)
        table = {r: [c for c in (row[r] for row in grid) if c] for r in range(len(grid[0]))}
        return cls(table, placement)

    def actions(self, num_stages: int) -> ActionTable:
        if num_stages != len(self.table):
            raise ValueError(f"this Custom schedule is written for num_stages={len(self.table)}, "
                             f"got num_stages={num_stages}")
        return {r: list(row) for r, row in enumerate(self.table)}

    def __repr__(self) -> str:
        return (f"Custom(num_stages={len(self.table)}, num_microbatches={self.num_microbatches}, "
                f"num_chunks={self.num_chunks}, placement={self.placement!r})")


def _as_action(x: Action | str) -> Action:
    if isinstance(x, Action):
        return x
    if isinstance(x, str):
        return Action.parse(x.strip().strip("[]"))
    raise TypeError(f"a schedule cell must be an Action or a string like '0F3', got {x!r}")


def _read_columns(lines: list[str]) -> list[list[str]]:
    """Cells by the column positions of the 'rank k' headers."""
    head = lines[0]
    starts = []
    pos = head.find("rank ")
    while pos >= 0:
        starts.append(pos)
        pos = head.find("rank ", pos + 1)
    if not starts:
        raise ValueError(f"grid header {head!r} names no 'rank k' columns")
    bounds = list(zip(starts, starts[1:] + [None]))
    return [[ln[a:b].strip().strip("[]").strip() for a, b in bounds] for ln in lines[1:]]


def _read_rows(lines: list[str]) -> list[list[str]]:
    rows = [ln.split() for ln in lines]
    width = len(rows[0])
    for k, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"grid line {k} has {len(row)} cells, line 0 has {width}: write "
                             f"one cell per rank on every line, '.' for idle")
    return [["" if c in (".", "-") else c for c in row] for row in rows]
