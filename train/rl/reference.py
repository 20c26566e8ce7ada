"""The reference policy of GRPO's KL penalty: a frozen copy of the starting policy.

GRPO keeps the policy near a reference (usually the model it started from). `FrozenCopy`
holds a whole, frozen copy: the simplest reference, at the cost of one more set of weights
per rank. A LoRA-trained policy needs no copy: the base model with its adapters disabled
is the reference; that implementation (pipe/lora.py, in progress) plugs in here by
implementing `Reference` (run the policy's own module with the adapters switched off).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import nn

from pipezero.train.rl.loss import completion_logprobs

__all__ = ["FrozenCopy", "Reference"]


class Reference(Protocol):
    """Log-probs of completion tokens under the reference policy."""

    def completion_logprobs(self, inputs: tuple[torch.Tensor, ...], completion: torch.Tensor) -> torch.Tensor:
        """inputs: (ids [B, P + n], attention_mask, position_ids) of prompt + completion -> [B, n] log-probs."""
        ...


class FrozenCopy:
    """A deep copy of a whole (pipe=1) policy module, with no gradients, taken before training starts."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None):
        empty = [n for n, p in module.named_parameters() if p.numel() == 0]
        if empty:
            raise ValueError(f"FrozenCopy: {len(empty)} parameters of the module are empty ({empty[:3]}...): it is "
                             "ZeRO-3 partitioned. Take the copy before ZeroOptimizer(stage=3, module=...) wraps it, "
                             "or build a second module from the same specs")
        shared = {id(g): g for g in [getattr(module, "grid", None)] if g is not None}  # its process groups
        self.module = copy.deepcopy(module, memo=shared).requires_grad_(False).eval()
        if dtype is not None:
            self.module.to(dtype)

    @torch.no_grad()
    def completion_logprobs(self, inputs: tuple[torch.Tensor, ...], completion: torch.Tensor) -> torch.Tensor:
        return completion_logprobs(self.module(inputs), completion)
