"""The reference policy of GRPO's KL penalty: the starting policy, as a frozen copy or as the LoRA base.

GRPO keeps the policy near a reference (usually the model it started from). `FrozenCopy`
holds a whole, frozen copy: the simplest reference, at the cost of one more set of weights
per rank. A LoRA-trained policy needs no copy: its frozen base is the starting model, so
`AdaptersOff` runs the policy's own module with the adapters switched off
(pipe/lora.py's adapters_disabled), under no_grad: no memory beyond the forward's.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import nn

from pipezero.pipe.lora import adapters_disabled
from pipezero.precision import cast_parameters
from pipezero.train.rl.loss import completion_logprobs

__all__ = ["AdaptersOff", "FrozenCopy", "Reference"]


class Reference(Protocol):
    """Log-probs of completion tokens under the reference policy."""

    def completion_logprobs(self, inputs: tuple[torch.Tensor, ...], completion: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
        """inputs: (ids [B, P + n], attention_mask, position_ids) of prompt + completion -> [B, n] log-probs
        under softmax(logits / temperature)."""
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
            cast_parameters(self.module, dtype)

    @torch.no_grad()
    def completion_logprobs(self, inputs: tuple[torch.Tensor, ...], completion: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
        return completion_logprobs(self.module(inputs), completion, temperature)


class AdaptersOff:
    """The policy module itself with its LoRA adapters disabled: the base model, no second copy.

    Exactly the starting policy as long as only the adapters train (lora_specs freezes the
    base). It runs in eval mode (no dropout), as FrozenCopy does; the module's mode is put back.
    Under ZeRO-3 the forward gathers as any forward does."""

    def __init__(self, module: nn.Module):
        with adapters_disabled(module):  # a ValueError now when the module has no adapters
            pass
        self.module = module

    @torch.no_grad()
    def completion_logprobs(self, inputs: tuple[torch.Tensor, ...], completion: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
        training = self.module.training
        self.module.eval()
        try:
            with adapters_disabled(self.module):
                return completion_logprobs(self.module(inputs), completion, temperature)
        finally:
            self.module.train(training)
