"""Advantages from rewards: GRPO's group-relative normalisation and REINFORCE's batch baseline.

GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1) samples a group of G completions per
prompt and scores each completion against its own group: A_i = (r_i - mean(r_group)) /
(std(r_group) + eps), so no value model is needed. TRL's GRPOTrainer computes the same
(unbiased std, eps 1e-4; `scale_rewards=False` drops the division, as Dr. GRPO argues, Liu
et al. 2025). REINFORCE (Williams 1992) subtracts one baseline, the batch's mean reward.
"""

from __future__ import annotations

import torch

__all__ = ["batch_baseline", "group_advantages"]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """[B] rewards, B = prompts x group_size with each prompt's completions adjacent -> [B] advantages."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: expected [prompts * group_size] rewards with group_size >= 1, got shape "
                         f"{tuple(rewards.shape)} and group_size={group_size}; repeat each prompt group_size times "
                         "(repeat_interleave) before generating")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    return centred.reshape(-1)


def batch_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE's advantage: each reward minus the batch mean (per position when rewards are [B, n])."""
    return rewards.float() - rewards.float().mean(0, keepdim=True)
