"""Experience for an RL step: sample G completions per prompt from the training weights, reward, score.

One call is the experience phase of DeepSpeed-Chat's hybrid engine: the ZeRO shards are
gathered once (`gathered(opt, dtype)`: whole weights, optionally bf16), the policy generates
with its KV cache (pipe/hf/generate.py) and, if asked, scores the old log-probs while the
weights are whole, the copies are freed, then the user's reward function scores each completion and the
advantages follow (group-relative for GRPO, a batch baseline for REINFORCE). The returned
`Rollout` feeds `train_step` (or a PipelineRunner: its inputs and target are tensors split
into microbatches). Scoring runs the module whole, so the RL step itself is pipe=1; the
generation alone also runs across a pipeline.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from pipezero.pipe.hf.generate import Sampling, hf_generate
from pipezero.train.rl.advantages import batch_baseline, group_advantages
from pipezero.train.rl.loss import GRPOConfig, PolicyLoss, Reduction, RolloutTarget, completion_logprobs
from pipezero.train.rl.reference import Reference
from pipezero.zero.gathered import gathered

__all__ = ["RewardFn", "Rollout", "completion_mask", "policy_inputs", "rollout", "train_step"]

RewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(prompt_ids [B, P], prompt_mask [B, P], completion [B, n], completion_mask [B, n]) -> rewards [B]."""


@dataclass(slots=True)
class Rollout:
    """One batch of experience: the training forward's inputs, the loss target, rewards, timings."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (ids, attention_mask, position_ids) [B, P + n]
    target: RolloutTarget
    rewards: torch.Tensor                                     # [B]
    timings: dict[str, float] = field(default_factory=dict)  # gather_s, generate_s, score_s, reward_s


def completion_mask(completion: torch.Tensor, stop_tokens: Sequence[int]) -> torch.Tensor:
    """[B, n] 1 up to and including each row's first stop token, 0 after it."""
    stops = torch.tensor(list(stop_tokens), dtype=completion.dtype, device=completion.device)
    hit = torch.isin(completion, stops).long()
    after = hit.cumsum(-1) - hit  # stop tokens strictly before this position
    return (after == 0).long()


def policy_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention_mask, position_ids) of left-padded prompt + completion, positions as generation counted them."""
    ids = torch.cat([prompt_ids, completion], 1)
    mask = torch.cat([prompt_mask.long(), torch.ones_like(completion)], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, positions


def rollout(module: Any, opt: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, reward_fn: RewardFn, *,
            group_size: int, max_new_tokens: int, sampling: Sampling, stop_tokens: Sequence[int],
            pad_token_id: int, config: GRPOConfig = GRPOConfig(), reference: Reference | None = None,
            gather_dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
            score_old: bool = False) -> Rollout:
    """Sample group_size completions of each prompt from the policy and turn them into a Rollout.

    opt: the ZeroOptimizer (any stage) that owns the policy's weights; under ZeRO-3 they are
    gathered once for the phase. reference: needed when config.beta > 0. score_old: keep the
    sampling policy's log-probs (scored while the weights are whole) for several steps on one
    rollout; without it the ratio is taken against the training forward's own detached
    log-probs, exact for one step per rollout (TRL's num_iterations=1) and one forward cheaper.
    """
    if config.beta > 0 and reference is None:
        raise ValueError(f"rollout: GRPOConfig(beta={config.beta}) penalises the KL to a reference policy; pass "
                         "reference=FrozenCopy(module) (taken before training), or set beta=0")
    if config.reduction is Reduction.DR_GRPO and config.max_completion_length != max_new_tokens:
        raise ValueError(f"rollout: GRPOConfig(max_completion_length={config.max_completion_length}) is Dr. GRPO's "
                         f"divisor, max_new_tokens={max_new_tokens}; expected the same length")
    if sampling.temperature > 0 and sampling.temperature != config.temperature:
        raise ValueError(f"rollout: Sampling(temperature={sampling.temperature}) samples softmax(logits / "
                         f"{sampling.temperature}), GRPOConfig(temperature={config.temperature}) scores the tokens "
                         "under another distribution; expected the same temperature in both")
    if module.grid.pipe_size != 1:
        raise ValueError(f"rollout: pipe={module.grid.pipe_size}; the RL step scores whole sequences on one stage, "
                         "so use pipe=1 (hf_generate alone runs across a pipeline)")
    ids = prompt_ids.repeat_interleave(group_size, 0)
    mask = prompt_mask.repeat_interleave(group_size, 0)
    timings: dict[str, float] = {}
    with ExitStack() as phase:
        t0 = time.perf_counter()
        phase.enter_context(gathered(opt, dtype=gather_dtype))
        t1 = time.perf_counter()
        seqs = hf_generate(module, ids, max_new_tokens, mask, sampling, stop_tokens, pad_token_id,
                           generator=generator)
        t2 = time.perf_counter()
        completion = seqs[:, ids.size(1):]
        inputs = policy_inputs(ids, mask, completion)
        old = completion.new_zeros(completion.size(0), 0, dtype=torch.float32)  # empty: this very policy
        if score_old:
            with torch.no_grad():
                old = completion_logprobs(module(inputs), completion, config.temperature)  # the weights are whole
        t3 = time.perf_counter()
    timings.update(gather_s=(t1 - t0) + (time.perf_counter() - t3), generate_s=t2 - t1, score_s=t3 - t2)
    t4 = time.perf_counter()
    done = completion_mask(completion, stop_tokens)
    rewards = reward_fn(ids, mask, completion, done).float()
    advantages = batch_baseline(rewards) if config.reinforce else group_advantages(rewards, group_size)
    ref = (reference.completion_logprobs(inputs, completion, config.temperature) if reference is not None
           else torch.zeros(completion.shape, device=completion.device))
    timings["reward_s"] = time.perf_counter() - t4
    return Rollout(inputs, RolloutTarget(completion, done, advantages, old, ref.float()), rewards, timings)


def train_step(module: Any, opt: Any, batch: Rollout, loss: PolicyLoss) -> float:
    """One optimizer step on the rollout (pipe=1): forward, the policy loss, backward, step; the loss value."""
    value = loss(module(batch.inputs), batch.target)
    opt.backward(value)
    opt.step()
    opt.zero_grad()
    return float(value.detach())
