"""Output deallocation (as Megatron-LM does it): an activation sent to the next stage is
kept for backward only as the root of its graph. Unless some backward node saved its
values (tanh saves its output, a residual add does not), they can go as soon as the send is
posted: the tensor keeps its shape and graph, its storage shrinks to one element. The send
holds its own reference to the old storage until it completes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

__all__ = ["saved_storages", "freeable", "free"]


@contextmanager
def saved_storages(watch: bool) -> Iterator[set | None]:
    """The storages autograd saves for backward inside the block (None when not watching)."""
    if not watch:
        yield None
        return
    saved: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(_storage(t))
        return t.detach()  # not t: a saved output would hold its own grad_fn, a cycle never freed
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def freeable(t: torch.Tensor, saved: set | None) -> bool:
    """Whether t's values may be dropped: a plain tensor in the graph that nothing saved, and
    nothing saved was a tensor whose storage we cannot see (then nothing is freed)."""
    if saved is None or None in saved or not (t.requires_grad and t.numel() > 1):  # one element: nothing to free
        return False
    storage = _storage(t)
    return storage is not None and storage not in saved


def free(tensors: Sequence[torch.Tensor]) -> int:
    """Shrink each tensor's storage to one element (shape and graph kept); the bytes freed."""
    freed = 0
    for t in tensors:
        freed += t.numel() * t.element_size()
        t.data = torch.empty((1,), dtype=t.dtype, device=t.device).expand(t.shape)
    return freed


def _storage(t: torch.Tensor) -> int | None:
    """The address of t's memory; None for a tensor without plain storage (a subclass)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None
    return t.untyped_storage().data_ptr()
