"""The batch split: each sequence rank takes one contiguous slice of every sequence.

Whatever depends on the whole sequence is computed on it before the split: the position ids
(for packed documents they restart per document, also where a document crosses a slice
boundary: the data's positions, sliced) and the next-token labels (shifted on the whole
sequence, so a slice's last label is the next slice's first token). Each slice then flows
through the pipeline as the whole sequence would (the activations that cross stages shrink by
the degree), and only attention sees the rest (pipe/sequence/attention.py).

    ids = batch                                       # [B, T], the same on every sequence rank
    inputs = (ids, None, whole_positions(ids))        # Hugging Face layers: (ids, mask, positions)
    inputs, labels = shard_batch(inputs, next_token_labels(ids), grid)
    runner.train_step(inputs, labels)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["next_token_labels", "shard_batch", "shard_sequence", "whole_positions"]

IGNORE_INDEX = -100


def whole_positions(ids: torch.Tensor) -> torch.Tensor:
    """0 .. T-1 for every row of ids [B, T] (computed before the split: the slices keep them)."""
    return torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape).contiguous()


def next_token_labels(ids: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels[t] = ids[t + 1], the last position untrained: on the whole sequence, before the split."""
    labels = torch.full_like(ids, ignore_index)
    labels[..., :-1] = ids[..., 1:]
    return labels


def shard_sequence(x: Any, rank: int, degree: int, dim: int = 1) -> Any:
    """Slice `rank` of `degree` of every tensor with a sequence dim (`dim`) in x (a tensor, tuple or list;
    None and tensors without that dim, such as a per-row scale [B], pass as they are)."""
    if x is None or degree == 1:
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(shard_sequence(t, rank, degree, dim) for t in x)
    if not isinstance(x, torch.Tensor) or x.dim() <= dim:
        return x
    length = x.shape[dim]
    if length % degree:
        raise ValueError(f"a sequence of {length} tokens (tensor {tuple(x.shape)}, dim {dim}) does not split into "
                         f"{degree} equal slices for sequence parallelism; pad it to a multiple of {degree}")
    step = length // degree
    return x.narrow(dim, rank * step, step)


def shard_batch(inputs: Any, targets: Any, grid: Any) -> tuple[Any, Any]:
    """(inputs, targets) of this sequence rank: every [B, T, ...] tensor sliced along T."""
    rank, degree = grid.sequence_rank, grid.sequence_size
    return shard_sequence(inputs, rank, degree), shard_sequence(targets, rank, degree)
