"""ZeroOptimizer state: per-rank flat shards, and the consolidated single-process layout.

Per rank (ZeroOptimizer.state_dict): the inner chain's own state_dict (its tensors are this
rank's flat shards, safetensors-friendly) plus JSON-able metadata about the layout (`layout`),
so a load onto a different layout fails with a clear message instead of silently misplacing.

Consolidated (`consolidated_state_dict`): the state the innermost torch optimizer would
have had in one process over the original (unsharded) parameters: per-parameter state
tensors shaped like the parameters, indexed in param-group order. It is what moves a
checkpoint between data-parallel degrees: every rank of any group loads it and slices
out its own shard (`load_consolidated_state_dict`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.tensor import DTensor

from pipezero.comm import all_gather, tensor_shard
from pipezero.chain import innermost
from pipezero.zero.partition import Bucket

if TYPE_CHECKING:
    from pipezero.zero.optimizer import ZeroOptimizer

__all__ = ["adopt_initial_state", "has_stepped", "layout", "check_layout", "restore_masters", "consolidated_state_dict",
           "load_consolidated_state_dict", "full_parameters", "full_shapes", "load_full_parameters", "per_parameter_state",
           "load_per_parameter_state"]


def layout(opt: "ZeroOptimizer") -> dict[str, Any]:
    """What a per-rank state depends on, as JSON: stage, group size, rank, bucket shapes."""
    return {"stage": opt.stage, "world": opt.world, "rank": opt.rank,
            "buckets": [[b.group_index, b.padded, [list(s) for s in b.shapes]] for b in opt.buckets]}


def check_layout(opt: "ZeroOptimizer", saved: dict[str, Any]) -> None:
    """Raise ValueError unless a per-rank state saved with layout `saved` fits this optimizer."""
    mine = layout(opt)
    if saved != mine:
        raise ValueError(f"this per-rank state was saved with stage={saved['stage']}, world={saved['world']}, "
                         f"rank={saved['rank']} (or another model); here stage={mine['stage']}, "
                         f"world={mine['world']}, rank={mine['rank']}. To change the data-parallel degree "
                         "save consolidated_state_dict(opt) and load that")


def has_stepped(core: Any) -> bool:
    """Whether a torch optimizer holds state from a step: any entry but an initial one (step 0, as
    Adagrad's __init__ makes it) says so."""
    for entry in (getattr(core, "state", None) or {}).values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if step is None or float(step) != 0:
            return True
    return False


def adopt_initial_state(opt: "ZeroOptimizer") -> None:
    """Move the per-parameter state an optimizer made before its first step onto the shards."""
    core = innermost(opt.inner)
    initial = {id(p): st for p, st in core.state.items()}
    if not initial:
        return
    core.state.clear()
    for b in opt.buckets:
        per_param = [initial.get(id(p)) for p in b.params]
        if all(st is not None for st in per_param):
            core.state[b.master] = _shard_of(b, per_param)


def restore_masters(opt: "ZeroOptimizer") -> None:
    """The masters are not part of the inner state; they follow the model's parameters."""
    for b in opt.buckets:
        if b.master.data_ptr() != b.local.data_ptr():
            with torch.no_grad():
                b.master.copy_(b.local)


def _gather_flat(opt: "ZeroOptimizer", b: Bucket, shard: torch.Tensor) -> torch.Tensor:
    if b.parts == 1:
        return shard
    full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
    all_gather(full, shard.contiguous(), group=b.group)
    return full


def _slots(opt: "ZeroOptimizer") -> dict[int, tuple[Bucket, int]]:
    return {id(p): (b, i) for b in opt.buckets for i, p in enumerate(b.params)}


def consolidated_state_dict(opt: "ZeroOptimizer") -> dict[str, Any]:
    """The innermost optimizer's state as one process over the unsharded parameters would hold it.

    A collective over the group (every rank must call it); every rank gets the whole dict.
    Parameters are numbered in param-group order, as torch's Optimizer.state_dict does.
    """
    core, slots = innermost(opt.inner), _slots(opt)
    full = {}
    for b in opt.buckets:
        st = core.state.get(b.master, {})
        full[b] = {k: _gather_flat(opt, b, v) if _is_shard(v, b) else v for k, v in st.items()}
    state, groups, index = {}, [], 0
    for group, params in zip(opt.param_groups, opt.original_params):
        ids = []
        for p in params:
            if id(p) in slots:
                b, i = slots[id(p)]
                if full[b]:
                    state[index] = {k: b.slot(v, i).clone() if _is_flat(v, b) else _copy(v)
                                    for k, v in full[b].items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"consolidated": {"state": state, "param_groups": groups}, "zero": {"stage": opt.stage}}


def load_consolidated_state_dict(opt: "ZeroOptimizer", state: dict[str, Any]) -> None:
    """Load a consolidated state (from any group size or stage): every rank slices out its own shard."""
    core, slots = innermost(opt.inner), _slots(opt)
    saved = state["consolidated"]
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    mine = [len(params) for params in opt.original_params]
    if sizes != mine:
        raise ValueError(f"the consolidated state has param groups of {sizes} parameters, this optimizer "
                         f"{mine}: load it into the same model and param groups")
    per_bucket: dict[Bucket, list] = {b: [None] * len(b.params) for b in opt.buckets}
    index = 0
    for group, params, hyper in zip(opt.param_groups, opt.original_params, saved["param_groups"]):
        group.update({k: v for k, v in hyper.items() if k != "params"})
        for p in params:
            if id(p) in slots and index in saved["state"]:
                b, i = slots[id(p)]
                per_bucket[b][i] = saved["state"][index]
            index += 1
    number = {id(m): i for i, m in enumerate(m for group in core.param_groups for m in group["params"])}
    shards = {number[id(b.master)]: _shard_of(b, per_param) for b, per_param in per_bucket.items()
              if all(s is not None for s in per_param)}
    # torch's own loader places each value as the group needs it (a fused or capturable Adam's step
    # on the master's device, as its kernel requires; others' on the CPU)
    core.load_state_dict({"state": shards, "param_groups": core.state_dict()["param_groups"]})


def full_parameters(opt: "ZeroOptimizer") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, its whole fp32 master) for every partitioned parameter; a collective over the group.

    The masters, not the model's copies: exact for bf16/fp16 models too. A tensor-parallel
    parameter's value is this tensor rank's local slice.
    """
    out = []
    for b in opt.buckets:
        full = _gather_flat(opt, b, b.master.detach().to(b.device)) if b.parts > 1 else b.master.detach()
        out += [(p, b.slot(full, i)) for i, p in enumerate(b.params)]
    return out


def full_shapes(opt: "ZeroOptimizer") -> dict[int, torch.Size]:
    """id(parameter) -> its whole shape, also while stage 3 has released it (an empty tensor then).

    A tensor-parallel parameter has the shape of the whole tensor it is part of (a DTensor's
    global shape, a comm.TensorShard's full shape).
    """
    return {id(p): p.shape if isinstance(p, DTensor) else _whole_shape(p, shape)
            for b in opt.buckets for p, shape in zip(b.params, b.shapes)}


def _whole_shape(p: torch.Tensor, shape: torch.Size) -> torch.Size:
    shard = tensor_shard(p)
    return shape if shard is None else shard.full_shape


def load_full_parameters(opt: "ZeroOptimizer", value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Set every partitioned parameter (model copy and fp32 master) to `value_of(parameter)` (its local shape)."""
    with torch.no_grad():
        for b in opt.buckets:
            flat = torch.zeros(b.padded, dtype=torch.float32)
            for i, p in enumerate(b.params):
                b.slot(flat, i).copy_(value_of(p))
            if b.flat is not None:
                b.flat.copy_(flat.to(b.flat.device, b.dtype))
            elif b.local is not None:
                b.local.copy_(b.owned(flat).to(b.local.device, b.dtype))
            if b.master.data_ptr() != (b.local.data_ptr() if b.local is not None else -1):
                b.master.copy_(b.owned(flat).to(b.master.device))


def per_parameter_state(opt: "ZeroOptimizer") -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """(parameter, the innermost optimizer's state for it, whole) in param-group order; a collective."""
    state = consolidated_state_dict(opt)["consolidated"]["state"]
    params = [p for group in opt.original_params for p in group]
    return [(p, state[i]) for i, p in enumerate(params) if i in state]


def load_per_parameter_state(opt: "ZeroOptimizer", state_of: Callable[[torch.Tensor], dict[str, Any] | None]
                             ) -> None:
    """Load the innermost optimizer's state from `state_of(parameter)` (None: no state); each rank keeps its shard."""
    state, groups, index = {}, [], 0
    for group, params in zip(opt.param_groups, opt.original_params):
        for offset, p in enumerate(params):
            entry = state_of(p)
            if entry:
                state[index + offset] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(index, index + len(params)))})
        index += len(params)
    load_consolidated_state_dict(opt, {"consolidated": {"state": state, "param_groups": groups},
                                       "zero": {"stage": opt.stage}})


def _shard_of(b: Bucket, per_param: list[dict]) -> dict:
    """Flatten per-parameter state tensors into the bucket layout and keep this rank's slice."""
    out = {}
    for key, first in per_param[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            flat = torch.zeros(b.padded, dtype=first.dtype)
            for i, s in enumerate(per_param):
                b.slot(flat, i).copy_(s[key])
            out[key] = b.owned(flat).clone().to(b.master.device)
        else:
            out[key] = _copy(first)
    return out


def _is_shard(v: Any, b: Bucket) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.shard_numel


def _is_flat(v: Any, b: Bucket) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.padded


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
