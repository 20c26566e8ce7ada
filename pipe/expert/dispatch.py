"""Dropless token dispatch to the experts' ranks and the combine back (the expert all-to-all's plan).

Each token picked top-k experts; its k (token, slot) rows are sorted by expert, so the rows
for rank i's experts are one contiguous block (experts are split evenly, rank i holds experts
[i E/n, (i+1) E/n)). The counts go first (exchange_counts), then the rows; what arrives is,
per source rank, its rows sorted by expert, so each row's local expert is known from the
counts alone. Combining is the reverse exchange, the rows put back in (token, slot) order,
weighed by the router and summed over the k slots, in the order transformers' grouped_mm
experts sum them. Dropless: every row is computed (no capacity factor), as the Hugging Face
families compute them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipezero.pipe.expert.all_to_all import all_to_all_rows, exchange_counts

__all__ = ["Dispatch", "combine", "dispatch"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where this rank's (token, slot) rows went and what came here."""

    order: torch.Tensor      # [N k] the (token, slot) rows sorted by expert
    send: list[int]          # rows to each rank of the group
    recv: list[int]          # rows from each rank of the group
    local_ids: torch.Tensor  # [sum(recv)] each received row's expert, local to this rank
    top_k: int


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
             group: Any) -> tuple[torch.Tensor, Dispatch]:
    """hidden [N, d], top_k_index [N, k] -> (the rows this rank's experts compute, the plan)."""
    ranks = dist.get_world_size(group)
    per_rank = num_experts // ranks
    ids = top_k_index.reshape(-1)
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=num_experts).view(ranks, per_rank)  # rows per expert, by rank
    arrived = exchange_counts(counts, group)  # [source rank, local expert]
    plan = Dispatch(order, counts.sum(1).tolist(), arrived.sum(1).tolist(),
                    torch.arange(per_rank, device=ids.device).repeat(ranks).repeat_interleave(arrived.reshape(-1)),
                    top_k_index.shape[-1])
    rows = all_to_all_rows(hidden[order // plan.top_k], plan.send, plan.recv, group)
    return rows, plan


def combine(rows: torch.Tensor, plan: Dispatch, top_k_weights: torch.Tensor, group: Any,
            dtype: torch.dtype) -> torch.Tensor:
    """The experts' output rows back to their tokens: [N, d], weighed by the router, summed over k."""
    back = all_to_all_rows(rows, plan.recv, plan.send, group)
    unsorted = back[torch.argsort(plan.order)]
    weighted = unsorted * top_k_weights.reshape(-1, 1)
    return weighted.view(-1, plan.top_k, rows.shape[-1]).sum(dim=1).to(dtype)
