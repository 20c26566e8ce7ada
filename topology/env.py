"""Start the default process group from the torchrun environment."""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os

import torch
import torch.distributed as dist

from pipezero.topology.device import default_backend


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise the default process group once, the way torchrun expects.

    nccl when CUDA is there, else gloo; the local CUDA device comes from LOCAL_RANK. A
    process started without torchrun becomes a world of one. Safe across
    `torchrun --max-restarts`: a restarted attempt reuses the rendezvous store, where the
    previous attempt's addresses still sit under the same keys, so each attempt's keys go
    under a prefix of its own (TORCHELASTIC_RESTART_COUNT).
    """
    _destroy_at_exit()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(_local_gpu())
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"pipezero/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _local_gpu() -> int:
    """LOCAL_RANK as a visible GPU index, checked before any rendezvous (a peer would wait for this one)."""
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has {count} visible GPU(s): start at most "
                           f"{count} processes per node (torchrun --nproc-per-node {count}), or hide the GPUs "
                           f"(CUDA_VISIBLE_DEVICES=) to run every process on the CPU with gloo")
    return local_rank


@functools.cache
def _destroy_at_exit() -> None:
    """Destroy the process groups at exit while the interpreter is whole (once per process).

    Left to interpreter finalisation, a gloo group's worker threads can still hold finished
    work whose tensors need the GIL, and the process aborts ("terminate called without an
    active exception", exit -6) after a job that trained correctly. A user who already called
    destroy_process_group() makes this a no-op. Reference cycles are collected first: a group
    object held only by a cycle (ZeRO-3's module hooks and their gatherer) keeps its C++ group,
    its gloo threads and rank 0's store thread running past destroy_process_group, until the
    interpreter's final collection, or to exit() itself, where they race the static destructors.
    """
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
