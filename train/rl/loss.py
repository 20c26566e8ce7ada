"""Policy-gradient losses over completion tokens: GRPO's clipped ratio with a KL penalty, REINFORCE.

GRPO's per-token objective (Shao et al. 2024; in the form TRL's GRPOTrainer computes it):

    logp   = log softmax(logits / temperature)[token]  # the distribution the completion was sampled from
    ratio  = exp(logp - old_logp)                     # pi / pi_old of each completion token
    policy = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    kl     = exp(ref_logp - logp) - (ref_logp - logp) - 1    # Schulman's k3 estimate of KL(pi || pi_ref)
    token  = policy + beta * kl

reduced over the completion mask either per sequence then over sequences ("grpo": the
paper's 1/G sum_i 1/|o_i| sum_t), over all tokens at once ("bnpo"), or over batch x
max_completion_length ("dr_grpo", Liu et al. 2025: a constant, the generation's max_new_tokens,
as TRL divides, not the width of a batch whose rows all stopped early). The reference's
log-probs come with the rollout (a frozen copy of the policy, or the base with LoRA adapters
off: train/rl/reference.py).
`PolicyLoss` is a PipelineModule loss_fn: (logits, RolloutTarget) -> scalar, so the same loss
trains through a pipeline (PipelineRunner.train_step(inputs, target)) or on one stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from pipezero.pipe.fused_loss import HeadLogits

__all__ = ["GRPOConfig", "Reduction", "RolloutTarget", "PolicyLoss", "completion_logprobs", "grpo_token_loss",
           "reduce_tokens"]


class Reduction(Enum):
    """How per-token losses become one number."""

    GRPO = "grpo"        # mean over each sequence's tokens, then over sequences
    BNPO = "bnpo"        # mean over every completion token of the batch
    DR_GRPO = "dr_grpo"  # sum / (sequences x max completion length)


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPOConfig:
    """GRPO's knobs (TRL's names and defaults where it has them)."""

    beta: float = 0.04          # weight of the KL penalty to the reference (0: no reference needed)
    epsilon: float = 0.2        # ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher sets it larger)
    reduction: Reduction = Reduction.GRPO
    reinforce: bool = False     # plain REINFORCE: -A * logp, no ratio, no clip (the KL term stays if beta > 0)
    max_completion_length: int | None = None  # Reduction.DR_GRPO's divisor per sequence: rollout's max_new_tokens
    temperature: float = 1.0    # the sampling temperature: every log-prob is of softmax(logits / temperature)

    def __post_init__(self) -> None:
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"GRPOConfig(beta={self.beta}, epsilon={self.epsilon}, epsilon_high="
                             f"{self.epsilon_high}): expected values >= 0")
        if not isinstance(self.reduction, Reduction):
            raise TypeError(f"GRPOConfig(reduction={self.reduction!r}): expected a Reduction, e.g. Reduction.GRPO")
        if not self.temperature > 0:
            raise ValueError(f"GRPOConfig(temperature={self.temperature!r}): expected the sampling temperature, > 0")
        length = self.max_completion_length
        if self.reduction is Reduction.DR_GRPO and (not isinstance(length, int) or length < 1):
            raise ValueError(f"GRPOConfig(reduction=Reduction.DR_GRPO, max_completion_length={length!r}): Dr. GRPO "
                             "divides by sequences x a constant length; pass max_completion_length=max_new_tokens "
                             "(a batch whose rows all stopped early is narrower)")


class RolloutTarget(NamedTuple):
    """What the loss needs beside the logits, per completion token [B, n] (advantages [B])."""

    completion: torch.Tensor    # [B, n] token ids generated
    mask: torch.Tensor          # [B, n] 1 up to and including the stop token, 0 after
    advantages: torch.Tensor    # [B]
    old_logp: torch.Tensor      # [B, n] log-probs under the policy that generated them ([B, 0]: this one)
    ref_logp: torch.Tensor      # [B, n] log-probs under the reference (zeros when beta == 0)


def completion_logprobs(logits: torch.Tensor | HeadLogits, completion: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """[B, P + n, V] logits of prompt + completion -> [B, n] log-probs of the completion tokens (fp32) under
    softmax(logits / temperature), the distribution Sampling(temperature) drew them from (TRL divides so)."""
    n = completion.size(1)
    if isinstance(logits, HeadLogits):  # hf_layer_specs(fused_loss=True): only the completion's logits
        logits = logits._replace(hidden=logits.hidden[:, -n - 1:]).logits()
    chosen = logits[:, -n - 1:-1].float() / temperature  # the logits that predicted each completion token
    return torch.log_softmax(chosen, -1).gather(-1, completion[..., None])[..., 0]


def grpo_token_loss(logp: torch.Tensor, target: RolloutTarget, config: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [B, n], per-token KL [B, n]) of GRPO, or of REINFORCE when config.reinforce."""
    adv = target.advantages.float()[:, None]
    if config.reinforce:
        policy = -adv * logp
    else:
        old = target.old_logp if target.old_logp.numel() else logp.detach()  # empty: sampled by this very policy
        ratio = torch.exp(logp - old)
        high = config.epsilon if config.epsilon_high is None else config.epsilon_high
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + high)
        policy = -torch.min(ratio * adv, clipped * adv)
    delta = target.ref_logp - logp
    kl = torch.exp(delta) - delta - 1
    return (policy + config.beta * kl if config.beta else policy), kl


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, reduction: Reduction,
                  max_length: int | None = None) -> torch.Tensor:
    """One number from per-token values over the completion mask (DR_GRPO: per max_length tokens a sequence,
    None: the width of per_token)."""
    mask = mask.to(per_token.dtype)
    if reduction is Reduction.GRPO:
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if reduction is Reduction.BNPO:
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return (per_token * mask).sum() / (per_token.size(0) * (max_length or per_token.size(-1)))


class PolicyLoss:
    """loss_fn(logits, RolloutTarget) -> the GRPO (or REINFORCE) loss; `last_kl` keeps the batch's mean KL."""

    def __init__(self, config: GRPOConfig = GRPOConfig()):
        self.config = config
        self.last_kl: float = 0.0

    def __call__(self, logits: torch.Tensor, target: RolloutTarget) -> torch.Tensor:
        target = RolloutTarget(*target)  # a pipeline's microbatch arrives as a plain tuple
        logp = completion_logprobs(logits, target.completion, self.config.temperature)
        per_token, kl = grpo_token_loss(logp, target, self.config)
        self.last_kl = float(reduce_tokens(kl.detach(), target.mask, Reduction.BNPO))
        return reduce_tokens(per_token, target.mask, self.config.reduction, self.config.max_completion_length)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.config})"
