"""How much of a step's all-to-all ran while compute ran beside it, from one step under torch.profiler.

    with torch.profiler.profile(activities=...) as prof:
        step()
    a2a, hidden = all_to_all_overlap(prof)   # seconds of all-to-all, seconds of it hidden

The all-to-all intervals: on CUDA the NCCL kernels launched from inside a c10d all-to-all operator
(a kernel's launching operator is the CPU op whose id its linked correlation id names; that op
started inside an operator whose name holds "alltoall" / "all_to_all" on the same thread); on CPU
(gloo, no kernels) those operators themselves. Compute: on CUDA every other kernel that is not
NCCL's and not a copy or a memset; on CPU the aten operators outside the all-to-all operators. The
hidden part is the all-to-all time during which some compute interval runs on another stream or
thread: what an executor that overlaps a forward with another microbatch's backward (DualPipe's
pairs) would show. An NCCL kernel's time includes waiting for the slowest peer of its group.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["all_to_all_overlap", "covered", "merged"]

Interval = tuple[float, float]


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint ones."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def covered(spans: list[Interval], cover: list[Interval]) -> float:
    """Total length of `spans` (disjoint) that lies inside `cover` (disjoint, sorted)."""
    total = 0.0
    for start, end in spans:
        i = max(bisect.bisect_right(cover, (start, float("inf"))) - 1, 0)
        while i < len(cover) and cover[i][0] < end:
            total += max(0.0, min(end, cover[i][1]) - max(start, cover[i][0]))
            i += 1
    return total


def _is_a2a(name: str) -> bool:
    return "alltoall" in name or "all_to_all" in name


def _inside(starts: dict[int, list[Interval]], thread: int, t: float) -> bool:
    """Whether time t lies inside one of the thread's all-to-all operators (sorted, disjoint)."""
    spans = starts.get(thread, [])
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t <= spans[i][1]


def all_to_all_overlap(prof: Any) -> tuple[float, float]:
    """(all-to-all seconds, seconds of it hidden behind compute) of the profiled block on this rank."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    ops = [e for e in events if e.device_type() == DeviceType.CPU]
    threads: dict[int, list[Interval]] = {}
    for e in ops:
        if _is_a2a(e.name()):
            threads.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
    threads = {t: merged(spans) for t, spans in threads.items()}
    kernels = [e for e in events if e.device_type() == DeviceType.CUDA]
    if kernels:  # CUDA: kernels, the all-to-all ones found through the operator that launched them
        launched = {e.correlation_id(): e for e in ops}
        a2a, compute = [], []
        for k in kernels:
            span, name = (k.start_ns(), k.start_ns() + k.duration_ns()), k.name()
            op = launched.get(k.linked_correlation_id())
            if name.startswith("nccl"):
                if op is not None and _inside(threads, op.start_thread_id(), op.start_ns()):
                    a2a.append(span)
            elif not name.startswith(("Memcpy", "Memset")):
                compute.append(span)
    else:  # CPU: the operators themselves; those inside an all-to-all operator are part of it
        a2a = [s for spans in threads.values() for s in spans]
        compute = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in ops if e.name().startswith("aten::")
                   and not _is_a2a(e.name()) and not _inside(threads, e.start_thread_id(), e.start_ns())]
    a2a = merged(a2a)
    total = sum(e - s for s, e in a2a)
    return total / 1e9, covered(a2a, merged(compute)) / 1e9
