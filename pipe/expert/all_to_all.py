"""The expert all-to-all: rows of a tensor to the ranks of a group, variable counts, with autograd.

Row block i of the input goes to rank i of `group`; the output is the blocks every rank sent
here, in rank order. Its backward is the same exchange the other way round (the gradients of
the received rows go back to their senders), as in Megatron-core's and torchtitan's token
dispatch. `exchange_counts` tells each rank how many rows it will receive (an all-to-all of
the counts themselves), so both directions know their sizes before any row moves. While a relay runs
(pipe/expert/relay.py: PipelineRunner(overlap_pairs=True), which refuses compiled layers) the rows travel
through in_flight.InFlight, launched and waited for at once: the launch is where the pair's other
micro-batch runs before the wait; elsewhere the exchange is one blocking call, traced into a compiled layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipezero.pipe.expert.in_flight import InFlight
from pipezero.pipe.expert.relay import relay_running

__all__ = ["all_to_all_rows", "exchange_counts"]


def exchange_counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    """send[i, ...]: what this rank sends to rank i; returns recv[i, ...]: what rank i sends here."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """One all-to-all, waited for: under a relay (a pair's turns) launched through InFlight, whose launch hands
    the turn over; elsewhere one blocking call, which a compiled layer traces."""
    if relay_running():
        flight = InFlight(send, recv, group)
        flight.start(rows)
        return flight.finish()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """rows [sum(send), ...] -> [sum(recv), ...]: send[i] rows to rank i, recv[i] rows from rank i."""
    return _AllToAllRows.apply(rows, send, recv, group)
