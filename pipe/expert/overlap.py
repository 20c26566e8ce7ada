"""The expert all-to-all hidden behind expert compute: a MoE layer's tokens in two halves, in flight together.

The serial path (block.py) waits for every exchange: counts, rows out, experts, rows back. Here the
layer's token rows are cut in two halves, A (the first N // 2) and B (the rest), and each half's
rows travel while the other half's experts compute:

  1. one counts exchange for both halves ([ranks, 2, E / ranks] in one all_to_all_single) and one host
     sync for both halves' row totals (a second sync, after a launch, would wait for A's rows);
  2. launch A's rows, launch B's rows (async, pipe/expert/in_flight.py);
  3. wait A; experts on A (B's rows still travelling); launch A's outputs back;
  4. wait B; experts on B (A's outputs travelling); launch B's outputs back;
  5. wait A's, weigh and sum A's tokens; wait B's, the same for B; the halves concatenated in token order.

Backward overlaps too: each wait node's backward launches the reverse exchange and its launch node's
backward waits, and the engine runs B's later-made nodes first: B's outputs' gradients are launched
back, then A's, B's expert backward runs while A's travel, B's rows' gradients are launched, A's expert
backward runs while they travel. Each token's rows are computed by the same expert code as on the
serial path; only an expert's weight gradient sums its rows in two parts (fp32: within 1e-6).
On a GPU the gain is the exchange time the other half's experts cover (bench/moe_multi.py's "a2a hidden");
each half's GEMMs are half as tall. What SGLang calls two-batch overlap, as DeepSeek
describes it for its inference (DeepSeek-V3 technical report, 2024, 3.4: two micro-batches in flight;
DeepEP's kernels); Megatron-core overlaps across micro-batches instead.
Every rank of the group takes this path when overlap is on (a half may be empty: a micro-batch of one
token sends nothing for A), so the ranks always make the same collectives (a serial path for a tiny
micro-batch, chosen on each rank by its own token count, would hang a group whose ranks hold different
counts). Inside a compiled layer (pipe/compile.py) this function runs eagerly, the experts' GEMMs too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from pipezero.pipe.expert.all_to_all import exchange_counts
from pipezero.pipe.expert.dispatch import Dispatch, plan_rows, row_totals, sort_rows, unpermute
from pipezero.pipe.expert.in_flight import launch_rows, wait_rows

__all__ = ["overlapped"]

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, their local expert ids) -> output rows


def _plans(top_k_index: torch.Tensor, halves: list[slice], num_experts: int, group: Any) -> list[Dispatch]:
    """Both halves' plans from one counts exchange and one host sync."""
    ranks, top_k = dist.get_world_size(group), top_k_index.shape[-1]
    routed = [sort_rows(top_k_index[half], num_experts, ranks) for half in halves]
    counts = torch.stack([c for _, c in routed], dim=1)  # [ranks, half, local expert]
    arrived = exchange_counts(counts, group)  # [source rank, half, local expert]
    send, recv = row_totals(counts, arrived)  # [rank][half]
    return [plan_rows(order, [s[i] for s in send], [r[i] for r in recv], arrived[:, i], top_k)
            for i, (order, _) in enumerate(routed)]


@torch.compiler.disable  # a compiled layer (pipe/compile.py) runs this eagerly, a graph break: host lists, handles
def overlapped(experts: Experts, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               num_experts: int, group: Any) -> torch.Tensor:
    """hidden [N, d], top_k_index and top_k_weights [N, k] -> [N, d]: what dispatch, experts and combine give,
    each half's exchanges in flight while the other half's experts compute."""
    cut = hidden.shape[0] // 2
    halves = [slice(0, cut), slice(cut, hidden.shape[0])]
    plans = _plans(top_k_index, halves, num_experts, group)
    going = [launch_rows(hidden[half][plan.order // plan.top_k], plan.send, plan.recv, group)
             for half, plan in zip(halves, plans)]  # both halves' rows in flight
    coming = [launch_rows(experts(wait_rows(rows), plan.local_ids), plan.recv, plan.send, group)
              for rows, plan in zip(going, plans)]  # B's rows travel during A's experts, A's outputs during B's
    return torch.cat([unpermute(wait_rows(back), plan, top_k_weights[half], hidden.dtype)
                      for back, plan, half in zip(coming, plans, halves)])
