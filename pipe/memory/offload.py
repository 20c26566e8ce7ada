"""Checkpointed layer inputs kept in pinned host memory, brought back ahead of their backward.

With activation checkpointing a layer's forward keeps only its inputs for backward; at long
sequences those inputs (one [batch, seq, hidden] tensor per checkpointed run of layers) are what
is left on the device. Here they move to pinned host memory as the forward makes them (DeepSpeed's
`cpu_checkpointing`; Rajbhandari et al. 2021, ZeRO-Infinity's activation offload; Korthikanti et al.
2022 count what is kept). The copies run on a side stream: the D2H copy overlaps the next layer's
forward; in backward, when a run's recompute unpacks its inputs, the H2D copy of the run before it
starts, so it overlaps this run's recompute and backward, and the compute stream waits only on an
event. On CPU there is no stream: the "host copy" is a copy, and the same code runs.

What moves: the tensors that torch.utils.checkpoint keeps as a run's inputs (its saved inputs pass
through saved_tensors_hooks set around the checkpoint call, while everything saved inside the run
goes to the checkpoint's own hooks), and of those only the ones that require a gradient (the hidden
states); masks, positions and token ids are shared by the layers or tiny, and stay where they are.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["HostOffload"]


class _Stashed:
    """One tensor's host copy; its device copy once prefetched (dropped after each unpack)."""

    def __init__(self, t: torch.Tensor, stream: "torch.cuda.Stream | None"):
        self.device, self.stream = t.device, stream
        self.on_device: torch.Tensor | None = None
        self.ready: "torch.cuda.Event | None" = None
        if stream is None:  # CPU (or a tensor on the host already): a plain copy, same code path
            self.host = t.detach().clone()
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by the compute stream
        with torch.cuda.stream(stream):
            self.host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator keeps t's block until the copy is done

    def prefetch(self) -> None:
        """Start the H2D copy on the side stream (allocated on the compute stream, which uses it)."""
        if self.stream is None or self.on_device is not None:
            return
        compute = torch.cuda.current_stream(self.device)
        self.on_device = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self.on_device.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def fetch(self) -> torch.Tensor:
        """The tensor back where it was made; the compute stream waits for its copy only."""
        if self.stream is None:
            return self.host
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self.ready)
        out, self.on_device, self.ready = self.on_device, None, None  # a second recompute copies again
        return out


class _Run:
    """The inputs one checkpointed run offloaded; `before` is the run its backward comes to next."""

    def __init__(self, before: "_Run | None", on_host: bool = True):
        self.before, self.stashed, self.on_host = before, [], on_host

    def prefetch(self) -> None:
        for s in self.stashed:
            s.prefetch()


class HostOffload:
    """The offload of one module's checkpointed runs: `begin()` at each forward, then each
    checkpoint call inside `run()`. One side stream per device, made on first use."""

    def __init__(self) -> None:
        self._last: weakref.ref[_Run] | None = None  # weak: the graph keeps a forward's runs, not this
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.offloaded_bytes = 0  # what went to the host since construction (tests and logs read it)

    def begin(self) -> None:
        """A new forward (a chunk and microbatch): its first run prefetches nothing before it."""
        self._last = None

    @contextmanager
    def run(self, on_host: bool = True) -> Iterator[None]:
        """Around one torch.utils.checkpoint call: its saved inputs go to the host (on_host False: they
        stay, and its backward starts the copy of the run before it, as an offloaded run's does)."""
        current = _Run(self._last() if self._last is not None else None, on_host)
        self._last = weakref.ref(current)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(current, t), self._unpack):
            yield

    def _pack(self, run: _Run, t: torch.Tensor) -> object:
        if not t.requires_grad:  # a mask, cos/sin, token ids: shared or small, left in place
            return t
        if not run.on_host:
            return (run, t)
        stashed = _Stashed(t, self._stream(t.device))
        run.stashed.append(stashed)
        self.offloaded_bytes += t.numel() * t.element_size()
        return (run, stashed)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        run, stashed = packed
        out = stashed if isinstance(stashed, torch.Tensor) else stashed.fetch()
        if run.before is not None:  # the next run backward reaches: its copy overlaps this one's
            run.before.prefetch()
        return out

    def _stream(self, device: torch.device) -> "torch.cuda.Stream | None":
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
