"""The expert all-to-all: rows of a tensor to the ranks of a group, variable counts, with autograd.

Row block i of the input goes to rank i of `group`; the output is the blocks every rank sent
here, in rank order. Its backward is the same exchange the other way round (the gradients of
the received rows go back to their senders), as in Megatron-core's and torchtitan's token
dispatch. `exchange_counts` tells each rank how many rows it will receive (an all-to-all of
the counts themselves), so both directions know their sizes before any row moves. The rows travel
through in_flight.InFlight, launched and waited for at once: the launch is where a relay
(pipe/expert/relay.py) lets another micro-batch run before the wait (eager inside a compiled layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipezero.pipe.expert.in_flight import InFlight

__all__ = ["all_to_all_rows", "exchange_counts"]


def exchange_counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    """send[i, ...]: what this rank sends to rank i; returns recv[i, ...]: what rank i sends here."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.flight = flight = InFlight(send, recv, group)
        flight.start(rows)  # a switch point under a relay (a DualPipeV pair's other side runs meanwhile)
        return flight.finish()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.flight.start(grad, reverse=True)
        return ctx.flight.finish(), None, None, None


@torch.compiler.disable  # a compiled layer runs the exchange eagerly: its launch may hand over (relay.py)
def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """rows [sum(send), ...] -> [sum(recv), ...]: send[i] rows to rank i, recv[i] rows from rank i."""
    return _AllToAllRows.apply(rows, send, recv, group)
