"""NVTX ranges for Nsight Systems, on only while profiling.

`nvtx_range(label)` names a stretch of host time in an `nsys` timeline: the runner wraps each
pipeline action ("0F3"), the collectives each launch ("reduce_scatter") and the optimizer its
step, so the timeline reads like the simulator's picture. Profiling is on with
PIPEZERO_NVTX=1 in the environment or inside `with profiling():`, and only where CUDA is
there (torch.cuda.nvtx needs it). Off, `nvtx_range` returns one shared no-op context and
never formats its label: the hot path pays one flag test.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager, Iterator

import torch

__all__ = ["nvtx_range", "profiling", "profiling_enabled"]

_OFF: ContextManager[None] = contextlib.nullcontext()
_state = {"on": os.environ.get("PIPEZERO_NVTX") == "1" and torch.cuda.is_available()}


class _Range:
    """push on enter, pop on exit; the label is formatted only here."""

    __slots__ = ("label",)

    def __init__(self, label: Any):
        self.label = label

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(str(self.label))

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_pop()


def nvtx_range(label: Any) -> ContextManager[None]:
    """An NVTX range named str(label) while profiling; otherwise a no-op that leaves label untouched."""
    return _Range(label) if _state["on"] else _OFF


def profiling_enabled() -> bool:
    """Whether NVTX ranges are being emitted now."""
    return _state["on"]


@contextlib.contextmanager
def profiling(on: bool = True) -> Iterator[None]:
    """Emit NVTX ranges inside the block (where CUDA is available); the previous setting after it."""
    before = _state["on"]
    _state["on"] = bool(on) and torch.cuda.is_available()
    try:
        yield
    finally:
        _state["on"] = before
