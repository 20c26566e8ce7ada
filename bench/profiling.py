"""One step under torch.profiler: its operators by GPU time, written where the benchmark is told.

    with profiled(args.profile, "hf-torch-compiled"):
        run.step(batches)

Writes <folder>/<name>.txt on rank 0: the wall time of the block, the sum of its kernels' time
(below the wall time: the GPU waited on the host) and the top operators by self device time,
then by self CPU time, then by self device time per input shape. No folder: the block runs as it is.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def profiled(folder: str | None, name: str, rows: int = 40) -> Iterator[None]:
    if not folder:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # not the ops launching them
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.txt"), "w") as f:
        f.write(f"{name}: wall {wall * 1e3:.1f} ms under the profiler, kernels {device_ms:.1f} ms\n\n")
        for key in ("self_device_time_total", "self_cpu_time_total"):
            f.write(events.table(sort_by=key, row_limit=rows, max_name_column_width=80) + "\n")
        by_shape = prof.key_averages(group_by_input_shape=True)
        f.write(by_shape.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60) + "\n")
