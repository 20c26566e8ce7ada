"""Bucketed all-reduce: many tensors, few large asynchronous operations.

Tensors are flattened into buckets of at most `bucket_bytes`, grouped by dtype and device
(a tensor larger than a bucket gets a bucket of its own), one asynchronous all-reduce per
bucket (pipe/module.py sums tied weights' gradients with it).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipezero.comm.collectives import Handle, all_reduce

DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` per bucket, in order, grouped by (dtype, device)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be a positive number of bytes")
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        members, used = open_buckets.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            done.append(members)
            members, used = [], 0
        open_buckets[key] = (members + [i], used + size)
    done.extend(members for members, _ in open_buckets.values() if members)
    return sorted(done, key=lambda b: b[0])


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return flat


def _unflatten(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy `flat` (the concatenation of `tensors`) back into them."""
    offset = 0
    for t in tensors:
        t.view(-1).copy_(flat[offset:offset + t.numel()])
        offset += t.numel()


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         average: bool = False) -> Handle:
    """Sum (or average) every tensor over `group`; wait() writes the results back."""
    handles = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = _flatten(members)
        work = all_reduce(flat, group, average, async_op=True)
        handles.append(Handle("", [work], lambda m=members, f=flat: _unflatten(m, f)))
    return Handle("", handles)
