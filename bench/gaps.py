"""Where a GPU sat idle in a profiled step: the gaps between its compute kernels.

A kernel table says how long each kernel ran, not when the GPU waited. This merges the
kernel intervals of one torch.profiler run (communication kernels left out: an NCCL receive
that spins while its peer is late is waiting, not computing) and lists the longest gaps with
the kernels on either side, so two runners' idle time can be compared kernel by kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

COMM = ("nccl", "sendrecv", "allreduce", "broadcast", "allgather", "reducescatter")


class Gap(NamedTuple):
    start_us: float  # from the first kernel's start
    length_us: float
    before: str      # the compute kernel that ended the busy stretch
    after: str       # the compute kernel that started the next one


def device_kernels(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every device event of a torch.profiler run."""
    from torch.autograd import DeviceType
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def compute_gaps(kernels: Sequence[tuple[float, float, str]], min_us: float = 50.0) -> tuple[float, float, list[Gap]]:
    """(span, busy, gaps >= min_us longest first) over the compute kernels, in microseconds;
    span runs from the first kernel's start to the last one's end."""
    compute = sorted(k for k in kernels if not any(c in k[2].lower() for c in COMM))
    if not compute:
        return 0.0, 0.0, []
    origin, busy, gaps = compute[0][0], 0.0, []
    run_start, run_end, last = compute[0]
    for start, end, name in compute[1:]:
        if start > run_end:
            busy += run_end - run_start
            if start - run_end >= min_us:
                gaps.append(Gap(run_end - origin, start - run_end, last, name))
            run_start = start
        if end >= run_end:
            run_end, last = end, name
    busy += run_end - run_start
    return run_end - origin, busy, sorted(gaps, key=lambda g: -g.length_us)


def gap_report(kernels: Sequence[tuple[float, float, str]], top: int = 12) -> str:
    """A few lines: span, busy share, and the longest idle gaps between compute kernels."""
    span, busy, gaps = compute_gaps(kernels)
    lines = [f"compute kernels: span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
             f"({busy / span if span else 0.0:.1%}), {len(gaps)} gaps >= 50 us totalling "
             f"{sum(g.length_us for g in gaps) / 1e3:.2f} ms"]
    lines += [f"  at {g.start_us / 1e3:9.2f} ms: {g.length_us / 1e3:7.3f} ms idle after {g.before[:50]!r} "
              f"before {g.after[:50]!r}" for g in gaps[:top]]
    return "\n".join(lines)
