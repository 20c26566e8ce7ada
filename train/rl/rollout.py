"""Experience for an RL step: sample G completions per prompt from the training weights, reward, score.

One call is the experience phase of DeepSpeed-Chat's hybrid engine: the ZeRO shards are
gathered once (`gathered(opt, dtype)`: whole weights, optionally bf16), the policy generates
with its KV cache (pipe/hf/generate.py) and, if asked, scores the old log-probs while the
weights are whole, the copies are freed, then the user's reward functions score each completion
(summed ignoring NaN, as TRL sums them) and the advantages follow (group-relative for GRPO, a
batch baseline for REINFORCE); one all-reduce over the data group counts the step's completion
tokens (DAPO's divisor) and carries whether a reward function failed on any rank. The returned
`Rollout` feeds `train_step` (or a PipelineRunner: its inputs and target are tensors split
into microbatches). Scoring runs the module whole, so the RL step itself is pipe=1; the
generation alone also runs across a pipeline.

Positions: `policy_inputs` counts each row's positions from its attention mask, as generation
did, so left padding shifts nothing. TRL's training forward passes no position ids and so
counts left padding as positions; pipezero keeps generation's positions on purpose.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pipezero.pipe.hf.generate import Sampling, hf_generate
from pipezero.train.rl.advantages import batch_baseline, group_advantages
from pipezero.train.rl.loss import GRPOConfig, PolicyLoss, Reduction, RolloutTarget, completion_logprobs
from pipezero.train.rl.reference import Reference
from pipezero.zero.gathered import gathered

__all__ = ["RewardFn", "Rollout", "completion_mask", "mean_completion_tokens", "policy_inputs", "rollout",
           "train_step"]

RewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]
"""(prompt_ids [B, P], prompt_mask [B, P], completion [B, n], completion_mask [B, n]) -> B rewards: a [B]
tensor or a list of B numbers, None (or NaN) for a completion the function cannot score."""


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


def mean_completion_tokens(mask: torch.Tensor, data_group: Any | None) -> torch.Tensor:
    """[B, n] completion mask -> [B], each row the step's completion tokens per row over every data rank
    (one all-reduce over data_group; None: this rank's rows alone): RolloutTarget.mean_tokens, DAPO's divisor."""
    return _agree(mask, 0, data_group)[0]


def _agree(mask: torch.Tensor, failed: int, data_group: Any | None) -> tuple[torch.Tensor, int]:
    """(mean_completion_tokens, how many data ranks had failed) from one all-reduce."""
    counts = torch.tensor([int(mask.sum()), mask.size(0), failed], dtype=torch.long, device=mask.device)
    if data_group is not None and dist.get_world_size(data_group) > 1:
        dist.all_reduce(counts, group=data_group)
    tokens, rows, failures = counts.tolist()
    return torch.full((mask.size(0),), tokens / max(rows, 1), device=mask.device), failures


def policy_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention_mask, position_ids) of left-padded prompt + completion, positions as generation counted them."""
    ids = torch.cat([prompt_ids, completion], 1)
    mask = torch.cat([prompt_mask.long(), torch.ones_like(completion)], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, positions


def rollout(module: Any, opt: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            reward_fn: RewardFn | Sequence[RewardFn], *,
            group_size: int, max_new_tokens: int, sampling: Sampling, stop_tokens: Sequence[int],
            pad_token_id: int, config: GRPOConfig = GRPOConfig(), reference: Reference | None = None,
            gather_dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
            score_old: bool = False) -> Rollout:
    """Sample group_size completions of each prompt from the policy and turn them into a Rollout.

    opt: the ZeroOptimizer (any stage) that owns the policy's weights; under ZeRO-3 they are
    gathered once for the phase. reward_fn: one RewardFn or several, whose rewards are summed
    ignoring NaN (TRL's nansum; NaN where every function gave NaN: advantage 0); a failing or
    malformed reward is raised on every data rank. reference: needed when config.beta > 0.
    score_old: keep the sampling policy's log-probs (scored while the weights are whole) for several steps on one
    rollout; without it the ratio is taken against the training forward's own detached
    log-probs, exact for one step per rollout (TRL's num_iterations=1) and one forward cheaper.
    """
    _check(module, config, reference, sampling, max_new_tokens)
    ids = prompt_ids.repeat_interleave(group_size, 0)
    mask = prompt_mask.repeat_interleave(group_size, 0)
    timings: dict[str, float] = {}
    inputs, completion, old = _sample(module, opt, ids, mask, timings, max_new_tokens=max_new_tokens,
                                      sampling=sampling, stop_tokens=stop_tokens, pad_token_id=pad_token_id,
                                      gather_dtype=gather_dtype, generator=generator,
                                      temperature=config.temperature if score_old else None)
    t4 = time.perf_counter()
    done = completion_mask(completion, stop_tokens)
    rewards, mean_tokens = _agreed_rewards(reward_fn, (ids, mask, completion, done), group_size,
                                           module.grid.data_group)
    advantages = batch_baseline(rewards) if config.reinforce else group_advantages(rewards, group_size)
    ref = (reference.completion_logprobs(inputs, completion, config.temperature) if reference is not None
           else torch.zeros(completion.shape, device=completion.device))
    timings["reward_s"] = time.perf_counter() - t4
    target = RolloutTarget(completion, done, advantages, old, ref.float(), mean_tokens)
    return Rollout(inputs, target, rewards, timings)


def _check(module: Any, config: GRPOConfig, reference: Reference | None, sampling: Sampling,
           max_new_tokens: int) -> None:
    """rollout's refusals, before any collective."""
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


def _sample(module: Any, opt: Any, ids: torch.Tensor, mask: torch.Tensor, timings: dict[str, float], *,
            max_new_tokens: int, sampling: Sampling, stop_tokens: Sequence[int], pad_token_id: int,
            gather_dtype: torch.dtype | None, generator: torch.Generator | None,
            temperature: float | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """(policy inputs, completion, old log-probs) sampled with the weights gathered once; `temperature`:
    score the old log-probs at it while they are whole (None: empty, the training forward's own)."""
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
        if temperature is not None:
            with torch.no_grad():
                old = completion_logprobs(module(inputs), completion, temperature)  # the weights are whole
        t3 = time.perf_counter()
    timings.update(gather_s=(t1 - t0) + (time.perf_counter() - t3), generate_s=t2 - t1, score_s=t3 - t2)
    return inputs, completion, old


def _agreed_rewards(reward_fn: RewardFn | Sequence[RewardFn], args: tuple[torch.Tensor, ...], group_size: int,
                    data_group: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, mean_completion_tokens); a reward function failing on one data rank raises on every one,
    not left to hang the next collective."""
    try:
        rewards, error = _rewards(reward_fn, args, group_size), None
    except Exception as e:  # noqa: BLE001 (the user's function: any error, re-raised below)
        rewards, error = None, e
    mean_tokens, failures = _agree(args[3], int(error is not None), data_group)
    if error is not None:
        raise error
    if failures:
        raise RuntimeError(f"rollout: the reward function failed on {failures} other data rank(s); their error "
                           "is on those ranks")
    return rewards, mean_tokens


def _rewards(reward_fn: RewardFn | Sequence[RewardFn], args: tuple[torch.Tensor, ...],
             group_size: int) -> torch.Tensor:
    """[B] rewards: each function's, summed ignoring NaN; NaN where every function gave NaN (or None)."""
    fns = [reward_fn] if callable(reward_fn) else list(reward_fn)
    if not fns or not all(callable(f) for f in fns):
        raise TypeError(f"rollout(reward_fn={reward_fn!r}): expected a reward function or a non-empty list of them")
    per_fn = torch.stack([_as_rewards(f, f(*args), args[2], group_size) for f in fns], 1)
    return per_fn.nansum(1).masked_fill(per_fn.isnan().all(1), torch.nan)


def _as_rewards(fn: RewardFn, out: Any, completion: torch.Tensor, group_size: int) -> torch.Tensor:
    """One function's output as [B] fp32 rewards (None -> NaN), or an error naming the function."""
    b = completion.size(0)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    expected = (f"expected {b} rewards, one per completion ({b // group_size} prompts x group_size "
                f"{group_size}), as a [{b}] tensor or a list")
    if isinstance(out, torch.Tensor):
        if out.dim() != 1 or out.numel() != b:
            raise ValueError(f"rollout: reward function {name} returned a tensor of shape {tuple(out.shape)}; "
                             f"{expected}")
        return out.detach().float().to(completion.device)
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"rollout: reward function {name} returned {type(out).__name__}; {expected}")
    if len(out) != b:
        raise ValueError(f"rollout: reward function {name} returned {len(out)} rewards; {expected}")
    try:
        values = [torch.nan if r is None else float(r) for r in out]
    except (TypeError, ValueError) as e:
        raise TypeError(f"rollout: reward function {name} returned a list holding a non-number ({e}); "
                        f"{expected}, None for a completion it cannot score") from e
    return torch.tensor(values, dtype=torch.float32, device=completion.device)


def train_step(module: Any, opt: Any, batch: Rollout, loss: PolicyLoss) -> float:
    """One optimizer step on the rollout (pipe=1): forward, the policy loss, backward, step; the loss value."""
    value = loss(module(batch.inputs), batch.target)
    opt.backward(value)
    opt.step()
    opt.zero_grad()
    return float(value.detach())
