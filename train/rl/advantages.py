"""Advantages from rewards: GRPO's group-relative normalisation and REINFORCE's batch baseline.

GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1) samples a group of G completions per
prompt and scores each completion against its own group: A_i = (r_i - mean(r_group)) /
(std(r_group) + eps), so no value model is needed. TRL 1.16's GRPOTrainer computes the same
(unbiased std, eps 1e-4; `scale_rewards="none"`, here scale=False, drops the division, as
Dr. GRPO argues, Liu et al. 2025). REINFORCE (Williams 1992) subtracts one baseline, the batch's
mean reward.

A NaN reward (a completion no reward function could score) is left out as TRL leaves it out:
the group's mean and std are over the other rewards, and the NaN row's advantage is 0, so it
neither moves the policy nor turns every other advantage (and so every weight) into NaN.
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
    centred = groups - groups.nanmean(-1, keepdim=True)
    if scale:
        std = _nanstd(groups) if group_size > 1 else torch.zeros_like(groups)
        centred = centred / (std + eps)
    return centred.nan_to_num(nan=0.0).reshape(-1)


def batch_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE's advantage: each reward minus the batch mean (per position when rewards are [B, n]);
    NaN rewards are left out of the mean and get advantage 0."""
    rewards = rewards.float()
    return (rewards - rewards.nanmean(0, keepdim=True)).nan_to_num(nan=0.0)


def _nanstd(groups: torch.Tensor) -> torch.Tensor:
    """[G, k] -> [G, 1] unbiased std of each row's non-NaN values (NaN where fewer than two)."""
    count = (~groups.isnan()).sum(-1, keepdim=True)
    squares = (groups - groups.nanmean(-1, keepdim=True)).pow(2).nansum(-1, keepdim=True)
    return torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.nan)
