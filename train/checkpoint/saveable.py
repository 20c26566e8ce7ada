"""Checkpoints of explicit, typed saveable things: any hand composition saves and resumes.

A `Saveable` is anything with a `state_dict()` and a `load_state_dict()`: ZeroOptimizer,
LossScaler, MasterWeights, every torch optimizer, LR scheduler and nn.Module. Two checkpoints
take them:

* `save_state(HandParts(model, optimizer, scheduler), dir, step)` / `load_state(...)` (state.py):
  grid-independent, state by global parameter name. The optimizer may be a ZeroOptimizer chain,
  a LossScaler / MasterWeights chain or a plain torch optimizer: a chain without ZeRO is read
  through its innermost optimizer's state_dict, the layout ZeroOptimizer consolidates into
  (by_name.py), so the checkpoint loads onto another grid or data degree, with or without ZeRO.
* `save_things` / `load_things` (here): per rank, any Saveable things named by the caller, for
  what has no parameter names (a custom object's state); they load on the same grid only:

    save_things(dir, step, {"model": model, "optimizer": opt, "scheduler": sched}, meta={...})
    meta = load_things(dir, {"model": model, "optimizer": opt, "scheduler": sched})

Each rank writes its own things' state (per-rank: a ZeroOptimizer's shards load back onto the
same layout, which its state_dict records and checks) through the crash-safe protocol of
checkpoint.py, with no pickle: every tensor leaf in the rank's safetensors file, the rest of each
state_dict as a JSON skeleton (checkpoint_state.py), gathered into the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import torch.distributed as dist

from pipezero.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipezero.train.checkpoint.flatten import flatten_state, unflatten_state

__all__ = ["Saveable", "load_things", "save_things"]


@runtime_checkable
class Saveable(Protocol):
    """A thing whose whole state round-trips through a state_dict (tensors, numbers, strings, containers)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_things(things: Mapping[str, Any], who: str) -> None:
    for name, thing in things.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{who}: thing name {name!r} must be a non-empty str without '/'")
        if not isinstance(thing, Saveable):
            raise TypeError(f"{who}: things[{name!r}] is a {type(thing).__name__}, which has no state_dict() / "
                            "load_state_dict(); pass a model, optimizer (chain), scheduler or another Saveable")


def save_things(directory: str | os.PathLike, step: int, things: Mapping[str, Saveable],
                meta: Mapping[str, Any] | None = None) -> Path:
    """Save each thing's state_dict as checkpoint `step` (call on every rank, with the same names)."""
    _check_things(things, "save_things")
    rank, world = _world()
    tensors, skeletons = {}, {}
    for name, thing in things.items():
        part, skeletons[name] = flatten_state(thing.state_dict(), f"{rank}/{name}")
        tensors.update(part)
    everyone = [skeletons]
    if world > 1:  # the manifest is rank 0's: it carries every rank's skeletons
        everyone = [None] * world
        dist.all_gather_object(everyone, skeletons)
    return save_checkpoint(directory, step, tensors, {**dict(meta or {}), "step": step, "things": everyone},
                           rank=rank, world=world)


def load_things(directory: str | os.PathLike, things: Mapping[str, Saveable], step: int | None = None
                ) -> dict[str, Any]:
    """Load what save_things wrote (the latest unless `step`) into the same things on the same ranks; its meta."""
    _check_things(things, "load_things")
    rank, world = _world()
    ckpt = load_checkpoint(directory, step, names=lambda key: key.startswith(f"{rank}/"))
    saved = ckpt.meta.get("things")
    if not isinstance(saved, list) or len(saved) != world:
        raise CheckpointError(f"{ckpt.path}: written by save_things on {len(saved) if isinstance(saved, list) else '?'}"
                              f" rank(s), loaded on {world}; per-rank things load on the same world size "
                              "(for another grid save with save_state)")
    mine = saved[rank]
    if sorted(mine) != sorted(things):
        raise CheckpointError(f"{ckpt.path}: holds the things {sorted(mine)}, asked for {sorted(things)}; pass "
                              "the names save_things was given")
    for name, thing in things.items():
        thing.load_state_dict(unflatten_state(ckpt.tensors, mine[name]))
    return {k: v for k, v in ckpt.meta.items() if k != "things"}
