"""MasterWeights: fp32 master copies of bf16/fp16 parameters for the inner optimizer (no ZeRO needed).

An fp16/bf16 weight cannot absorb updates much smaller than itself (lr * grad vanishes in the
rounding), so mixed-precision training keeps an fp32 master copy that the optimizer updates and
copies back into the model after each step (Micikevicius et al., 2018, "Mixed Precision Training").
The wrapper swaps the model parameters in the inner optimizer's param_groups for their masters,
so Adam's state is fp32 too. ZeroOptimizer does the same for its shards; this is for users
without ZeRO:  LossScaler(MasterWeights(torch.optim.Adam(model.parameters()))).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from pipezero.comm import is_replica, mark_replica
from pipezero.chain import ChainWrapper, chain_step, describe

__all__ = ["MasterWeights"]


class MasterWeights(ChainWrapper):
    """Keep fp32 masters of low-precision params; the inner optimizer steps them, the model gets copies.

    Parameters already in `master_dtype` are their own masters (no copy). `prepare_grads()` copies
    the model's gradients into the masters' (an outer LossScaler calls it before unscaling);
    `step()` does so itself when nobody did, steps the inner optimizer and, unless it skipped,
    copies the masters back into the model.
    """

    holds_copies = True  # param_groups hold the masters, not the model's parameters

    def __init__(self, inner: Any, master_dtype: torch.dtype = torch.float32):
        super().__init__(inner)
        if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
            raise TypeError(f"MasterWeights(master_dtype={master_dtype!r}): expected a floating torch.dtype")
        if getattr(inner, "state", None):
            raise ValueError(f"MasterWeights({describe(inner)}) needs an optimizer that has not stepped yet "
                             f"(its state would belong to the low-precision params); wrap it right after "
                             f"building it")
        self.master_dtype = master_dtype
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model param, master), copies only
        self._grads_ready = False
        for group in self.param_groups:
            group["params"] = [self._master_of(p) for p in group["params"]]

    def _master_of(self, param: torch.Tensor) -> torch.Tensor:
        if param.dtype == self.master_dtype or not param.requires_grad:  # frozen (LoRA's base): never stepped
            return param
        master = torch.nn.Parameter(param.detach().to(self.master_dtype).clone(),
                                    requires_grad=param.requires_grad)
        if is_replica(param):
            mark_replica(master)
        self._pairs.append((param, master))
        return master

    def master_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its fp32 master) for each copied parameter (one already in master_dtype is
        its own master and not listed): what a checkpoint by parameter name saves for the model's."""
        return list(self._pairs)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of model params: their masters go to the inner optimizer."""
        if "inner" not in self.__dict__:  # torch's __init__ adding the placeholder
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.inner.add_param_group({**param_group, "params": [self._master_of(p) for p in params]})

    def prepare_grads(self) -> None:
        """Copy the model gradients into the masters' (fp32) gradients."""
        with torch.no_grad():
            for param, master in self._pairs:
                if param.grad is None:
                    master.grad = None
                elif master.grad is None:
                    master.grad = param.grad.to(self.master_dtype)
                else:
                    master.grad.copy_(param.grad)
        self._grads_ready = True
        super().prepare_grads()

    def step(self, closure: Any = None) -> bool:
        """Step the inner optimizer on the masters, then copy them into the model (unless skipped)."""
        if closure is not None:
            raise TypeError("MasterWeights.step() takes no closure: run backward before step()")
        if not self._grads_ready:
            self.prepare_grads()
        stepped = chain_step(self.inner)
        if stepped and self._pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])
        self._grads_ready = False
        self.last_step_skipped = not stepped
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the masters'."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for param, _ in self._pairs:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
        self._grads_ready = False

    def link_state_dict(self) -> dict:
        """{"master": {"<i>": fp32 master of the i-th copied param}}; state_dict() adds "inner"."""
        return {"master": {str(i): master.detach() for i, (_, master) in enumerate(self._pairs)}}

    def _load_link(self, state: Mapping[str, Any]) -> None:
        """Restore what link_state_dict() returned (the masters are copied in place)."""
        masters = state["master"]
        expected = {str(i): tuple(m.shape) for i, (_, m) in enumerate(self._pairs)}
        got = {k: tuple(v.shape) for k, v in masters.items()}
        if got != expected:
            raise ValueError(f"MasterWeights.load_state_dict: saved masters {got} do not match this "
                             f"model's {expected}; load a checkpoint of the same model")
        with torch.no_grad():
            for i, (_, master) in enumerate(self._pairs):
                master.copy_(masters[str(i)])

    def __repr__(self) -> str:
        return f"MasterWeights({describe(self.inner)})"
