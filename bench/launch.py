"""The process-group start every spawned benchmark worker shares (gloo on CPU, nccl per GPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_rank(rank: int, world: int, port: int, device: str) -> torch.device:
    """Join a world of `world` processes on localhost:`port`; return this rank's device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # as torchrun sets them (deepspeed.initialize asserts LOCAL_RANK)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def finish_rank() -> None:
    """Leave together: a rank that tears its group down while another still prints aborts gloo."""
    dist.barrier()
    dist.destroy_process_group()
