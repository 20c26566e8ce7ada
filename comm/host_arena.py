"""Host buffers for the offloads' copies: one allocation cut into tensors, pinned at its own size.

A copy between the GPU and the host overlaps other work only from page-locked (pinned) host memory.
torch's pinned allocator (CachingHostAllocator, behind torch.empty(..., pin_memory=True) and
Tensor.pin_memory()) rounds every block up to the next power of two bytes and keeps it for reuse: a
1.2 GB buffer takes 2 GiB, and one block per ZeRO bucket wastes up to half of each. One block for
all buckets would round once, but the whole: TinyLlama's 4.4 GB of fp32 masters would take 8.6.

So an arena here is one plain host allocation, page-locked where it lies (cudaHostRegister: torch's
checkpoint stager pins its staging storages the same way), which takes its bytes and no more: the
buffers are views of it, each starting at a page boundary (ALIGN), and the pinned range is whole pages
of its own (one page more is allocated to start on a boundary: no other allocation shares a pinned
page, which CUDA would refuse to register twice). It is unregistered when its storage is freed (the
last view gone), after the device has finished what it queued.

Where the driver cannot register host memory (an error other than out of memory: a virtualised GPU may
refuse it) the arena is one block of torch's pinned allocator instead, rounded, said once in the log.
Without CUDA (or `pin=False`) the same views of the same allocation are made, unpinned: the CPU tests
run this code.
"""

from __future__ import annotations

import logging
import weakref
from typing import Sequence

import torch

__all__ = ["ALIGN", "arena_bytes", "arena_layout", "host_arena"]

ALIGN = 4096   # bytes: each buffer starts on a page of its own
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation
_WARNED: list[int] = []  # the first registration error, said once
log = logging.getLogger(__name__)


def arena_layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each buffer of `nbytes` starts in one arena (a multiple of ALIGN), and the bytes the arena
    allocates: its whole pages and one more, to start on a page boundary (none when it holds nothing)."""
    offsets, end = [], 0
    for n in nbytes:
        if n < 0:
            raise ValueError(f"arena_layout: a buffer of {n} bytes; sizes are >= 0")
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + n
    return offsets, (-(-end // ALIGN) + 1) * ALIGN if end else 0


def arena_bytes(nbytes: Sequence[int]) -> int:
    """Host bytes one arena of these buffers takes (what the planner counts)."""
    return arena_layout(nbytes)[1]


def host_arena(specs: Sequence[tuple[int, torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """1-D host tensors of (numel, dtype) each, views of one allocation, page-locked when `pin`."""
    sizes = [numel * dtype.itemsize for numel, dtype in specs]
    offsets, total = arena_layout(sizes)
    allocation = torch.empty(total, dtype=torch.uint8)
    skip = -allocation.data_ptr() % ALIGN
    pages = allocation[skip:skip + max(total - ALIGN, 0)]   # whole pages, all ours
    if pin and total and not _pin(pages):
        pages = _pinned_block(pages.nbytes)
    return [pages[o:o + n].view(dtype) for o, n, (_, dtype) in zip(offsets, sizes, specs)]


def _pin(pages: torch.Tensor) -> bool:
    """Page-lock the arena's pages where they lie and unlock them when its storage is freed: True; False
    where this CUDA cannot register host memory (a virtualised driver may not)."""
    ptr, nbytes = pages.data_ptr(), pages.nbytes
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if error == _OUT_OF_MEMORY:
        raise RuntimeError(f"pinning {nbytes} bytes of host memory (cudaHostRegister) failed with CUDA error "
                           f"{error}: the host cannot lock that much; offload less (offload_optimizer, "
                           "the checkpointed inputs) or use a host with more memory per GPU")
    if error != 0:
        if not _WARNED:
            _WARNED.append(error)
            log.warning("cudaHostRegister failed with CUDA error %d: the offloads' host arenas come from "
                        "torch's pinned allocator instead (each rounded up to a power of two bytes)", error)
        return False
    done = weakref.finalize(pages.untyped_storage(), _unpin, ptr)
    done.atexit = False  # at exit the CUDA context may be gone; the process's pages go with it
    return True


def _pinned_block(nbytes: int) -> torch.Tensor:
    """One block of torch's pinned allocator (page-aligned, rounded up to a power of two bytes)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _unpin(ptr: int) -> None:
    """Unlock a freed arena once nothing the device queued can still read or write it."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(ptr)  # an error leaves the pages locked until exit: no harm
