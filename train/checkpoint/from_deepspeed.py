"""Resume a DeepSpeed checkpoint into pipezero's parts: DeepSpeed's names onto pipezero's, on any grid.

deepspeed_files.py makes every parameter of a DeepSpeed ZeRO 1-3 (or universal) checkpoint whole
again by DeepSpeed's name: the fp32 master, Adam's exp_avg / exp_avg_sq / step. Here those names
become the names of this job's parameters and go through the grid-independent checkpoint's loader
(state.py's load_by_name), so they land in whatever shards this grid has: any data degree, any ZeRO
stage, a pipeline. DeepSpeed named the parameters of the model it wrapped, so the names are:

  * the same nn.Module DeepSpeed trained (`initialize(model=...)`): its own names, a tied weight
    under any of its names (named_parameters(remove_duplicate=False));
  * a PipelineModule of hf_layer_specs (`pipezero finetune`, build(specs=...)): each layer's
    Hugging Face names (pipe.hf.hf_parameter_names), the tied embedding and LM head as one.

Beside them: the param-group settings (lr, betas, eps, weight decay) by parameter, the LR
schedule's position (DeepSpeed's schedulers count last_batch_iteration, one behind the optimizer
steps; a torch scheduler's own state_dict is passed as it is), the fp16 loss scale, global_steps.
A parameter here that the checkpoint lacks, a checkpoint parameter nothing here takes, or another
shape is refused on every rank, before anything is loaded, naming the file and the parameter.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.chain import links
from pipezero.pipe import PipelineModule
from pipezero.pipe.hf import hf_parameter_names
from pipezero.precision import LossScaler
from pipezero.train.checkpoint.by_name import by_name
from pipezero.train.checkpoint.deepspeed_files import DeepSpeedState, deepspeed_folder, read_deepspeed
from pipezero.train.checkpoint.files import CheckpointError
from pipezero.train.checkpoint.flatten import flatten_state
from pipezero.train.checkpoint.state import load_by_name
from pipezero.train.checkpoint.state_parts import StateParts
from pipezero.train.checkpoint.tensor_state import whole_shape

__all__ = ["is_deepspeed_checkpoint", "load_deepspeed_checkpoint", "deepspeed_names"]

_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")  # hyper-parameters, not kernels


def is_deepspeed_checkpoint(path: str | os.PathLike, tag: Any = None) -> bool:
    """Whether path (and tag) is a DeepSpeed checkpoint folder (its *model_states.pt files), not pipezero's."""
    try:
        deepspeed_folder(path, None if tag is None else str(tag))
    except CheckpointError:
        return False
    return True


def deepspeed_names(module: nn.Module) -> dict[str, list[str]]:
    """Each of this rank's parameters, by `module`'s name, with the names DeepSpeed may have saved it under."""
    if isinstance(module, PipelineModule):
        try:
            return hf_parameter_names(module)
        except ValueError:
            raise CheckpointError("a DeepSpeed checkpoint maps onto a PipelineModule of hf_layer_specs (Hugging Face "
                                  "names) or onto the nn.Module DeepSpeed trained; this PipelineModule's layers "
                                  "(layers.<i>...) have neither") from None
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), name), []).append(name)
    return out


def load_deepspeed_checkpoint(parts: StateParts, path: str | os.PathLike, tag: Any = None, *,
                              optimizer: bool = True, scheduler: bool = True) -> dict[str, Any]:
    """Load DeepSpeed's checkpoint at `path` (save_checkpoint's folder; `tag` as DeepSpeed's, None: `latest`)
    into these parts, on any grid; every rank calls it. Returns {"path", "step" (= global_steps),
    "global_steps", "skipped_steps", "zero_stage", "data_size", "client_state"}. `optimizer=False` loads
    the weights alone, `scheduler=False` leaves the LR schedule where it is."""
    view = by_name(parts.optimizer)
    mine = deepspeed_names(parts.module)
    used: set[str] = set()
    try:
        ds = read_deepspeed(path, None if tag is None else str(tag), wanted={n for c in mine.values() for n in c})
        tensors, used, groups = _by_pipezero_name(parts, view, ds, mine)
        problem = None
    except (CheckpointError, ValueError, KeyError) as err:
        problem = str(err)
    _agree(problem, used, ds if problem is None else None, parts.grid.world_size)
    if optimizer:
        _load_scaler(view, ds)
    load_by_name(parts, tensors, param_groups=groups if optimizer else None, optimizer=optimizer,
                 scheduler=_scheduler_state(ds.scheduler, ds.global_steps) if scheduler else None)
    return {"path": str(ds.path), "step": ds.global_steps, "global_steps": ds.global_steps,
            "skipped_steps": ds.skipped_steps, "zero_stage": ds.zero_stage, "data_size": ds.data_size,
            "client_state": ds.client}


def _by_pipezero_name(parts: StateParts, view: Any, ds: DeepSpeedState, mine: dict[str, list[str]]
                      ) -> tuple[dict[str, torch.Tensor], set[str], list[dict[str, Any]]]:
    """(model/ and optim/ tensors under this rank's names, the DeepSpeed names taken, the group settings)."""
    shapes = view.full_shapes()
    params = dict(parts.module.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    taken: dict[str, str] = {}  # DeepSpeed's name -> ours
    for name, candidates in mine.items():
        stored = next((c for c in candidates + [ds.shared[c] for c in candidates if c in ds.shared]
                       if c in ds.shapes), None)
        p = params[name]
        if stored is None and id(p) not in shapes:  # frozen, saved with exclude_frozen_parameters: kept as it is
            continue
        if stored is None:
            raise CheckpointError(f"{ds.model_file}: ['param_shapes'] has no parameter {candidates[0]!r} (here "
                                  f"{name!r}); resume a checkpoint of this model (matched by parameter name)")
        want = tuple(shapes.get(id(p), whole_shape(p)))
        if ds.shapes[stored] != want:
            raise CheckpointError(f"{ds.model_file}: ['param_shapes'][{stored!r}] is {ds.shapes[stored]}, "
                                  f"here {name!r} is {want}; resume a checkpoint of this model")
        taken[stored] = name
        tensors[f"model/{name}"] = ds.weights[stored]
        if id(p) in shapes:
            tensors.update((f"optim/{name}/{k}", v) for k, v in ds.optim.get(stored, {}).items())
    groups = [{"names": [taken[n] for n in names if n in taken],
               "settings": flatten_state({k: v for k, v in settings.items() if k in _SETTINGS}, "group")[1]}
              for names, settings in ds.groups]
    return tensors, set(taken), [g for g in groups if g["names"]]


def _agree(problem: str | None, used: set[str], ds: DeepSpeedState | None, world: int) -> None:
    """Refuse on every rank when any rank refused, or when a checkpoint parameter went to no rank."""
    everyone = [(problem, sorted(used))]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (problem, sorted(used)))
    failed = [(r, p) for r, (p, _) in enumerate(everyone) if p is not None]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(problem if problem is not None else f"the DeepSpeed checkpoint was refused on rank(s) "
                              f"{[r for r, _ in failed]} (rank {rank}: {first})")
    assert ds is not None
    unknown = sorted(set(ds.shapes) - {n for _, names in everyone for n in names})
    if unknown:
        raise CheckpointError(f"{ds.model_file}: ['param_shapes'] holds {len(unknown)} parameter(s) this model lacks "
                              f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}; resume a checkpoint of this model")


def _scheduler_state(saved: dict[str, Any] | None, global_steps: int) -> dict[str, Any]:
    """DeepSpeed's schedulers' {"last_batch_iteration": i} as pipezero's (i + 1 optimizer steps taken);
    a torch scheduler's state_dict (a client scheduler DeepSpeed saved) as it is; none saved (DeepSpeed
    ran without one): this job's schedule at global_steps, where its loop resumes."""
    if saved and set(saved) != {"last_batch_iteration"}:
        return dict(saved)
    steps = int(saved["last_batch_iteration"]) + 1 if saved else global_steps
    return {"last_epoch": steps, "_step_count": steps + 1}


def _load_scaler(view: Any, ds: DeepSpeedState) -> None:
    """DeepSpeed's loss scale (cur_scale, hysteresis, iteration counters) into this chain's LossScaler."""
    if ds.loss_scaler is None:
        return
    for link in links(view.inner):
        if isinstance(link, LossScaler):
            f, now = ds.loss_scaler, link.link_state_dict()["loss_scaler"]
            scale = float(f.get("cur_scale", 1.0))
            mode = "dynamic" if f.get("dynamic") else "off" if scale == 1.0 else "static"
            link.load_link_state_dict({"loss_scaler": {
                "scale": scale, "hysteresis_left": int(f.get("cur_hysteresis", now["hysteresis_left"])),
                "iteration": int(f.get("cur_iter", ds.global_steps)),
                "last_overflow_iteration": int(f.get("last_overflow_iter", -1)),
                "skipped_steps": ds.skipped_steps, "consecutive_skips_at_floor": 0, "mode": mode}})
