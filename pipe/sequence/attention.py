"""Ulysses attention: all-to-all from sequence shards to head shards around any attention.

Each sequence rank holds a contiguous slice of the sequence (pipe/sequence/batch.py); the
projections before attention and everything after it are per token, so they run on the
slice. Attention mixes tokens: its queries, keys and values go all-to-all to whole sequences
of heads / degree heads each (pipe/sequence/comms.py), the model's own attention runs on
them unchanged (any kernel, mask or window), and its output goes back all-to-all to the
slice with every head (Jacobs et al. 2023, arXiv 2309.14509; DeepSpeed-Ulysses).

Heads: the degree must divide the query heads. Key/value heads (grouped-query attention)
are split the same way when the degree divides them; when there are fewer key/value heads
than the degree, each is replicated degree / kv_heads times before the exchange, so every
rank gets the one its query heads read (as DeepSpeed's ALST does); any other count is refused,
naming both. With a tensor axis these are each tensor rank's heads: the tensor plan splits the
heads first (heads / tensor per tensor rank), Ulysses exchanges those within the sequence group,
so a rank attends heads / (tensor x degree) of them on whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipezero.pipe.sequence.comms import gather_sequence, heads_to_sequence, sequence_to_heads

__all__ = ["Ulysses", "check_heads"]


def check_heads(heads: int, kv_heads: int, degree: int, where: str, tensor: int = 1) -> None:
    """Refuse a sequence degree the attention's heads cannot be split by (pure: every rank raises).

    tensor: the tensor degree that splits the heads first (a tensor plan gives each tensor rank
    heads / tensor query and kv_heads / tensor key/value heads); Ulysses then splits those local
    counts over the sequence group.
    """
    if tensor > 1 and (heads % tensor or kv_heads % tensor):
        raise ValueError(f"{where}: tensor degree {tensor} splits the attention heads first, but {heads} heads "
                         f"and {kv_heads} key/value heads do not both divide by {tensor}; choose a tensor degree "
                         f"that divides {heads} and {kv_heads}")
    local, kv_local = heads // tensor, kv_heads // tensor
    per_rank = f" ({heads} / tensor degree {tensor} per tensor rank)" if tensor > 1 else ""
    kv_per_rank = f" ({kv_heads} / tensor degree {tensor} per tensor rank)" if tensor > 1 else ""
    if local % degree:
        raise ValueError(f"{where}: sequence parallelism of degree {degree} splits the attention heads, but "
                         f"{local} heads{per_rank} do not divide by {degree}; choose a sequence degree that "
                         f"divides {local}")
    if kv_local % degree and degree % kv_local:
        raise ValueError(f"{where}: sequence degree {degree} and {kv_local} key/value heads{kv_per_rank}: one must "
                         f"divide the other (split when the degree divides them, replicated when they divide "
                         f"it); choose a sequence degree that divides {kv_local} or a multiple of it")


@dataclass(frozen=True)
class Ulysses:
    """The sequence group of one attention: how its heads travel."""

    group: Any
    degree: int

    def __call__(self, attend: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """attend(query, key, value, *args, **kwargs) on whole sequences of this rank's heads.

        query [b, heads, s_local, d], key/value [b, kv_heads, s_local, d] -> attend's output,
        which must be [b, s, heads / degree, d] (Hugging Face's layout), back as
        [b, s_local, heads, d]; attend's second result (attention weights) is passed on as is.
        """
        q = sequence_to_heads(query, self.group, self.degree)
        k = sequence_to_heads(self.replicated(key), self.group, self.degree)
        v = sequence_to_heads(self.replicated(value), self.group, self.degree)
        out, extra = attend(q, k, v, *args, **kwargs)
        return heads_to_sequence(out, self.group, self.degree), extra

    def heads_first(self, attend: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The same for an attend that returns [b, heads / degree, s, d] (SDPA's layout): [b, heads, s_local, d]."""
        out, _ = self(lambda q, k, v: (attend(q, k, v, *args, **kwargs).transpose(1, 2), None), query, key, value)
        return out.transpose(1, 2)

    def whole(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a per-token tensor every rank holds a slice of (segment ids, positions)."""
        return gather_sequence(x, self.group, self.degree, dim)

    def replicated(self, kv: torch.Tensor) -> torch.Tensor:
        """Key/value heads repeated up to the degree when there are fewer (each rank reads one)."""
        heads = kv.shape[1]
        return kv if heads % self.degree == 0 else kv.repeat_interleave(self.degree // heads, dim=1)

    def local_heads(self, heads: int, kv_heads: int) -> tuple[int, int]:
        """(query heads, key/value heads) each rank attends with."""
        return heads // self.degree, max(1, kv_heads // self.degree)
