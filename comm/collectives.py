"""Collectives that other packages share: sum or average, sync or async, traffic counted.

torch 2.13 deprecates reduce_scatter_tensor / all_gather_into_tensor in favour of
reduce_scatter_single / all_gather_single, which torch 2.11 lacks: pick whichever exists,
so neither version shows a warning. gloo has no AVG reduction: average = sum then divide.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from pipezero.comm.nvtx import nvtx_range
from pipezero.comm.traffic import TRAFFIC, group_name

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An asynchronous operation; wait() completes it and runs its finishing step once.

    `works` are torch Work objects or other Handles (a bucketed operation is one Handle
    over its buckets' Handles, with kind "" so its time is not counted twice).
    """

    def __init__(self, kind: str, works: list, finish: Callable[[], None] | None = None):
        self.kind, self._works, self._finish = kind, works, finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        start = time.perf_counter()
        for work in self._works:
            if work is not None:
                work.wait()
        if self._finish is not None:
            self._finish()
        if self.kind:
            TRAFFIC.add_seconds(self.kind, time.perf_counter() - start)
        self._done, self._works = True, []  # a finished work and its tensors are not kept alive

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)


def group_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _avg_op(group):
    """ReduceOp.AVG where the backend has it (nccl), else None: sum then divide."""
    return dist.ReduceOp.AVG if dist.get_backend(group) == "nccl" else None


def _launch(kind: str, tensor_bytes: int, group, launch, divide: torch.Tensor | None, n: int,
            async_op: bool) -> Handle | None:
    TRAFFIC.add(kind, tensor_bytes, group=group_name(group))
    with nvtx_range(kind):
        work = launch()
    finish = (lambda: divide.div_(n)) if divide is not None else None
    handle = Handle(kind, [work], finish)
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, group=None, average: bool = False, async_op: bool = False) -> Handle | None:
    """Sum (or average) `tensor` in place over `group`."""
    n = group_size(group)
    if n == 1:
        return Handle("all_reduce", []) if async_op else None
    op = _avg_op(group) if average else None
    divide = tensor if average and op is None else None
    return _launch("all_reduce", tensor.numel() * tensor.element_size(), group,
                   lambda: dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=True),
                   divide, n, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, average: bool = False,
                   async_op: bool = False) -> Handle | None:
    """Reduce `input` over `group`; group rank r keeps slice r (of output.numel()) in `output`."""
    n = group_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"output {output.numel()} x group size {n}")
    if n == 1:
        output.copy_(input.view_as(output))
        return Handle("reduce_scatter", []) if async_op else None
    op = _avg_op(group) if average else None
    divide = output if average and op is None else None
    return _launch("reduce_scatter", input.numel() * input.element_size(), group,
                   lambda: _reduce_scatter(output, input, op=op or dist.ReduceOp.SUM, group=group, async_op=True),
                   divide, n, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False) -> Handle | None:
    """Concatenate every group rank's `input` into `output` in rank order."""
    n = group_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"input {input.numel()} x group size {n}")
    if n == 1:
        output.copy_(input.view_as(output))
        return Handle("all_gather", []) if async_op else None
    return _launch("all_gather", output.numel() * output.element_size(), group,
                   lambda: _all_gather(output, input, group=group, async_op=True), None, n, async_op)
