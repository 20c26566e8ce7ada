"""Bucketed collectives: many tensors, few large asynchronous operations.

Tensors are flattened into buckets of at most `bucket_bytes`, grouped by dtype and device
(a tensor larger than a bucket gets a bucket of its own), one asynchronous collective per
bucket. For reduce-scatter and all-gather a bucket's flat concatenation is padded to a
multiple of the group size and split into equal contiguous slices; group rank r owns slice r.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipezero.comm.collectives import Handle, all_gather, all_reduce, group_size, reduce_scatter

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


def _flatten(tensors: Sequence[torch.Tensor], pad_to: int = 1) -> torch.Tensor:
    numel = sum(t.numel() for t in tensors)
    padded = -(-numel // pad_to) * pad_to
    flat = torch.zeros(padded, dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return flat


def _write_region(tensors: Sequence[torch.Tensor], values: torch.Tensor, lo: int) -> None:
    """Copy values (the flat range [lo, lo + len)) back into the tensors it overlaps."""
    hi, offset = lo + values.numel(), 0
    for t in tensors:
        a, b = max(lo, offset), min(hi, offset + t.numel())
        if a < b:
            t.view(-1)[a - offset:b - offset].copy_(values[a - lo:b - lo])
        offset += t.numel()


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         average: bool = False) -> Handle:
    """Sum (or average) every tensor over `group`; wait() writes the results back."""
    handles = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = _flatten(members)
        work = all_reduce(flat, group, average, async_op=True)
        handles.append(Handle("", [work], lambda m=members, f=flat: _write_region(m, f, 0)))
    return Handle("", handles)


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group=None,
                             bucket_bytes: int = DEFAULT_BUCKET_BYTES, average: bool = False) -> Handle:
    """Reduce every tensor over `group`; wait() writes this rank's owned region of each bucket."""
    n, rank = group_size(group), _group_rank(group)
    handles = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = _flatten(members, n)
        out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
        work = reduce_scatter(out, flat, group, average, async_op=True)
        handles.append(Handle("", [work], lambda m=members, o=out: _write_region(m, o, rank * o.numel())))
    return Handle("", handles)


def all_gather_coalesced(tensors: Sequence[torch.Tensor], group=None,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Handle:
    """Fill every tensor from the region each group rank owns; wait() writes them back."""
    n, rank = group_size(group), _group_rank(group)
    handles = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = _flatten(members, n)
        shard = flat.numel() // n
        mine = flat[rank * shard:(rank + 1) * shard].clone()
        work = all_gather(flat, mine, group, async_op=True)
        handles.append(Handle("", [work], lambda m=members, f=flat: _write_region(m, f, 0)))
    return Handle("", handles)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_initialized() else 0
