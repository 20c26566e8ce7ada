"""Reinforcement learning from rewards on the training weights: GRPO and REINFORCE parts.

`rollout` (generate from the training weights, reward, advantages), `PolicyLoss` (GRPO's
clipped ratio and KL with TRL 1.16's loss types and defaults, or REINFORCE), `FrozenCopy` or,
for a LoRA policy, `AdaptersOff` (the reference policy), `train_step`. Log-probs count positions
from the attention mask, as generation does (TRL's training forward counts left padding).
examples/grpo_arithmetic.py puts them together into a loop.
"""

from pipezero.train.rl.advantages import batch_baseline, group_advantages
from pipezero.train.rl.loss import (GRPOConfig, ImportanceSampling, PolicyLoss, Reduction, RolloutTarget,
                                    completion_logprobs, grpo_token_loss, reduce_tokens)
from pipezero.train.rl.reference import AdaptersOff, FrozenCopy, Reference
from pipezero.train.rl.rollout import (RewardFn, Rollout, completion_mask, mean_completion_tokens, policy_inputs,
                                       rollout, train_step)

__all__ = ["AdaptersOff", "FrozenCopy", "GRPOConfig", "ImportanceSampling", "PolicyLoss", "Reduction", "Reference",
           "RewardFn", "Rollout", "RolloutTarget", "batch_baseline", "completion_logprobs", "completion_mask",
           "group_advantages", "grpo_token_loss", "mean_completion_tokens", "policy_inputs", "reduce_tokens",
           "rollout", "train_step"]
