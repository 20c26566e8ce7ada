"""What is alive at a CUDA block's peak, from the caching allocator's own history.

    with peak_history(args.explain, "pipezero-compiled"):
        step(ids, targets)

Records torch.cuda.memory's allocation history (Python stacks) over the block and writes
<folder>/<name>-peak.txt: the bytes allocated when the block began, its peak over them, and
what was alive at that moment, grouped by where it was allocated (the innermost frames outside
torch itself: a pipezero or transformers line, or an inductor-generated kernel's file). Two runs
side by side show where one's extra peak comes from. No folder, or no CUDA: the block runs as it
is. bench/live_tensors.py answers the same question on CPU, by tensor, for eager code.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Any, Iterator

import torch

__all__ = ["peak_history", "summarize"]

MAX_ENTRIES = 2_000_000  # allocator events kept; one step of an 8-layer MoE makes far fewer
ALLOC, FREED = "alloc", "free_completed"  # a free counts once completed, as torch's allocated bytes do


@contextlib.contextmanager
def peak_history(folder: str | None, name: str, top: int = 25) -> Iterator[None]:
    if not folder or not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}-peak.txt"), "w") as f:
        f.write("\n".join(summarize(trace, start, top)) + "\n")


def summarize(trace: list[dict], start: int = 0, top: int = 25) -> list[str]:
    """Lines: the peak of the trace's allocations over `start` bytes and the `top` places alive then."""
    total, peak, at = 0, 0, -1
    for i, event in enumerate(trace):
        total += _change(event)
        if total > peak:
            peak, at = total, i
    alive: dict[int, dict] = {}
    for event in trace[:at + 1]:
        if event["action"] == ALLOC:
            alive[event["addr"]] = event
        elif event["action"] == FREED:
            alive.pop(event["addr"], None)
    places: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in alive.values():
        place = places[_place(event.get("frames", []))]
        place[0] += event["size"]
        place[1] += 1
    gib = 2**30
    lines = [f"allocated at the start {start / gib:.2f} GiB; peak {(start + peak) / gib:.2f} GiB "
             f"(+{peak / gib:.2f}) at event {at} of {len(trace)}; alive then, by place:"]
    for where, (size, count) in sorted(places.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / gib:8.3f} GiB {count:6d} x  {where}")
    return lines


def _change(event: dict) -> int:
    if event["action"] == ALLOC:
        return event["size"]
    return -event["size"] if event["action"] == FREED else 0


def _place(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """The innermost `depth` frames outside torch's own package (inductor's generated files count)."""
    own = [f for f in frames if "torchinductor" in f["filename"] or "/torch/" not in f["filename"]]
    names = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in own[:depth]]
    return " < ".join(names) or "torch"
