"""Tensor-parallel parameters in a checkpoint: whole tensors by global name, sliced again on load.

A checkpoint stores every parameter (and its optimizer state) whole, under the name it has
in the single-process model, so a tensor degree is just another grid axis to reshard
across: saving gathers each split parameter's local parts over its tensor group (every
tensor rank takes part, one rank writes), loading cuts this rank's slice out of the whole
tensor with no communication. A split parameter is a plain tensor marked with a
comm.TensorShard (pipe/tensor_linear.py's Linears) or a DTensor (the styles torch applies).
Simplest correct layout first; a per-shard layout would save the gather at large scale.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipezero.comm import slice_of_whole, tensor_shard, whole_of_shard

__all__ = ["whole", "local_slice", "whole_shape"]


def whole_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor `param` is part of (its own shape when it is not split)."""
    shard = tensor_shard(param)
    return shard.full_shape if shard is not None else param.shape


def whole(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like param's local part) made whole over param's tensor group; collective when split."""
    shard = tensor_shard(param)
    if shard is not None:
        if local.shape != shard.shape or shard.degree == 1:  # a scalar (Adam's step)
            return local
        return whole_of_shard(shard, local)
    if not isinstance(param, DTensor):
        return local
    shard_shape = param.to_local().shape
    if local.shape != shard_shape or shard_shape == param.shape:  # a scalar (Adam's step), or not split
        return local
    dist_local = DTensor.from_local(local.contiguous(), param.device_mesh, param.placements, run_check=False,
                                    shape=param.shape, stride=param.stride())
    return dist_local.full_tensor()


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole tensor shaped like `param`'s whole (the tensor itself when it is plain)."""
    shard = tensor_shard(param)
    if shard is not None:
        return slice_of_whole(shard, full) if full.shape == shard.full_shape else full
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
