"""Training state by GLOBAL parameter name: save on one grid, load onto another, export for one process.

A checkpoint holds, under names that do not depend on the grid:

    model/<param name>            fp32 weights (the ZeRO masters, gathered: exact for bf16/fp16 too;
                                  frozen parameters, which no optimizer holds, as the model has them)
    optim/<param name>/<key>      the torch optimizer's per-parameter state (exp_avg, exp_avg_sq, step)
    rng.<rank>.torch_cpu, .python each rank's torch and Python RNGs (restored when the grid is unchanged)

and as JSON meta the step, the LR schedule position, the data position, the batch sizes
(`saved_batch`: a resume on another data degree keeps the global batch), the non-torch links
of the optimizer chain (the loss scale and its counters). Parameter names are
PipelineModule's ("layers.3.qkv.weight", "tied.embed.weight"): the same on every grid, so a
pipe 2 x data 2 checkpoint loads into pipe 1 x data 4, pipe 4 x data 1 or one process. A split
parameter (comm.TensorShard: a tensor-parallel slice, or a rank's experts of a MoE layer,
pipe/expert/) is gathered whole over its group, so a checkpoint at expert 2 loads at expert 4,
1 or any degree that divides the experts. Only data rank 0 (expert, tensor and sequence rank 0)
of each stage writes weights and optimizer state (ZeRO's state is consolidated over the data
group first); `export_model` maps the names onto the single-process model's
(tied weights under every name that uses them) for `safetensors.torch.load_file`.

The parts are `build`'s Parts or a job composed by hand (`HandParts(model, optimizer,
scheduler)`): ZeroOptimizer gives its state by parameter itself, any other optimizer chain (a
torch optimizer, LossScaler / MasterWeights over one) through its state_dict, in the same layout
(train/checkpoint/by_name.py), so a plain job's checkpoint resumes under ZeRO of any degree and back;
several optimizers over different parameters (the experts' beside the dense ones) save as one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from pipezero.chain import links
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec
from pipezero.train.checkpoint.by_name import HoldsMasters, by_name
from pipezero.train.checkpoint import (CheckpointError, checkpoint_meta, export_consolidated, latest_step,
                                       load_checkpoint, rng_state, save_checkpoint, set_rng_state)
from pipezero.train.checkpoint.flatten import flatten_state, unflatten_state
from pipezero.train.config.batch import BatchConfig
from pipezero.train.checkpoint.state_parts import ByNameState, StateParts
from pipezero.train.checkpoint.tensor_state import local_slice, whole, whole_shape

__all__ = ["agree_on_load", "export_model", "gather_state", "load_by_name", "load_state", "resume_if_any",
           "save_state", "saved_batch", "single_process_names"]

_MODEL, _OPTIM = "model/", "optim/"


def _param_names(parts: StateParts) -> dict[int, str]:
    return {id(p): n for n, p in parts.module.named_parameters()}


def _by_name_parts(parts: StateParts) -> StateParts:
    """The parts with an optimizer that gives its state by parameter (ZeroOptimizer, or a view of any chain)."""
    view = copy.copy(parts)
    view.optimizer = by_name(parts.optimizer)
    return view


def gather_state(parts: StateParts, data_state: Mapping[str, Any] | None, step: int, frozen: bool = True,
                 model_config: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(this rank's tensors, the JSON meta) of a checkpoint; a collective over the world.

    `frozen=False` leaves out the parameters no optimizer holds (DeepSpeed's
    exclude_frozen_parameters); `model_config` (JSON) is recorded for load_state to check.
    """
    parts = _by_name_parts(parts)
    zero, names = parts.optimizer, _param_names(parts)
    writer = _writer(parts.grid)
    tensors: dict[str, torch.Tensor] = {}
    for p, master in zero.full_parameters():
        value = whole(p, master)  # tensor-parallel: every tensor rank takes part
        if writer:
            tensors[_MODEL + names[id(p)]] = value.float().cpu()
    owned = zero.full_shapes()
    for name, p in parts.module.named_parameters():  # frozen (not in the optimizer): whole on every data rank
        if id(p) not in owned and frozen:
            value = whole(p, p.to_local() if isinstance(p, DTensor) else p.detach())
            if writer:
                tensors[_MODEL + name] = value.float().cpu()
    for p, state in zero.per_parameter_state():
        for key, value in state.items():
            value = whole(p, torch.as_tensor(value))
            if writer:
                tensors[f"{_OPTIM}{names[id(p)]}/{key}"] = value.cpu()
    rng_tensors, rng_json = rng_state(prefix=f"rng.{parts.grid.rank}.")
    tensors.update(rng_tensors)
    chain_tensors, chain = _chain_state(zero)
    tensors.update(chain_tensors if parts.grid.rank == 0 else {})
    meta = {"step": step, "data": dict(data_state or {}), "chain": chain, "chain_links": _link_names(zero),
            "rng": rng_json, "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
            "grid": _grid_dict(parts.grid), "dtype": str(parts.dtype).removeprefix("torch."),
            "batch": dataclasses.asdict(parts.config.batch) if parts.config is not None else None,
            "param_groups": _group_settings(parts, writer),
            "frozen": frozen, "model_config": _as_json(model_config)}
    return tensors, meta


def _writer(grid: Any) -> bool:
    """Whether this rank writes its stage's weights and optimizer state: the first of every axis but pipe
    (the tensor and expert slices gathered whole first, the data and sequence ranks' copies the same)."""
    return grid.data_rank == 0 and grid.expert_rank == 0 and grid.tensor_rank == 0 and grid.sequence_rank == 0


def _group_settings(parts: StateParts, writer: bool) -> list[dict[str, Any]]:
    """Every stage's param-group settings (lr, betas, weight decay...) with the names of their
    parameters, so a group whose lr was changed by hand resumes with it on any grid; a collective."""
    names, zero = _param_names(parts), parts.optimizer
    mine = []
    for group, params in zip(zero.param_groups, zero.original_params):
        _, settings = flatten_state({k: v for k, v in group.items() if k != "params" and _plain(v)}, "group")
        mine.append({"names": [names[id(p)] for p in params if id(p) in names], "settings": settings})
    everyone = [(writer, mine)]
    if parts.grid.world_size > 1:
        everyone = [None] * parts.grid.world_size
        dist.all_gather_object(everyone, (writer, mine))
    return [g for w, groups in everyone if w for g in groups]


def _plain(value: Any) -> bool:
    """A param-group setting the JSON meta can hold (numbers, strings, flags, their tuples); tensors are not."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str, type(None)))


def _load_group_settings(parts: StateParts, saved: list[dict[str, Any]] | None) -> None:
    """Each local param group takes the saved settings of the group that held its first parameter."""
    names, zero = _param_names(parts), parts.optimizer
    by_name = {n: entry["settings"] for entry in saved or [] for n in entry["names"]}
    for group, params in zip(zero.param_groups, zero.original_params):
        first = next((names[id(p)] for p in params if id(p) in names), None)
        if first in by_name:
            group.update(unflatten_state({}, by_name[first]))


def _as_json(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A model config as the JSON it will be compared as (tuples become lists)."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(f"model_config={type(config).__name__}: expected a dict of the model's settings "
                        "(e.g. dataclasses.asdict(config))")
    try:
        return json.loads(json.dumps(dict(config)))
    except (TypeError, ValueError) as err:
        raise TypeError(f"model_config: {err}; record the model's settings as JSON values") from None


def _check_model_config(path: Any, saved: dict[str, Any] | None, mine: Mapping[str, Any] | None) -> None:
    """Refuse to resume a checkpoint of a model with other settings (the same tensor shapes can hide it)."""
    mine = _as_json(mine)
    if saved is None or mine is None or saved == mine:
        return
    keys = sorted(set(saved) | set(mine))
    diff = [f"{k}={saved.get(k, '<unset>')!r} (here {mine.get(k, '<unset>')!r})" for k in keys
            if saved.get(k, "<unset>") != mine.get(k, "<unset>")]
    raise CheckpointError(f"{path}: was written with {', '.join(diff)}; resume with the model (and data) it was "
                          "saved with, or start afresh in another directory (another --out)")


def _link_names(zero: ByNameState) -> list[str]:
    return [type(link).__name__ for link in links(zero.inner)]


def _chain_state(zero: ByNameState) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The own state of each link between ZeRO (or the outside) and the torch optimizer (e.g. the loss scale).

    A link holding masters (MasterWeights) saves nothing: its masters are the model/ weights, by name,
    while its own state_dict numbers them by this stage's parameters (another stage could not load it).
    """
    tensors, skeletons = {}, []
    for i, link in enumerate(links(zero.inner)):
        own = {} if isinstance(link, HoldsMasters) else link.link_state_dict()
        part, skeleton = flatten_state(own, f"chain.{i}")
        tensors.update(part)
        skeletons.append(skeleton)
    return tensors, skeletons


def _grid_dict(grid: Any) -> dict[str, int]:
    sequence = {"sequence": grid.sequence_size} if grid.sequence_size > 1 else {}  # older checkpoints: none
    expert = {"expert": grid.expert_size} if grid.expert_size > 1 else {}
    return {"pipe": grid.pipe_size, "data": grid.data_size, "tensor": grid.tensor_size, **sequence, **expert}


def save_state(parts: StateParts, directory: str | os.PathLike, step: int,
               data_state: Mapping[str, Any] | None = None, *, model_config: Mapping[str, Any] | None = None,
               latest: bool = True, frozen: bool = True) -> Path:
    """Save the whole training state as checkpoint `step` under `directory` (call on every rank).

    `model_config` (the model's settings as JSON) is checked by load_state on resume;
    `latest=False` leaves the `latest` pointer as it was; `frozen=False` leaves out frozen parameters.
    """
    tensors, meta = gather_state(parts, data_state, step, frozen=frozen, model_config=model_config)
    return save_checkpoint(directory, step, tensors, meta, rank=parts.grid.rank,
                           world=parts.grid.world_size, grid=meta["grid"], latest=latest)


def load_state(parts: StateParts, directory: str | os.PathLike, step: int | None = None, *,
               model_config: Mapping[str, Any] | None = None, optimizer: bool = True, scheduler: bool = True,
               rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint (any grid's) into these parts; returns its meta (step, data position...).

    Each rank reads only the names of its own parameters. Refused with CheckpointError when the
    checkpoint does not fit the model (missing or reshaped parameters, or another `model_config`
    than the one it recorded) or is damaged. `optimizer=False` keeps the optimizer chain's state
    (moments, loss scale, param-group settings) as it is, `scheduler=False` the LR schedule's,
    `rng=False` the random generators'.
    """
    parts = _by_name_parts(parts)
    names = _param_names(parts)
    local = set(names.values())
    rank_prefix = f"rng.{parts.grid.rank}."
    def wanted(key: str) -> bool:
        if key.startswith(rank_prefix) or key.startswith("chain."):
            return True
        return "/" in key and key.split("/")[1] in local
    shapes = parts.optimizer.full_shapes()  # stage 3's released parameters are empty tensors
    expected = {_MODEL + n: shapes.get(id(p), whole_shape(p)) for n, p in parts.module.named_parameters()}
    try:  # nothing is loaded until every rank accepts the checkpoint (a refused stage leaves all as they were)
        meta = checkpoint_meta(directory, step)
        _check_model_config(directory, meta.get("model_config"), model_config)
        if meta.get("frozen", True) is False:  # saved without them: they stay as the model has them
            params = _by_name(parts)
            expected = {k: v for k, v in expected.items() if id(params[k]) in shapes}
        ckpt = load_checkpoint(directory, step, names=wanted, expected=expected, strict=False)
        chain = _chain_states(parts.optimizer, ckpt.tensors, ckpt.meta["chain"], ckpt.meta.get("chain_links")) \
            if optimizer else []
        problem = None
    except (CheckpointError, ValueError, TypeError, KeyError) as err:
        problem = str(err)
    agree_on_load(problem, parts.grid.world_size)
    t, meta = ckpt.tensors, ckpt.meta
    if optimizer:  # first: its links check their own state (the same on every rank) before anything is loaded
        _load_chain(parts.optimizer, chain)
    load_by_name(parts, t, param_groups=meta.get("param_groups"), optimizer=optimizer,
                 scheduler=meta.get("scheduler") if scheduler else None)
    if rng and rank_prefix + "torch_cpu" in t and meta["grid"] == _grid_dict(parts.grid):
        set_rng_state(t, meta["rng"], prefix=rank_prefix)
    return {**meta, "step": ckpt.step, "path": str(ckpt.path)}


def _by_name(parts: StateParts) -> dict[str, torch.Tensor]:
    return {_MODEL + n: p for n, p in parts.module.named_parameters()}


def load_by_name(parts: StateParts, tensors: Mapping[str, torch.Tensor], *,
                 param_groups: list[dict[str, Any]] | None = None, optimizer: bool = True,
                 scheduler: Mapping[str, Any] | None = None) -> None:
    """Write whole tensors by global parameter name into these parts, on any grid and ZeRO stage.

    `tensors`: "model/<name>" (fp32 weights) for every parameter of this rank, "optim/<name>/<key>"
    (the torch optimizer's per-parameter state) for those with state; `param_groups`: the settings by
    parameter name, as gather_state records them; `scheduler`: a state_dict for the LR scheduler. No
    collective: check the tensors (and agree_on_load) first, nothing here refuses them.
    """
    parts = _by_name_parts(parts)
    names = _param_names(parts)
    _load_weights(parts, tensors, names)
    if optimizer:
        _load_optimizer(parts.optimizer, tensors, names)
        _load_group_settings(parts, param_groups)
    if scheduler is not None and parts.scheduler is not None:
        _load_scheduler(parts.scheduler, scheduler)


def agree_on_load(problem: str | None, world: int) -> None:
    """Refuse a checkpoint on every rank when any rank refuses it (e.g. only one stage's layers
    differ), so no rank starts training while the others exit."""
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(problem if problem is not None else
                              f"the checkpoint was refused on rank(s) {[r for r, _ in failed]} (rank {rank}: {first})")


def _load_weights(parts: StateParts, t: Mapping[str, torch.Tensor], names: dict[int, str]) -> None:
    """Write the fp32 weights into the flat buffers (model dtype) and the fp32 masters."""
    done = set()

    def value_of(p: torch.Tensor) -> torch.Tensor:
        done.add(id(p))
        return local_slice(p, t[_MODEL + names[id(p)]])
    parts.optimizer.load_full_parameters(value_of)
    with torch.no_grad():  # the parameters no optimizer owns (frozen ones)
        for p in parts.module.parameters():
            if id(p) not in done and _MODEL + names[id(p)] in t:  # absent: saved with frozen=False
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(local_slice(p, t[_MODEL + names[id(p)]]).to(p.dtype))


def _chain_states(zero: ByNameState, t: Mapping[str, torch.Tensor], skeletons: list[Any],
                  saved_links: list[str] | None) -> list[Any]:
    """Each link's saved own state, checked against this chain's links (nothing loaded yet)."""
    mine = _link_names(zero)
    if (saved_links is not None and saved_links != mine) or len(skeletons) != len(mine):
        raise ValueError(f"the checkpoint's optimizer chain has the links {saved_links} around its torch optimizer "
                         f"(ZeroOptimizer aside), this one {mine}; resume with the same links (a ZeRO stage or "
                         "degree may differ), or pass optimizer=False to load the weights alone")
    return [unflatten_state(dict(t), skeleton) for skeleton in skeletons]


def _load_chain(zero: ByNameState, states: list[Any]) -> None:
    for link, state in zip(links(zero.inner), states, strict=True):
        if not isinstance(link, HoldsMasters):  # its masters load with the weights (older checkpoints: a copy)
            link.load_link_state_dict(state)


def _load_scheduler(scheduler: Any, saved: Mapping[str, Any]) -> None:
    """The saved schedule position, with a torch scheduler's per-group lrs taken from this rank's own groups.

    The meta holds rank 0's scheduler state, whose base_lrs / last lrs are one per rank 0's param group;
    another stage holds other groups (layer-wise lrs: other values, maybe another count). Their lrs and
    initial lrs were restored by parameter name (_load_group_settings), so the lists are rebuilt from them.
    """
    state = dict(saved)
    if isinstance(scheduler, LRScheduler):
        groups = scheduler.optimizer.param_groups
        if "base_lrs" in state:
            state["base_lrs"] = [group["initial_lr"] for group in groups]
        state["_last_lr"] = [group["lr"] for group in groups]  # torch's state_dict key for get_last_lr()
    scheduler.load_state_dict(state)


def _load_optimizer(zero: ByNameState, t: Mapping[str, torch.Tensor], names: dict[int, str]) -> None:
    """Per-parameter optimizer state by name -> every rank's shard."""
    def state_of(p: torch.Tensor) -> dict[str, torch.Tensor]:
        prefix = f"{_OPTIM}{names[id(p)]}/"
        return {k[len(prefix):]: local_slice(p, v) for k, v in t.items() if k.startswith(prefix)}
    zero.load_per_parameter_state(state_of)


def resume_if_any(parts: StateParts, directory: str | os.PathLike, *, model_config: Mapping[str, Any] | None = None
                  ) -> dict[str, Any] | None:
    """Load the latest complete checkpoint under `directory` if there is one; None to start fresh."""
    if latest_step(directory) is None:
        return None
    return load_state(parts, directory, model_config=model_config)


def saved_batch(directory: str | os.PathLike, step: int | None = None) -> BatchConfig | None:
    """The batch sizes checkpoint `step` (default: the latest) under `directory` was trained with; None
    without a checkpoint.

    Read before the parts are built (no process group needed): `keep_global_batch` turns them
    into this launch's accumulation steps when the data degree changed.
    """
    if step is None and latest_step(directory) is None:
        return None
    batch = checkpoint_meta(directory, step).get("batch")
    return None if batch is None else BatchConfig(**batch)


# -- export for one process -------------------------------------------------------------------------

def single_process_names(specs: Sequence[Any]) -> Callable[[str], list[str]]:
    """Map a PipelineModule name to the single-process model's names ("layers.<i>.<attr>").

    "layers.i.x" stays as it is; "tied.<key>.<attr>" becomes "layers.<i>.<attr>" for every layer
    i of that key whose module has that parameter (an embedding and the head reusing it).
    """
    owners: dict[str, list[tuple[int, set[str]]]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            with torch.device("meta"):
                keys = set(spec.build().state_dict())
            owners.setdefault(spec.key, []).append((i, keys))

    def mapping(name: str) -> list[str]:
        match = re.fullmatch(r"tied\.([^.]+)\.(.+)", name)
        if match is None:
            return [name]
        key, attr = match.groups()
        return [f"layers.{i}.{attr}" for i, keys in owners.get(key, []) if attr in keys]
    return mapping


def export_model(directory: str | os.PathLike, path: str | os.PathLike, specs: Sequence[Any],
                 step: int | None = None, dtype: torch.dtype | None = None,
                 metadata: Mapping[str, str] | None = None) -> Path:
    """One safetensors file of the whole model under the single-process names (from any grid's checkpoint).

    `metadata` (strings) goes into the file's header beside the step, e.g. the model's config
    as JSON, so the file alone is enough to rebuild the model it holds.
    """
    ckpt = load_checkpoint(directory, step, names=lambda k: k.startswith(_MODEL))
    mapping = single_process_names(specs)
    out: dict[str, torch.Tensor] = {}
    for key, value in ckpt.tensors.items():
        for name in mapping(key[len(_MODEL):]):
            out[name] = value.to(dtype) if dtype is not None else value
    missing = sorted(set(_spec_parameter_names(specs)) - set(out))
    if missing:
        raise CheckpointError(f"{ckpt.path}: lacks {len(missing)} parameter(s) of the model {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}, so {path} would be incomplete; export a "
                              "checkpoint of these specs that holds every parameter, frozen ones included")
    return export_consolidated(path, out, metadata={**dict(metadata or {}), "step": str(ckpt.step)})


def _spec_parameter_names(specs: Sequence[Any]) -> list[str]:
    """The single-process model's parameter names ("layers.<i>.<name>"), each layer built on the meta device."""
    names = []
    for i, spec in enumerate(specs):
        if isinstance(spec, LayerSpec):
            with torch.device("meta"):
                names += [f"layers.{i}.{n}" for n, _ in spec.build().named_parameters()]
    return names

