"""A torch optimizer, or an optimizer chain without ZeroOptimizer, seen by parameter (`ByNameState`).

The grid-independent checkpoint (state.py) stores each parameter and its optimizer state whole,
under the parameter's global name. ZeroOptimizer hands them over from its shards; a plain torch
optimizer, or a LossScaler / MasterWeights chain over one, already holds them whole: the
innermost optimizer's `state_dict()` IS the consolidated layout ZeroOptimizer writes (state per
parameter, parameters numbered in param-group order; `ZeroOptimizer.consolidated_state_dict`).
So this view reads and writes it through the Saveable protocol (state_dict / load_state_dict)
and `param_groups`, and a checkpoint moves between a plain job and a ZeRO one of any degree.
A MasterWeights link's masters stand in for their model parameters (`HoldsMasters`). Several
optimizers over different parameters (pipe/expert/'s experts beside the dense ZeroOptimizer) are
seen as one (`JoinedByName`): a checkpoint records state by parameter name, not by optimizer, so it
loads whichever optimizers hold those names on the other side.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from pipezero.chain import innermost, links
from pipezero.train.checkpoint.state_parts import ByNameState
from pipezero.train.checkpoint.tensor_state import whole_shape

__all__ = ["ChainByName", "HoldsMasters", "JoinedByName", "by_name"]


@runtime_checkable
class HoldsMasters(Protocol):
    """A chain link that steps copies of the model's parameters (precision/master.py's MasterWeights)."""

    def master_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def by_name(optimizer: Any) -> ByNameState:
    """The optimizer itself when it gives its state by parameter (ZeroOptimizer), else a ChainByName view
    (a JoinedByName one for a list of optimizers)."""
    if isinstance(optimizer, (list, tuple)):
        return JoinedByName(optimizer) if len(optimizer) != 1 else by_name(optimizer[0])
    if isinstance(optimizer, ByNameState):
        return optimizer
    return ChainByName(optimizer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ChainByName:
    """ByNameState over a chain that holds every parameter whole (no ZeroOptimizer); no collective."""

    def __init__(self, optimizer: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"save_state / load_state: the optimizer is a {type(optimizer).__name__}; expected a "
                            "ZeroOptimizer, a LossScaler / MasterWeights chain or a torch.optim.Optimizer")
        self.inner = optimizer                   # its wrappers' own state: links(inner)
        self._core = innermost(optimizer)
        self._model_of: dict[int, torch.Tensor] = {}
        for link in links(optimizer):
            if isinstance(link, HoldsMasters):
                self._model_of.update({id(master): param for param, master in link.master_pairs()})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def original_params(self) -> list[list[torch.Tensor]]:
        """Each group's model parameters (a master stands for its model parameter)."""
        return [[self._model_of.get(id(m), m) for m in group["params"]] for group in self.param_groups]

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, what the optimizer steps for it) in param-group order (torch's numbering)."""
        return [(self._model_of.get(id(m), m), m) for group in self.param_groups for m in group["params"]]

    def full_shapes(self) -> dict[int, torch.Size]:
        """The whole shapes (a split parameter's, comm.TensorShard: a tensor-parallel or an expert slice)."""
        return {id(p): whole_shape(p) for p, _ in self._pairs()}

    def full_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its value as the optimizer steps it: the fp32 master under MasterWeights)."""
        return [(p, _local(m).detach()) for p, m in self._pairs()]

    def load_full_parameters(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        with torch.no_grad():
            for p, m in self._pairs():
                _local(m).copy_(value_of(p))
                if p is not m:
                    _local(p).copy_(_local(m))

    def per_parameter_state(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(model parameter, the innermost optimizer's state for it) for each parameter with state."""
        state = self._core.state_dict()["state"]
        return [(p, {k: _local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in state[i].items()})
                for i, (p, _) in enumerate(self._pairs()) if state.get(i)]

    def load_per_parameter_state(self, state_of: Callable[[torch.Tensor], dict[str, Any] | None]) -> None:
        """The innermost optimizer's load_state_dict of the state by parameter (torch casts and places it)."""
        groups = self._core.state_dict()["param_groups"]  # this optimizer's own settings and numbering
        state = {}
        for i, (p, m) in enumerate(self._pairs()):
            entry = state_of(p)
            if entry:
                state[i] = {k: _like(m, v) for k, v in entry.items()}
        self._core.load_state_dict({"state": state, "param_groups": groups})


def _like(param: torch.Tensor, value: Any) -> Any:
    """A whole-parameter state tensor of a tensor-parallel parameter back as a DTensor like it."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


class JoinedByName:
    """ByNameState over several optimizers holding different parameters, in their order; no collective
    of its own. The first one's links are the chain a checkpoint records (its loss scale): another one
    whose links keep state of their own is refused, as is a parameter held by two of them."""

    def __init__(self, optimizers: list[Any] | tuple[Any, ...]):
        self._parts = [by_name(o) for o in optimizers]
        if not self._parts:
            raise TypeError("save_state / load_state: an empty list of optimizers; pass the job's optimizers")
        self.inner = self._parts[0].inner
        kept = [type(link).__name__ for part in self._parts[1:] for link in links(part.inner)
                if not isinstance(link, HoldsMasters) and link.link_state_dict()]
        if kept:
            raise TypeError(f"save_state / load_state: optimizers after the first keep state of their own in "
                            f"{kept}, which a checkpoint records for the first one's chain only; wrap only the "
                            "first (the dense parameters' chain) or put the parameters under one chain")
        seen: dict[int, int] = {}
        for i, part in enumerate(self._parts):
            for group in part.original_params:
                for p in group:
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError(f"save_state / load_state: a parameter of shape {tuple(p.shape)} is in "
                                         f"optimizers {seen[id(p)]} and {i}; give each parameter to one optimizer")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self._parts for group in part.param_groups]

    @property
    def original_params(self) -> list[list[torch.Tensor]]:
        return [params for part in self._parts for params in part.original_params]

    def full_shapes(self) -> dict[int, torch.Size]:
        return {k: v for part in self._parts for k, v in part.full_shapes().items()}

    def full_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [pair for part in self._parts for pair in part.full_parameters()]

    def load_full_parameters(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for part in self._parts:
            part.load_full_parameters(value_of)

    def per_parameter_state(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [pair for part in self._parts for pair in part.per_parameter_state()]

    def load_per_parameter_state(self, state_of: Callable[[torch.Tensor], dict[str, Any] | None]) -> None:
        for part in self._parts:
            part.load_per_parameter_state(state_of)
