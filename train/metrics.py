"""The numbers a training step shows: throughput, MFU, peak memory, bytes moved, the real timeline.

Each part exposes its own numbers (comm's TRAFFIC, the runner's timeline, the loss scaler's
scale and grad norm); this file only turns them into plain dicts and pictures for
TensorBoard and the console. MFU = achieved model FLOPs / peak FLOPs of the devices
(Chowdhery et al. 2022, PaLM, appendix B); it is reported on GPU only, where a peak is known.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Mapping, Sequence

import torch

from pipezero.pipe.schedule.actions import Action
from pipezero.pipe.schedule.simulate import Event as SimEvent
from pipezero.pipe.schedule.simulate import SimResult, idle_fraction
from pipezero.pipe.schedule.timeline import Event

__all__ = ["mfu", "peak_memory_bytes", "timeline_result", "traffic_scalars"]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory: CUDA's allocator on GPU, the process's max resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation over the whole job, or None without a known peak (CPU)."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * world_size)


def traffic_scalars(snapshot: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """comm TRAFFIC.snapshot() -> {"bytes/all_reduce": ..., "seconds/p2p_send": ...}."""
    out = {}
    for kind, numbers in snapshot.items():
        out[f"bytes/{kind}"] = float(numbers.get("bytes", 0))
        out[f"seconds/{kind}"] = float(numbers.get("seconds", 0.0))
    return out


def timeline_result(events: Sequence[Event], pipe_rank_of: Any, num_stages: int, num_chunks: int) -> SimResult:
    """The measured compute events of one step, as a SimResult that pipe.to_image/to_text draw.

    `pipe_rank_of(global_rank)` gives the row; times are seconds from the step's first event.
    """
    compute = [e for e in events if e.kind == "compute"]
    t0 = min((e.start for e in compute), default=0.0)
    rows, counters = [], {}
    for e in sorted(compute, key=lambda e: (e.start, e.rank)):
        row = pipe_rank_of(e.rank)
        step = counters[row] = counters.get(row, -1) + 1
        rows.append(SimEvent(row, step, Action.parse(e.name), e.start - t0, e.end - t0))
    makespan = max((e.end for e in rows), default=0.0)
    busy = {r: sum(e.end - e.start for e in rows if e.rank == r) for r in range(num_stages)}
    return SimResult(timeline=rows, makespan=makespan, busy=busy, bubble=idle_fraction(busy.values(), makespan),
                     peak_activations={}, num_stages=num_stages, num_chunks=num_chunks)
