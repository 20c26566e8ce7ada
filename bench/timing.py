"""The benchmarks' timer: the median wall time of a call, the device synchronised around each."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 0) -> float:
    """Median seconds of `repeats` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
