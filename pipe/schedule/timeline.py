"""The real timeline of a pipeline step: when each action ran on each rank.

The executor records every compute action and every wait on the network; from those the
measured bubble (idle share of the ranks' time) is what the simulator predicts for the same
schedule, and the events export as a chrome trace (chrome://tracing, ui.perfetto.dev).
On CUDA the times come from CUDA events, resolved only when `events` is read (which then waits
for the last one): recording never synchronises the GPU, so a step's kernels and the
optimizer's after it queue up behind each other without a gap. Each event also carries the
bytes the caching allocator held when it ended (CUDA only): the measured twin of the
simulator's live activations.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from pipezero.pipe.schedule.simulate import idle_fraction

__all__ = ["Event", "Timeline", "bubble_fraction", "chrome_trace", "gather_events"]


@dataclass
class Event:
    """One span on one rank: `kind` is "compute" (an action) or "comm" (waiting on peers)."""

    name: str
    kind: str
    rank: int
    start: float  # seconds: the host's monotonic clock (on CUDA: at the step's start, plus GPU time
    end: float    # since then; ranks then differ by their GPU's backlog, durations are exact)
    memory: int = 0  # bytes allocated on the device when the span ended (CUDA; 0 on CPU)


class Timeline:
    """Records the events of the current step on this rank."""

    def __init__(self, rank: int, device: torch.device | str = "cpu"):
        self.rank = rank
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[Event] = []
        self._pending: list[tuple[str, str, object, object, int]] = []
        self._origin: tuple[float, object] | None = None

    @property
    def events(self) -> list[Event]:
        """The current (or last) step's events; on CUDA reading them waits for the last one."""
        if self._pending:
            self._pending[-1][3].synchronize()
            host0, marker = self._origin
            self._events += [Event(name, kind, self.rank, host0 + marker.elapsed_time(start) / 1e3,
                                   host0 + marker.elapsed_time(end) / 1e3, memory)
                             for name, kind, start, end, memory in self._pending]
            self._pending = []
        return self._events

    def begin(self) -> None:
        """Start a new step (drops the previous step's events)."""
        self._events, self._pending = [], []
        marker = None
        if self.cuda:
            marker = torch.cuda.Event(enable_timing=True)
            marker.record()
        self._origin = (time.perf_counter(), marker)

    @contextmanager
    def span(self, name: str, kind: str) -> Iterator[None]:
        """Time the body as one event."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, kind, start, end, torch.cuda.memory_allocated()))
        else:
            start = time.perf_counter()
            yield
            self._events.append(Event(name, kind, self.rank, start, time.perf_counter()))


def bubble_fraction(events: Sequence[Event]) -> float:
    """1 - (compute time summed over ranks) / (ranks x the step's span).

    The step's span is the longest rank's, from its first to its last event: the ranks start
    together (the runner's step begins with a collective), so a rank that finishes early is
    idle until the last one ends, as in the simulator's definition (idle area / ranks x
    makespan). Only durations are compared, so the ranks' clocks need not agree.
    """
    busy, spans = [], []
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        busy.append(sum(e.end - e.start for e in mine if e.kind == "compute"))
        spans.append(max(e.end for e in mine) - min(e.start for e in mine))
    return idle_fraction(busy, max(spans, default=0.0))


def gather_events(events: Sequence[Event], group=None) -> list[Event]:
    """Every rank's events of `group` on every rank (a collective)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [asdict(e) for e in events], group=group)
    return [Event(**e) for part in gathered for e in part]


def chrome_trace(events: Sequence[Event], path: str | None = None) -> dict:
    """The events as a chrome trace (one row per rank, and a memory counter per rank on CUDA);
    written to `path` when given."""
    t0 = min((e.start for e in events), default=0.0)
    trace = {"traceEvents": [
        {"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
         "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6} for e in events]}
    trace["traceEvents"] += [{"name": f"memory rank {e.rank}", "ph": "C", "pid": 0, "ts": (e.end - t0) * 1e6,
                              "args": {"GiB": e.memory / 2**30}} for e in events if e.memory]
    trace["traceEvents"] += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
                             for r in sorted({e.rank for e in events})]
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
