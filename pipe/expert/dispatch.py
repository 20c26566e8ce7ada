"""Dropless token dispatch to the experts' ranks and the combine back (the expert all-to-all's plan).

Each token picked top-k experts; its k (token, slot) rows are sorted by expert, so the rows
for rank i's experts are one contiguous block (experts are split evenly, rank i holds experts
[i E/n, (i+1) E/n)). The counts go first (exchange_counts), then the rows; what arrives is,
per source rank, its rows sorted by expert, so each row's local expert is known from the
counts alone. Combining is the reverse exchange, the rows put back in (token, slot) order,
weighed by the router and summed over the k slots, in the order transformers' grouped_mm
experts sum them. Dropless: every row is computed (no capacity factor), as the Hugging Face
families compute them. The steps are public one by one (sort_rows, row_totals, plan_rows,
unpermute) for the overlapped path (pipe/expert/overlap.py), which runs them per half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipezero.pipe.expert.all_to_all import all_to_all_rows, exchange_counts

__all__ = ["Dispatch", "combine", "dispatch", "plan_rows", "row_totals", "sort_rows", "unpermute"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where this rank's (token, slot) rows went and what came here."""

    order: torch.Tensor      # [N k] the (token, slot) rows sorted by expert
    send: list[int]          # rows to each rank of the group
    recv: list[int]          # rows from each rank of the group
    local_ids: torch.Tensor  # [sum(recv)] each received row's expert, local to this rank
    top_k: int


def sort_rows(top_k_index: torch.Tensor, num_experts: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [N, k] -> (the (token, slot) rows sorted by expert [N k], rows per expert [ranks, E / ranks])."""
    ids = top_k_index.reshape(-1)
    order = torch.sort(ids, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.long))  # bincount without its host sync
    return order, counts.view(ranks, num_experts // ranks)


def row_totals(counts: torch.Tensor, arrived: torch.Tensor) -> tuple[list, list]:
    """Rows to and from each rank (summed over the last dim, experts), as lists: one host sync for both."""
    send, recv = torch.stack([counts.sum(-1), arrived.sum(-1)]).tolist()
    return send, recv


def plan_rows(order: torch.Tensor, send: list[int], recv: list[int], arrived: torch.Tensor,
              top_k: int) -> Dispatch:
    """The plan, given the rows each way and `arrived` [source rank, local expert] (no host sync)."""
    ranks, per_rank = arrived.shape
    local_ids = torch.arange(per_rank, device=order.device).repeat(ranks).repeat_interleave(
        arrived.reshape(-1), output_size=sum(recv))
    return Dispatch(order, send, recv, local_ids, top_k)


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
             group: Any) -> tuple[torch.Tensor, Dispatch]:
    """hidden [N, d], top_k_index [N, k] -> (the rows this rank's experts compute, the plan)."""
    order, counts = sort_rows(top_k_index, num_experts, dist.get_world_size(group))
    arrived = exchange_counts(counts, group)  # [source rank, local expert]
    plan = plan_rows(order, *row_totals(counts, arrived), arrived, top_k_index.shape[-1])
    rows = all_to_all_rows(hidden[order // plan.top_k], plan.send, plan.recv, group)
    return rows, plan


def unpermute(back: torch.Tensor, plan: Dispatch, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts' output rows, back on this rank in expert order, to their tokens: [N, d], weighed, summed over k."""
    unsorted = back[torch.argsort(plan.order)]
    weighted = unsorted * top_k_weights.reshape(-1, 1)
    return weighted.view(-1, plan.top_k, back.shape[-1]).sum(dim=1).to(dtype)


def combine(rows: torch.Tensor, plan: Dispatch, top_k_weights: torch.Tensor, group: Any,
            dtype: torch.dtype) -> torch.Tensor:
    """The experts' output rows back to their tokens: [N, d], weighed by the router, summed over k."""
    return unpermute(all_to_all_rows(rows, plan.recv, plan.send, group), plan, top_k_weights, dtype)
