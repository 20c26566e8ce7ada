"""Export a pipeline built by hf_layer_specs back to the Hugging Face layout.

A model fine-tuned here must go back to the tools that read Hugging Face checkpoints:
`AutoModelForCausalLM.from_pretrained(directory)`. Each pipeline stage writes its own
layers, under the model's own parameter names, as one shard
(`model-0000k-of-0000n.safetensors`, or `model.safetensors` for one stage), so no rank ever
holds the whole model; rank 0 writes the shard index and the config. Tensor-parallel
weights are gathered whole first; a tied embedding is written once (from_pretrained ties
the head to it again). Under ZeRO-3 (a model passed as module=) pass the optimizer
(`export_hf(model, dir, optimizer=opt)` gathers the parameters itself) or call it inside
`with gathered(opt):`; a parameter still partitioned is a ValueError on every rank, never an
empty tensor in the file (`whole_weights`: that rule, for every exporter, lora_export.py's too).
Weight files of an earlier export of another layout in the same directory (a model.safetensors
beside new shards, shards of another stage count) are removed, the one that from_pretrained
would read first before the new files are written.

    export_hf(model, "out/")    # every rank calls it
    AutoModelForCausalLM.from_pretrained("out/")
"""

from __future__ import annotations

import copy
import json
import os
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipezero.pipe.hf import hf_config, hf_shapes, hf_state_dict

__all__ = ["export_hf", "whole_weights"]


def export_hf(module: nn.Module, directory: str | os.PathLike, dtype: torch.dtype | None = None,
              optimizer: Any = None) -> Path:
    """Write `module` (a PipelineModule or any module of hf_layer_specs layers) as a Hugging Face checkpoint.

    Every rank calls it (tensor-parallel weights are gathered over the tensor group); the
    ranks of data and tensor coordinate 0 write one shard per pipeline stage. `optimizer`: the
    ZeroOptimizer (or its chain) of a ZeRO-3 model, whose parameters are gathered for the write, or
    of one with delayed_param_update, whose update still in flight is applied first (without it the
    file misses the last step's update: call opt.apply_delayed_update() before). Returns the directory.
    """
    with whole_weights(module, optimizer, "export_hf"):
        return _export(module, Path(directory), dtype)


@contextmanager
def whole_weights(module: nn.Module, optimizer: Any, caller: str) -> Iterator[None]:
    """Inside the block every parameter of `module` is whole, for an exporter (`caller`) to read.

    `optimizer`, a ZeroOptimizer: its delayed update is applied and its stage-3 partitions gathered
    for the block. Without it (or with another optimizer, whose parameters are whole), a parameter
    still partitioned (ZeRO-3 released it: 0 elements) is the same ValueError on every rank,
    naming the fix, before anything is written (a collective over the world).
    """
    from pipezero.zero import ZeroOptimizer, gathered

    zero = optimizer if isinstance(optimizer, ZeroOptimizer) else None
    if zero is not None:  # delayed_param_update: the last step's update is not yet in the model
        zero.apply_delayed_update()
    with gathered(zero) if zero is not None else nullcontext():
        _refuse_partitioned(module, caller)
        yield


def _refuse_partitioned(module: nn.Module, caller: str) -> None:
    """A parameter of 0 elements on any rank (a ZeRO-3 partition released): a ValueError on every rank."""
    mine = [n for n, p in module.named_parameters() if (p.to_local() if isinstance(p, DTensor) else p).numel() == 0]
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    found = sorted({n for part in every for n in part})
    if found:
        raise ValueError(f"{caller}: {len(found)} parameters are not whole, e.g. {found[:3]} (a ZeRO-3 partition "
                         f"released); pass the optimizer, {caller}(model, dir, ..., optimizer=opt), or call it "
                         f"inside `with gathered(opt):`")


def _export(module: nn.Module, directory: Path, dtype: torch.dtype | None) -> Path:
    state = {name: t.to(dtype) if dtype is not None else t for name, t in hf_state_dict(module).items()}
    _check_whole(module, state)
    grid = getattr(module, "grid", None)
    pipe_rank, stages = (grid.pipe_rank, grid.pipe_size) if grid is not None else (0, 1)
    writer = grid is None or (grid.data_rank == grid.expert_rank == grid.tensor_rank == grid.sequence_rank == 0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    shards = ["model.safetensors"] if stages == 1 else [f"model-{k:05d}-of-{stages:05d}.safetensors"
                                                        for k in range(1, stages + 1)]
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if stages > 1:  # from_pretrained reads a model.safetensors before any index: it goes first
            _remove_stale(directory, keep=set(shards) | {_INDEX}, only={"model.safetensors"})
    _barrier()
    if writer:
        _save(state, directory / shards[pipe_rank])
    names = _gather_names({name: shards[pipe_rank] for name in state} if writer else {})
    if rank == 0:
        _write_config(module, directory, state, dtype)
        if stages > 1:
            total = sum(_gather_sizes(names, directory))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names.items()))}
            tmp = directory / (_INDEX + ".tmp")
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, directory / _INDEX)
        _remove_stale(directory, keep=set(shards) | ({_INDEX} if stages > 1 else set()))
    _barrier()
    return directory


_INDEX = "model.safetensors.index.json"
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?(\.tmp)?")  # what an export writes


def _remove_stale(directory: Path, keep: set[str], only: set[str] | None = None) -> None:
    """Delete the weight files an export writes (model.safetensors, its shards, its index, their
    temporaries) that the new layout does not: from_pretrained would read them instead of the new ones."""
    for path in directory.iterdir():
        if _WEIGHTS.fullmatch(path.name) and path.name not in keep and (only is None or path.name in only):
            path.unlink()


def _check_whole(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor is one of the model's, with its shape, on every rank (LoRA adapters are no tensor of the
    model; a partitioned one was refused by whole_weights): the same ValueError on every rank before anything
    is written."""
    shapes = hf_shapes(module)
    bad = sorted(f"{n} {tuple(t.shape)}" for n, t in state.items() if n in shapes and t.shape != shapes[n])
    mine = (bad, sorted(set(state) - set(shapes)))
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    found = sorted({b for part, _ in every for b in part})
    foreign = sorted({n for _, part in every for n in part})
    if foreign:
        raise ValueError(f"export_hf: {len(foreign)} tensors are not the model's, e.g. {foreign[:2]} (LoRA "
                         "adapters): from_pretrained would skip them and load the base alone; use export_merged_hf("
                         "model, dir) (adapters folded in) or export_peft_adapter(model, dir, config) "
                         "(pipezero.train.checkpoint.lora_export)")
    if found:
        raise ValueError(f"export_hf: {len(found)} tensors do not have the model's shape, e.g. {found[:3]}; export "
                         f"a module built by hf_layer_specs from this model's config")


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write to a temporary name, then rename: a crash never leaves a shard that looks whole."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _gather_names(mine: dict[str, str]) -> dict[str, str]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _gather_sizes(names: dict[str, str], directory: Path) -> list[int]:
    """Bytes of every tensor, read from the shards' headers."""
    from safetensors import safe_open

    sizes = []
    for shard in sorted(set(names.values())):
        with safe_open(str(directory / shard), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                sizes.append(_numel(t.get_shape()) * _itemsize(t.get_dtype()))
    return sizes


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(name: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}.get(name, 1)


def _write_config(module: nn.Module, directory: Path, state: dict[str, torch.Tensor],
                  dtype: torch.dtype | None) -> None:
    config = copy.deepcopy(hf_config(module))
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    config.dtype = dtype or (floats[0] if floats else torch.float32)
    config.save_pretrained(directory)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
