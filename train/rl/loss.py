"""Policy-gradient losses over completion tokens: GRPO's clipped ratio with a KL penalty, REINFORCE.

GRPO's per-token objective (Shao et al. 2024), with the terms and defaults of TRL 1.16's
GRPOTrainer._compute_loss (tests/test_grpo.py calls that method on the same batch):

    logp   = log softmax(logits / temperature)[token]  # the distribution the completion was sampled from
    ratio  = exp(logp - old_logp)                     # pi / pi_old per token; SEQUENCE: exp of the
                                                      # sequence's mean log-ratio (GSPO, Zheng et al. 2025)
    policy = -min(min(ratio, delta) * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
    kl     = exp(ref_logp - logp) - (ref_logp - logp) - 1    # Schulman's k3 estimate of KL(pi || pi_ref)
    kl     = kl * ratio                               # use_bias_correction_kl (DeepSeek-V3.2): the
                                                      # unbiased reverse-KL gradient; differentiable,
                                                      # so it changes the gradient even where ratio == 1
    token  = policy + beta * kl

(delta: INTELLECT-2's two-sided clip, off by default). Reduced over the completion mask:
- DAPO (TRL's default): over every completion token of the step's whole batch, all data ranks
  and microbatches together: sum / tokens. A microbatch divides by rows x the batch's mean
  completion tokens per row (RolloutTarget.mean_tokens, from one all-reduce in the rollout),
  so the mean over microbatches and data ranks (equal rows each, as TRL's per-device batches)
  is the global token mean.
- GRPO: per sequence then over sequences (the paper's 1/G sum_i 1/|o_i| sum_t).
- BNPO: over the tokens of one microbatch (TRL: of the local batch).
- DR_GRPO (Liu et al. 2025): sum / (rows x max_completion_length), a constant, the generation's
  max_new_tokens as TRL divides, not the width of a batch whose rows all stopped early.
TRL's other loss types (cispo, sapo, luspo, vespo), vLLM's importance correction, entropy
masks and bonuses are not here.

Positions differ from TRL on purpose: TRL's training forward passes no position ids, so with
left-padded prompts its log-probs count the padding as positions; pipezero's count positions
from the attention mask, as generation did (rollout.policy_inputs), so the log-probs are those
of the tokens that were sampled. Without left padding the two are the same.

The reference's log-probs come with the rollout (a frozen copy of the policy, or the base with
LoRA adapters off: train/rl/reference.py).
`PolicyLoss` is a PipelineModule loss_fn: (logits, RolloutTarget) -> scalar, so the same loss
trains through a pipeline (PipelineRunner.train_step(inputs, target)) or on one stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from pipezero.pipe.fused_loss import HeadLogits

__all__ = ["GRPOConfig", "ImportanceSampling", "Reduction", "RolloutTarget", "PolicyLoss", "completion_logprobs",
           "grpo_token_loss", "reduce_tokens"]


class Reduction(Enum):
    """How per-token losses become one number (TRL's loss_type)."""

    DAPO = "dapo"        # sum over the step's completion tokens (every data rank) / their count
    GRPO = "grpo"        # mean over each sequence's tokens, then over sequences
    BNPO = "bnpo"        # mean over every completion token of the microbatch
    DR_GRPO = "dr_grpo"  # sum / (sequences x max completion length)


class ImportanceSampling(Enum):
    """What one probability ratio covers (TRL's importance_sampling_level)."""

    TOKEN = "token"        # one ratio per token
    SEQUENCE = "sequence"  # one per sequence: exp of its mean per-token log-ratio (GSPO)


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPOConfig:
    """GRPO's knobs, with TRL 1.16's names and defaults (GRPOConfig / GRPOTrainer) where it has them."""

    beta: float = 0.0           # weight of the KL penalty to the reference (0: no reference needed)
    epsilon: float = 0.2        # ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher sets it larger, 0.28)
    delta: float | None = None  # the unclipped ratio capped at delta (two-sided clip); None: no cap
    reduction: Reduction = Reduction.DAPO  # TRL's loss_type
    importance_sampling_level: ImportanceSampling = ImportanceSampling.TOKEN
    use_bias_correction_kl: bool = True  # the KL term times the ratio (TRL 1.16's default)
    reinforce: bool = False     # plain REINFORCE: -A * logp, no ratio, no clip (the KL term stays if beta > 0)
    max_completion_length: int | None = None  # Reduction.DR_GRPO's divisor per sequence: rollout's max_new_tokens
    temperature: float = 1.0    # the sampling temperature: every log-prob is of softmax(logits / temperature)

    def __post_init__(self) -> None:
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"GRPOConfig(beta={self.beta}, epsilon={self.epsilon}, epsilon_high="
                             f"{self.epsilon_high}): expected values >= 0")
        if self.delta is not None and not self.delta > 0:
            raise ValueError(f"GRPOConfig(delta={self.delta!r}): expected None or a cap > 0 on the ratio "
                             f"(TRL recommends more than 1 + epsilon = {1 + self.epsilon})")
        if not isinstance(self.reduction, Reduction):
            raise TypeError(f"GRPOConfig(reduction={self.reduction!r}): expected a Reduction, e.g. Reduction.DAPO")
        if not isinstance(self.importance_sampling_level, ImportanceSampling):
            raise TypeError(f"GRPOConfig(importance_sampling_level={self.importance_sampling_level!r}): expected "
                            "an ImportanceSampling, e.g. ImportanceSampling.SEQUENCE")
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
    mean_tokens: torch.Tensor | None = None  # [B] Reduction.DAPO's divisor per row: the step's completion
    # tokens over its rows, every data rank's (rollout.mean_completion_tokens), the same value in each row


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
    """(per-token loss [B, n], per-token KL [B, n], zeros when beta == 0) of GRPO, or of REINFORCE when
    config.reinforce."""
    adv = target.advantages.float()[:, None]
    old = target.old_logp if target.old_logp.numel() else logp.detach()  # empty: sampled by this very policy
    ratio = torch.exp(_log_ratio(logp - old, target.mask, config.importance_sampling_level))  # [B, n] or [B, 1]
    if config.reinforce:
        policy = -adv * logp
    else:
        high = config.epsilon if config.epsilon_high is None else config.epsilon_high
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + high)
        capped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
        policy = -torch.min(capped * adv, clipped * adv)
    if not config.beta:  # TRL computes no KL then: no reference log-probs to compare with
        return policy.expand_as(logp), torch.zeros_like(logp)
    delta = target.ref_logp - logp
    kl = torch.exp(delta) - delta - 1
    if config.use_bias_correction_kl:
        kl = kl * ratio
    return (policy + config.beta * kl).expand_as(logp), kl


def _log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: ImportanceSampling) -> torch.Tensor:
    """Per-token log-ratios [B, n], or (SEQUENCE) each sequence's mean over its completion mask [B, 1]."""
    if level is ImportanceSampling.TOKEN:
        return log_ratio
    mask = mask.to(log_ratio.dtype)
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, reduction: Reduction, max_length: int | None = None,
                  mean_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """One number from per-token values over the completion mask (DR_GRPO: per max_length tokens a sequence,
    None: the width of per_token; DAPO: per mean_tokens[i] tokens for row i, the step's tokens per row)."""
    mask = mask.to(per_token.dtype)
    if reduction is Reduction.GRPO:
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if reduction is Reduction.BNPO:
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if reduction is Reduction.DAPO:
        if mean_tokens is None:
            raise ValueError("reduce_tokens(Reduction.DAPO): DAPO divides by the step's completion tokens over "
                             "every data rank; pass mean_tokens (RolloutTarget.mean_tokens, which rollout() "
                             "fills; by hand: rollout.mean_completion_tokens(mask, data_group))")
        divisor = mean_tokens.to(per_token.dtype).sum()
        return (per_token * mask).sum() / torch.where(divisor > 0, divisor, torch.ones_like(divisor))
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
        return reduce_tokens(per_token, target.mask, self.config.reduction, self.config.max_completion_length,
                             target.mean_tokens)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.config})"
