"""Checkpoints of a LoRA fine-tune that hold the adapters only, and resume exactly (onto any grid).

A full checkpoint (train/checkpoint/state.py) writes every parameter, frozen ones included: for LoRA that
is the whole base model again at every save, though the base never changes and is rebuilt
from its own checkpoint at start-up. Here the same writer and reader run on a view of the
parts whose module shows only the trainable parameters (same objects, same global names as
PipelineModule gives them): the checkpoint then holds the adapters, their optimizer state
(Adam's m, v and step, ZeRO's shards consolidated), the loss-scale chain, the RNGs, the LR
schedule and the data position, and nothing of the base. Resuming needs the same base
(built as before: hf_layer_specs + lora_specs) and loads everything else.

    save_adapters(parts, "ckpt/", step)      # every rank
    load_adapters(parts, "ckpt/")            # every rank, after building the same base
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch.distributed as dist
from torch import nn

from pipezero.pipe.lora import check_adapters_kept
from pipezero.train.checkpoint.files import checkpoint_meta, checkpoint_names, latest_step, save_checkpoint
from pipezero.train.checkpoint.state import agree_on_load, gather_state, load_state

__all__ = ["load_adapters", "resume_adapters_if_any", "save_adapters"]

_FLAG = "adapters_only"


class _Trainable:
    """A module seen through its trainable parameters only (what train/checkpoint/state.py reads of it)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())


def _view(parts: Any) -> Any:
    view = copy.copy(parts)
    view.module = _Trainable(parts.module)
    return view


def save_adapters(parts: Any, directory: str | os.PathLike, step: int,
                  data_state: Mapping[str, Any] | None = None, *,
                  model_config: Mapping[str, Any] | None = None) -> Path:
    """Save the trainable parameters and the rest of the training state as checkpoint `step` (every rank).

    A stage without adapters (the LM head alone) saves its share, nothing; a model without any is
    refused on every rank. `model_config` (JSON) is recorded for load_adapters to check, as save_state's."""
    if not _anywhere(any(p.requires_grad for p in parts.module.parameters())):
        raise ValueError(f"save_adapters: {type(parts.module).__name__} has no trainable parameter on any rank; "
                         "build it with pipe/lora.py's lora_specs (or use train/checkpoint/state.py's save_state)")
    tensors, meta = gather_state(_view(parts), data_state, step, model_config=model_config)
    meta[_FLAG] = True
    return save_checkpoint(directory, step, tensors, meta, rank=parts.grid.rank,
                           world=parts.grid.world_size, grid=meta["grid"])


def load_adapters(parts: Any, directory: str | os.PathLike, step: int | None = None, *,
                  model_config: Mapping[str, Any] | None = None, optimizer: bool = True) -> dict[str, Any]:
    """Load a save_adapters checkpoint (any grid's) into these parts; the base stays as built. Returns its meta.
    Refused (CheckpointError) when it recorded another `model_config` than this one; `optimizer=False`
    loads the adapters (and schedule) without the optimizer chain's state, as load_state's."""
    if not checkpoint_meta(directory, step).get(_FLAG):
        raise ValueError(f"load_adapters({str(directory)!r}): that checkpoint was not written by save_adapters; "
                         "load a full checkpoint with train/checkpoint/state.py's load_state")
    agree_on_load(_dropped(parts.module, directory, step), parts.grid.world_size)
    return load_state(_view(parts), directory, step, model_config=model_config, optimizer=optimizer)


def _dropped(module: nn.Module, directory: str | os.PathLike, step: int | None) -> str | None:
    """pipe/lora.py's rule of every adapter loader, on the checkpoint's names (the pipeline's): the refusal,
    or None."""
    saved = [k.removeprefix("model/") for k in checkpoint_names(directory, step) if k.startswith("model/")]
    names = [n for n, _ in module.named_parameters()]
    try:
        check_adapters_kept(f"load_adapters({str(directory)!r})", saved, [n for n in names if ".lora_" in n],
                            {n.rpartition(".")[0] for n in names})
    except ValueError as err:
        return str(err)
    return None


def _anywhere(mine: bool) -> bool:
    """Whether `mine` holds on any rank (every rank learns it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return any(every)


def resume_adapters_if_any(parts: Any, directory: str | os.PathLike) -> dict[str, Any] | None:
    """load_adapters of the latest complete checkpoint under `directory`, or None to start fresh."""
    if latest_step(directory) is None:
        return None
    return load_adapters(parts, directory)
