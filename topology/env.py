"""Start the default process group from the torchrun environment."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise the default process group once, the way torchrun expects.

    nccl when CUDA is there, else gloo; the local CUDA device comes from LOCAL_RANK.
    A process started without torchrun becomes a world of one.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
