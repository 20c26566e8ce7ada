"""The optimizer chain: a link shares its inner optimizer's param_groups and forwards the rest.

`ZeroOptimizer(LossScaler(Adam(...)))`, `LossScaler(MasterWeights(Adam(...)))`: each link is a
torch.optim.Optimizer (so LR schedulers and optimizer hooks accept the outermost) whose
`param_groups` is the very list object of the optimizer it wraps, so a learning-rate change
anywhere is seen everywhere. The chain has one order: a link that reduces or partitions
(ZeroOptimizer, `outermost = True`) is the outermost, and wrapping it is refused at construction
(`LossScaler(ZeroOptimizer(...))`: a TypeError naming the order to use instead). The
protocol is its own root module, in the bottom layer beside config_fields.py (it imports only
torch), because precision/ and zero/ both implement it and neither may import the other;
`ChainLink` writes it down, `ChainWrapper` is the base both packages' links derive from.
(Until the house's second step it lived in comm/chain.py, which still re-exports it.)
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Mapping, Protocol, runtime_checkable

import torch

__all__ = ["ChainLink", "ChainWrapper", "describe", "check_inner", "check_not_outermost", "chain_step", "innermost",
           "links"]

_MAX_DEPTH = 32


@runtime_checkable
class ChainLink(Protocol):
    """What every link of the optimizer chain offers (a plain torch optimizer has all five).

    `step()` returns False when the step was skipped (inf/nan, agreed by every rank); None
    (a plain torch optimizer) means it stepped. A ChainWrapper adds `scale(loss)`,
    `prepare_grads()` (make `.grad` of the params in `param_groups` current; the link right
    outside calls it at the start of its step, before it reads any gradient: LossScaler on
    MasterWeights) and its own state apart from the inner optimizer's (`link_state_dict`,
    `load_link_state_dict`).
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


def check_not_outermost(inner: Any, who: str) -> None:
    """Raise TypeError when `inner` is a link that must be the outermost of its chain (ZeroOptimizer).

    The chain has one order, ZeRO outside: `ZeroOptimizer(LossScaler(Adam(...)), stage=2, group=...)`.
    """
    if isinstance(inner, ChainWrapper) and inner.outermost:
        name = type(inner).__name__
        raise TypeError(f"{who}({describe(inner)}): {name} must be the outermost link of the optimizer chain "
                        f"(it reduces the gradients the links inside it read); compose it the other way round, "
                        f"{name}({who}(...)), e.g. ZeroOptimizer(LossScaler(torch.optim.Adam(model.parameters())), "
                        f"stage=2, group=grid.data_group)")


def links(opt: Any) -> Iterator["ChainWrapper"]:
    """The wrappers of a chain from the outside in (the innermost torch optimizer is not one)."""
    for _ in range(_MAX_DEPTH):
        if not isinstance(opt, ChainWrapper):
            return
        yield opt
        opt = opt.inner


def innermost(opt: Any) -> Any:
    """The optimizer at the bottom of the chain: the one that holds the per-parameter state."""
    for link in links(opt):
        opt = link.inner
    return opt


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
    """Base of the links: shares `inner.param_groups`, forwards scale/prepare_grads/zero_grad.

    torch's Optimizer.__init__ runs on a placeholder parameter (it wants at least one) only to set
    up its hooks; from then on `param_groups` and `state` ARE the inner chain's, read through on
    every access: torch's load_state_dict replaces those objects, and a copy kept here would go
    stale after every resume (an lr set here would then be ignored). `state_dict()`
    is `{"inner": inner.state_dict(), **link_state_dict()}`: each link serialises only its own
    state, the inner chain once.

    `outermost = True` (ZeroOptimizer) says a link must be the outermost of its chain: it
    reduces the gradients and hands them to the links inside it, so no link may read them
    before it; wrapping it raises TypeError (`check_not_outermost`). `holds_copies = True`
    (MasterWeights) says the param_groups hold copies of the model's parameters.
    """

    outermost: ClassVar[bool] = False
    # True for a link whose param_groups hold copies of the model's parameters (MasterWeights'
    # fp32 masters): a link outside it that reduces gradients would find none on those copies
    holds_copies: ClassVar[bool] = False

    def __init__(self, inner: Any):
        check_inner(inner, type(self).__name__)
        check_not_outermost(inner, type(self).__name__)
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
        """The innermost optimizer's per-parameter state itself."""
        inner = self.__dict__.get("inner")
        return getattr(innermost(inner), "state", None) if inner is not None else self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        if "inner" in self.__dict__:
            innermost(self.inner).state = state
        else:
            self.__dict__["_own_state"] = state

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (and so to the shared list)."""
        if "inner" not in self.__dict__:  # torch's __init__ adding the placeholder
            super().add_param_group(param_group)
            return
        self.inner.add_param_group(param_group)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Forward to the inner link's scale(loss); the loss unchanged at the bottom of the chain."""
        return self.inner.scale(loss) if isinstance(self.inner, ChainWrapper) else loss

    def backward(self, loss: torch.Tensor) -> None:
        """`self.scale(loss).backward()`."""
        self.scale(loss).backward()

    def prepare_grads(self) -> None:
        """Forward to the inner link's prepare_grads() (nothing to do at the bottom of the chain)."""
        if isinstance(self.inner, ChainWrapper):
            self.inner.prepare_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forward to the inner optimizer."""
        self.inner.zero_grad(set_to_none=set_to_none)

    # -- checkpoints ------------------------------------------------------------------
    def link_state_dict(self) -> dict:
        """This link's own state, without the inner optimizer's (none by default)."""
        return {}

    def load_link_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what link_state_dict() returned (its keys are checked first)."""
        name, expected = type(self).__name__, sorted(self.link_state_dict())
        if not isinstance(state, Mapping) or sorted(state) != expected:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{name}: its own state has the keys {expected} (link_state_dict()), got {got}")
        self._load_link(state)

    def _load_link(self, state: Mapping[str, Any]) -> None:
        """Restore this link's own state (keys already checked); links with state override this."""

    def state_dict(self) -> dict:
        """{"inner": inner.state_dict(), **link_state_dict()}."""
        return {"inner": self.inner.state_dict(), **self.link_state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what state_dict() returned: this link's own state, then the inner chain's."""
        name, expected = type(self).__name__, sorted(["inner", *self.link_state_dict()])
        if not isinstance(state_dict, Mapping) or sorted(state_dict) != expected:
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"{name}.load_state_dict expects the keys {expected} from {name}.state_dict(), "
                             f"got {got}")
        self.load_link_state_dict({k: v for k, v in state_dict.items() if k != "inner"})
        self.inner.load_state_dict(state_dict["inner"])
