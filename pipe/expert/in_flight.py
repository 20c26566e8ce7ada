"""The expert all-to-all as two autograd nodes, launch and wait, so that compute runs while rows travel.

    flight = launch_rows(rows, send, recv, group)   # started, not finished: rows [sum(send), ...]
    ...                                             # other work (the other half's experts)
    out = wait_rows(flight)                         # [sum(recv), ...], as all_to_all_rows gives it

Forward: launch_rows starts an async all_to_all_single and returns an `InFlight` (the exchange, its
buffers kept alive until the wait); wait_rows waits and returns the received rows. Backward runs
the same pair the other way round: the wait node's backward LAUNCHES the reverse exchange (the
received rows' gradients back to their senders) and the launch node's backward WAITS for it and
returns the rows' gradient. Between the two, the autograd engine runs whatever else is ready.

Why work overlaps the exchange:
* on a GPU (NCCL): the collective is queued on NCCL's own stream, after the compute stream's work so
  far; Work.wait() makes the compute stream wait for it (a stream event), it does not block the host.
  So the host goes on queueing kernels (the other half's experts) that run while NCCL moves the rows.
* on CPU (gloo): gloo's worker threads send and receive while this thread computes; Work.wait() blocks
  this thread until they are done.
* in backward: the engine runs the ready node created last first (its sequence number), so after a
  wait node's backward has launched one half's reverse exchange, the other half's later-made nodes (its
  expert backward) run before the launch node's backward waits (pipe/expert/overlap.py orders them).

Across micro-batches: under PipelineRunner(overlap_pairs=True) a launch is where a DualPipeV pair's
forward and backward take turns (pipe/expert/relay.py): the other micro-batch's work runs until its own
launch, then this one waits. Under a relay the serial path (all_to_all.py) exchanges through InFlight
too, so its launches are switch points as well.

The exchange drops its buffers at each wait, so no reference cycle (a node's context holding its own
output) keeps a received tensor alive. An exchange is started at most once before its wait.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipezero.pipe.expert.relay import hand_over

__all__ = ["InFlight", "launch_rows", "wait_rows"]


class InFlight:
    """One all-to-all of rows over a group: its splits (send[i] rows to rank i, recv[i] from rank i) and, while
    it travels, its work and both buffers."""

    def __init__(self, send: list[int], recv: list[int], group: Any):
        self.send, self.recv, self.group = send, recv, group
        self._work: Any = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, rows: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """Start the exchange of `rows` (the other way round when `reverse`); returns the buffer it fills."""
        assert self._work is None, "an expert all-to-all started twice before its wait"
        out_splits, in_splits = (self.send, self.recv) if reverse else (self.recv, self.send)
        rows = rows.contiguous()
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        self._work = dist.all_to_all_single(out, rows, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                            group=self.group, async_op=True)
        self._buffers = rows, out  # the sent rows must live until the exchange has read them
        hand_over()  # under a relay (a DualPipeV pair), the other micro-batch computes while these travel
        return out

    def finish(self) -> torch.Tensor:
        """Wait for the exchange started last; returns what it received."""
        assert self._work is not None, "an expert all-to-all waited on before its start"
        self._work.wait()
        out = self._buffers[1]
        self._work = self._buffers = None
        return out


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.start(rows)

    @staticmethod
    def backward(ctx: Any, placeholder: torch.Tensor) -> tuple:
        return ctx.flight.finish(), None  # the reverse exchange _Wait.backward started: the rows' gradient


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        flight.finish()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.flight.start(grad, reverse=True)
        return grad, None  # a placeholder of the buffer's shape: _Launch.backward returns what arrives


def launch_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> tuple[torch.Tensor, InFlight]:
    """Start sending rows [sum(send), ...]: send[i] rows to rank i, recv[i] rows from rank i; returns what
    wait_rows takes (the buffer being filled, with its autograd node, and the exchange)."""
    flight = InFlight(send, recv, group)
    return _Launch.apply(rows, flight), flight


def wait_rows(launched: tuple[torch.Tensor, InFlight]) -> torch.Tensor:
    """The rows received by an exchange launch_rows started: [sum(recv), ...]."""
    return _Wait.apply(*launched)
