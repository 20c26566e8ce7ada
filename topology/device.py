"""Where this process computes: the one rule every package uses for its default device.

The process group decides: nccl (chosen when CUDA is available) runs on the GPU named by
LOCAL_RANK, gloo on the CPU. Before the group exists the rule predicts the device
`init_distributed` will set, so code that picks a device first (`build`, `PipelineModule`)
agrees with the collectives that run later. The rule in one place: a fresh process once got
the CPU here while its nccl group used the GPU, and nothing failed, because gloo twins made
every collective work.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["default_backend", "device_for", "process_device"]


def default_backend() -> str:
    """The backend of the default process group: the initialised one's, else nccl with CUDA, gloo without."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend()
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The compute device of a process on `backend`: cuda:local_rank for nccl, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def process_device(group=None) -> torch.device:
    """This process's device: the GPU nccl uses (for `group`, or the default group), else the CPU.

    Before `init_distributed` it is the device that call will set (cuda:LOCAL_RANK with CUDA).
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) != "nccl":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return device_for(default_backend(), int(os.environ.get("LOCAL_RANK", "0")))
