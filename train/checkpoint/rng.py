"""Every process's random number streams, saved into its own checkpoint file and restored on resume.

torch's CPU (and CUDA) generators and Python's `random`, as tensors under a prefix, so each rank
continues its own stream (a per-rank shuffle) after a resume on the same grid.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["rng_state", "set_rng_state"]

def rng_state(prefix: str = "rng.") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states: torch CPU (and CUDA) and Python's `random` as tensors, its version as JSON.

    Python's state is a tensor too, so that it goes into this rank's file: a checkpoint's JSON meta is
    rank 0's alone, and every rank continues its own stream (e.g. a per-rank shuffle).
    """
    import random

    tensors = {prefix + "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[prefix + "torch_cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    tensors[prefix + "python"] = torch.tensor(state, dtype=torch.int64)
    tensors[prefix + "python_gauss"] = torch.tensor([] if gauss is None else [gauss], dtype=torch.float64)
    return tensors, {"python_version": version}


def set_rng_state(tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any], prefix: str = "rng.") -> None:
    """Restore what rng_state() returned (or the JSON Python state that older checkpoints hold)."""
    import random

    torch.set_rng_state(tensors[prefix + "torch_cpu"])
    if prefix + "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[prefix + "torch_cuda"])
    if prefix + "python" in tensors:
        gauss = tensors[prefix + "python_gauss"].tolist()
        random.setstate((state["python_version"], tuple(tensors[prefix + "python"].tolist()),
                         gauss[0] if gauss else None))
    else:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
