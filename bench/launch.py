"""The process-group start every spawned benchmark worker shares (gloo on CPU, nccl per GPU)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_rank(rank: int, world: int, port: int, device: str, timeout_s: float | None = None) -> torch.device:
    """Join a world of `world` processes on localhost:`port`; return this rank's device
    (timeout_s: the group's collective timeout, torch's default when None)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # as torchrun sets them (deepspeed.initialize asserts LOCAL_RANK)
    if device == "cuda":
        torch.cuda.set_device(rank)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world, timeout=timeout)
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def finish_rank() -> None:
    """Leave together: a rank that tears its group down while another still prints aborts gloo."""
    dist.barrier()
    dist.destroy_process_group()
