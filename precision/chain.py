"""The optimizer chain: a wrapper shares its inner optimizer's param_groups and forwards the rest.

`LossScaler(MasterWeights(Adam(...)))`: each link is a torch.optim.Optimizer (so LR schedulers
and optimizer hooks accept the outermost) whose `param_groups` is the very list object of the
optimizer it wraps, so a learning-rate change anywhere is seen everywhere. The protocol the links
(and zero/'s ZeroOptimizer) follow is written down in `ChainLink`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["ChainLink", "ChainWrapper", "describe", "check_inner", "chain_step"]


@runtime_checkable
class ChainLink(Protocol):
    """What every link of the optimizer chain offers (a plain torch optimizer has the first five).

    `step()` returns False when the step was skipped (inf/nan, agreed by every rank); None
    (a plain torch optimizer) means it stepped. Optional extras: `scale(loss)` and
    `prepare_grads()` (make `.grad` of the params in `param_groups` current; called by the
    outer link at the start of its step, before it reads any gradient).
    """

    param_groups: list

    def step(self, closure: Any = None) -> bool | None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


def check_inner(inner: Any, who: str) -> None:
    """Raise TypeError unless `inner` is an optimizer (torch's or a chain link)."""
    if isinstance(inner, torch.optim.Optimizer):
        return
    missing = [name for name in ("param_groups", "step", "zero_grad", "state_dict", "load_state_dict")
               if not hasattr(inner, name)]
    if missing or not isinstance(inner.param_groups, list):
        raise TypeError(f"{who}(inner={type(inner).__name__}) needs an optimizer to wrap (a torch.optim."
                        f"Optimizer or a chain link), but it lacks {missing or ['a param_groups list']}; "
                        f"build one first, e.g. {who}(torch.optim.Adam(model.parameters()))")


def describe(opt: Any) -> str:
    """The short name of a link for a nesting repr: a plain optimizer by class, a wrapper by its repr."""
    own_repr = type(opt).__repr__
    if own_repr is torch.optim.Optimizer.__repr__ or own_repr is object.__repr__:
        return type(opt).__name__
    return repr(opt)


def chain_step(inner: Any) -> bool:
    """Step `inner` and say whether it stepped (a plain torch optimizer returns None: stepped)."""
    return inner.step() is not False


class ChainWrapper(torch.optim.Optimizer):
    """Base of the links here: shares `inner.param_groups`, forwards scale/zero_grad/add_param_group.

    torch's Optimizer.__init__ runs on a placeholder parameter (it wants at least one) only to set
    up its hooks; from then on `param_groups` and `state` ARE the inner optimizer's, read through
    on every access: torch's load_state_dict replaces those objects, and a copy kept here would
    go stale after every resume (an lr set here would then be ignored).
    """

    def __init__(self, inner: Any):
        check_inner(inner, type(self).__name__)
        super().__init__([torch.empty(0)], {})
        self.inner = inner
        self.defaults = getattr(inner, "defaults", {})
        self.last_step_skipped = False

    @property
    def param_groups(self) -> list:
        """The inner optimizer's param_groups list itself."""
        inner = self.__dict__.get("inner")
        return inner.param_groups if inner is not None else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        if "inner" in self.__dict__:
            self.inner.param_groups = groups
        else:  # torch's __init__, before the chain is linked
            self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state itself."""
        inner = self.__dict__.get("inner")
        return getattr(inner, "state", None) if inner is not None else self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        if "inner" in self.__dict__:
            self.inner.state = state
        else:
            self.__dict__["_own_state"] = state

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (and so to the shared list)."""
        if "inner" not in self.__dict__:  # torch's __init__ adding the placeholder
            super().add_param_group(param_group)
            return
        self.inner.add_param_group(param_group)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Forward to the inner link's scale(loss), or return the loss unchanged."""
        inner_scale = getattr(self.inner, "scale", None)
        return inner_scale(loss) if inner_scale is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """`self.scale(loss).backward()`."""
        self.scale(loss).backward()

    def prepare_grads(self) -> None:
        """Forward to the inner link's prepare_grads(), if it has one."""
        prepare = getattr(self.inner, "prepare_grads", None)
        if prepare is not None:
            prepare()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forward to the inner optimizer."""
        self.inner.zero_grad(set_to_none=set_to_none)
