"""Tensor-parallel parameters in a checkpoint: whole tensors by global name, sliced again on load.

A checkpoint stores every parameter (and its optimizer state) whole, under the name it has
in the single-process model, so a tensor degree is just another grid axis to reshard
across: saving gathers each DTensor's local shards over its tensor group (every tensor rank
takes part, one rank writes), loading cuts this rank's slice out of the whole tensor by the
parameter's placements, with no communication. Simplest correct layout first; a per-shard
layout would save the gather at large scale.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["whole", "local_slice"]


def whole(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like param's local shard) made whole over param's mesh; collective for a DTensor."""
    if not isinstance(param, DTensor):
        return local
    shard_shape = param.to_local().shape
    if local.shape != shard_shape or shard_shape == param.shape:  # a scalar (Adam's step), or not split
        return local
    dist_local = DTensor.from_local(local.contiguous(), param.device_mesh, param.placements, run_check=False,
                                    shape=param.shape, stride=param.stride())
    return dist_local.full_tensor()


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole tensor shaped like `param` (the tensor itself when it is plain)."""
    if not isinstance(param, DTensor) or full.shape != param.shape:
        return full
    coords = param.device_mesh.get_coordinate()
    for axis, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            full = full.chunk(param.device_mesh.size(axis), dim=placement.dim)[coords[axis]]
        elif not isinstance(placement, Replicate):
            raise ValueError(f"checkpoint: a parameter placed {placement} cannot be sliced; "
                             "expected Shard or Replicate placements")
    return full
