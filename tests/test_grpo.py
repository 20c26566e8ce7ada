"""GRPO and REINFORCE parts (train/rl/) against TRL 1.16's own code and a one-process reference.

TRL (a test-only reference) is called on the same batch: GRPOTrainer._compute_loss, driven
through a stub that carries the attributes it reads (no trainer, no download), on a tiny
transformers Llama with TRL's fused LM head; loss and gradients must equal PolicyLoss's for
each loss type (dapo / bnpo / dr_grpo / grpo), with and without the bias-corrected KL, and
with sequence-level ratios and the two-sided clip. GRPOConfig's defaults are read from TRL's
GRPOConfig. Advantages with NaN rewards follow TRL's nan-aware group normalisation (its own
nanstd). A GRPO step of a pipe 1 x data 2 ZeRO-1/3 policy (each rank half the rollout, DAPO's
divisor over both) must give TRL's loss and, after SGD, its parameters from one process on the
whole batch (left-padded prompts: the log-probs there take generation's positions, which TRL's
training forward does not pass). A rollout under ZeRO-3 must leave parameter memory at its
ZeRO-3 level and the optimizer state untouched; a NaN reward must leave the weights finite; a
malformed reward names its function; the arithmetic example's reward must rise on CPU.
"""

import dataclasses
import functools
import math
import sys
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import PipelineModule  # noqa: E402
from pipezero.pipe.hf import hf_layer_specs, hf_state_dict  # noqa: E402
from pipezero.pipe.hf.generate import Sampling  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.pipe.lora import LoraConfig, LoraLinear, lora_specs  # noqa: E402
from pipezero.train.rl import (AdaptersOff, FrozenCopy, GRPOConfig, ImportanceSampling, PolicyLoss,  # noqa: E402
                               Reduction, Rollout, RolloutTarget, completion_logprobs, completion_mask,
                               group_advantages, grpo_token_loss, mean_completion_tokens, policy_inputs,
                               reduce_tokens, rollout, train_step)
from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402
from pipezero.zero.gathered import parameter_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

VOCAB, P, N, B, LR = 32, 4, 3, 8, 0.5
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=None, eos_token_id=1)


# -- TRL 1.16's GRPOTrainer._compute_loss, driven without a trainer -------------------------------
def _trl():
    return pytest.importorskip("trl.trainer.grpo_trainer")


def _trl_loss(model, inputs: dict, config: GRPOConfig, logps=None) -> torch.Tensor:
    """TRL's _compute_loss on `inputs` (TRL's batch keys) with `config`'s options, one process, no
    accumulation. logps: a replacement for TRL's log-prob forward (positions), else TRL's own."""
    trainer = _trl().GRPOTrainer
    accelerator = SimpleNamespace(autocast=nullcontext, num_processes=1, is_main_process=True,
                                  reduce=lambda x, reduction: x,
                                  gather=lambda x: x, gather_for_metrics=lambda x: x)
    args = SimpleNamespace(use_bias_correction_kl=config.use_bias_correction_kl, delta=config.delta,
                           steps_per_generation=1)
    stub = SimpleNamespace(
        model=model, accelerator=accelerator, args=args, beta=config.beta, loss_type=config.reduction.value,
        epsilon_low=config.epsilon, epsilon_high=config.epsilon if config.epsilon_high is None else config.epsilon_high,
        importance_sampling_level=config.importance_sampling_level.value, max_completion_length=config.max_completion_length,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    stub._get_per_token_logps_and_entropies = logps or functools.partial(
        trainer._get_per_token_logps_and_entropies, stub)
    return trainer._compute_loss(stub, model, inputs)


def _trl_inputs(prompt_ids, prompt_mask, target: RolloutTarget) -> dict:
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=target.completion,
                completion_mask=target.mask, advantages=target.advantages, old_per_token_logps=target.old_logp,
                ref_per_token_logps=target.ref_logp, num_items_in_batch=target.mask.sum())


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_grpo_config_defaults_are_trl_1_16s():
    trl_config = pytest.importorskip("trl").GRPOConfig
    trl_defaults = {f.name: f.default for f in dataclasses.fields(trl_config)}
    ours = GRPOConfig()
    for name in ["beta", "epsilon", "epsilon_high", "delta", "use_bias_correction_kl", "temperature"]:
        assert getattr(ours, name) == trl_defaults[name], name
    assert ours.reduction.value == trl_defaults["loss_type"]
    assert ours.importance_sampling_level.value == trl_defaults["importance_sampling_level"]


TEMPERATURE = 0.7
TRL_CASES = [dict(reduction=r, beta=0.04, use_bias_correction_kl=bias)
             for r in Reduction for bias in (True, False)] + [
    dict(),  # the defaults: dapo, beta 0
    dict(beta=0.04, importance_sampling_level=ImportanceSampling.SEQUENCE, epsilon_high=0.28, delta=1.1),
    dict(reduction=Reduction.GRPO, beta=0.04, importance_sampling_level=ImportanceSampling.SEQUENCE)]


def test_policy_loss_equals_trl_compute_loss():
    """Every loss type, the bias-corrected KL on and off, sequence-level ratios and the two-sided
    clip: TRL's loss and gradients on the same model and batch (unpadded prompts: TRL's positions
    are generation's there), fp32 within 1e-5."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).train()
    _trl()
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    gen = torch.Generator().manual_seed(1)
    n = 5
    prompt_ids = torch.randint(2, VOCAB, (6, P), generator=gen)
    completion = torch.randint(2, VOCAB, (6, n), generator=gen)
    completion[0, 1] = completion[2, 3] = completion[5, 0] = 1  # stops: rows of 2, 4 and 1 tokens
    done = completion_mask(completion, [1])
    inputs = policy_inputs(prompt_ids, torch.ones_like(prompt_ids), completion)
    with torch.no_grad():
        logp = completion_logprobs(model(*inputs[:1], attention_mask=inputs[1], position_ids=inputs[2]).logits,
                                   completion, TEMPERATURE)
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)  # ratios on both sides of the clip
    target = RolloutTarget(completion, done, torch.randn(6, generator=gen), old,
                           logp + 0.5 * torch.randn(logp.shape, generator=gen),
                           torch.full((6,), done.sum().item() / 6))
    for case in TRL_CASES:
        config = GRPOConfig(temperature=TEMPERATURE, max_completion_length=n, **case)
        want = _trl_loss(model, _trl_inputs(prompt_ids, torch.ones_like(prompt_ids), target), config)
        want.backward()
        want_grads = _grads(model)
        got = PolicyLoss(config)(model(inputs[0], attention_mask=inputs[1], position_ids=inputs[2]).logits, target)
        got.backward()
        got_grads = _grads(model)
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7), case
        assert set(got_grads) == set(want_grads)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
    with pytest.raises(ValueError, match=r"Reduction.DAPO\): .*mean_completion_tokens"):
        PolicyLoss(GRPOConfig())(torch.zeros(6, P + n, VOCAB), target._replace(mean_tokens=None))


# -- the loss by hand --------------------------------------------------------------------------
def test_grpo_loss_equals_hand_computed_example():
    logp = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]]
    old = [[-1.1, -1.5, -0.5], [-0.3, -1.0, -2.0]]
    ref = [[-0.9, -2.1, -0.7], [-0.5, -1.2, -2.5]]
    mask = [[1, 1, 0], [1, 1, 1]]
    adv = [1.5, -0.5]
    eps, beta = 0.2, 0.1
    token = [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        for t in range(3):
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            d = ref[i][t] - logp[i][t]
            token[i][t] = -min(ratio * adv[i], clipped * adv[i]) + beta * (math.exp(d) - d - 1)
    per_seq = [sum(token[i][t] * mask[i][t] for t in range(3)) / sum(mask[i]) for i in range(2)]
    want = {Reduction.GRPO: sum(per_seq) / 2,
            Reduction.BNPO: sum(token[i][t] * mask[i][t] for i in range(2) for t in range(3)) / 5,
            Reduction.DR_GRPO: sum(token[i][t] * mask[i][t] for i in range(2) for t in range(3)) / 6}
    want[Reduction.DAPO] = want[Reduction.BNPO]  # one rank, one microbatch: the step's tokens are these
    target = RolloutTarget(torch.zeros(2, 3, dtype=torch.long), torch.tensor(mask), torch.tensor(adv),
                           torch.tensor(old), torch.tensor(ref), torch.tensor([2.5, 2.5]))
    lp = torch.tensor(logp, dtype=torch.float64)
    for reduction, value in want.items():
        config = GRPOConfig(beta=beta, epsilon=eps, reduction=reduction, max_completion_length=3,
                            use_bias_correction_kl=False)
        per_token, _ = grpo_token_loss(lp, target, config)
        got = reduce_tokens(per_token, target.mask, reduction, config.max_completion_length, target.mean_tokens)
        assert got.item() == pytest.approx(value, rel=1e-6)
    # REINFORCE: -A * logp (+ the same KL)
    per_token, _ = grpo_token_loss(lp, target, GRPOConfig(beta=0.0, reinforce=True))
    assert per_token[0, 1].item() == pytest.approx(-1.5 * -2.0)


def test_dr_grpo_divides_by_max_completion_length_not_the_width():
    """TRL's dr_grpo: sum / (sequences x max_completion_length), a constant; a rollout whose rows all stopped
    within 2 of max_new_tokens=5 tokens is 2 wide, and its tokens must not weigh 5/2 times more."""
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    completion, mask = torch.tensor([[3, 1], [1, 0]]), torch.tensor([[1, 1], [1, 0]])
    target = RolloutTarget(completion, mask, torch.tensor([1.0, -0.5]), torch.zeros(2, 0), torch.zeros(2, 2))
    loss = PolicyLoss(GRPOConfig(beta=0.0, reduction=Reduction.DR_GRPO, max_completion_length=5))(logits, target)
    per_token, _ = grpo_token_loss(completion_logprobs(logits, completion), target, GRPOConfig(beta=0.0))
    assert loss.item() == pytest.approx(((per_token * mask).sum() / (2 * 5)).item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"DR_GRPO, max_completion_length=None\): .*max_new_tokens"):
        GRPOConfig(reduction=Reduction.DR_GRPO)


def _trl_advantages(rewards: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """TRL 1.16's advantages of one reward function's rewards (GRPOTrainer._generate_and_score_completions,
    multi_objective_aggregation="sum_then_normalize", scale_rewards "group" / "none"), with TRL's nanstd."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    per_func = rewards[:, None]
    unscorable = torch.isnan(per_func).all(dim=1)
    summed = per_func.nansum(dim=1)
    summed[unscorable] = torch.nan
    mean = torch.nanmean(summed.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    std = nanstd(summed.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    advantages = summed - mean
    if scale:
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_group_advantages_leave_nan_rewards_out_as_trl_does():
    """One NaN reward made its whole group's advantages NaN, and so every weight after the step."""
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 0.5, nan, nan, nan, 2.0, 0.2, 0.3, 0.1, 0.9])
    for group_size in (4, 3):
        for scale in (True, False):
            got = group_advantages(rewards, group_size, scale=scale)
            assert torch.isfinite(got).all(), (group_size, scale, got)
            torch.testing.assert_close(got, _trl_advantages(rewards, group_size, scale), rtol=1e-6, atol=1e-6)


def test_group_advantages_and_completion_mask():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    std = math.sqrt(0.5)  # unbiased std of (1, 0)
    want = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.0, 0.0]
    torch.testing.assert_close(group_advantages(rewards, 2), torch.tensor(want))
    torch.testing.assert_close(group_advantages(rewards, 2, scale=False), torch.tensor([.5, -.5, -.5, .5, 0, 0]))
    with pytest.raises(ValueError, match="repeat_interleave"):
        group_advantages(rewards, 4)
    done = completion_mask(torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]]), [1])
    assert done.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


# -- one GRPO step: data 2 ZeRO-3 against one process ---------------------------------------------
def _hf_model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))


def _batch() -> tuple[tuple[torch.Tensor, ...], RolloutTarget]:
    """A fixed rollout: left-padded prompts, completions with stops, advantages, old and ref log-probs."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (B, P), generator=gen)
    mask = torch.ones_like(ids)
    mask[1::2, :2] = 0
    completion = torch.randint(2, VOCAB, (B, N), generator=gen)
    completion[0, 1] = completion[3, 0] = 1
    done = completion_mask(completion, [1])
    target = RolloutTarget(completion, done, torch.randn(B, generator=gen), -3 + 0.3 * torch.randn(B, N, generator=gen),
                           -3 + 0.3 * torch.randn(B, N, generator=gen))
    return policy_inputs(ids.masked_fill(mask == 0, 0), mask, completion), target


def _positions_logps(model, input_ids, attention_mask, logits_to_keep, **_):
    """TRL's log-prob forward with generation's positions (TRL's passes none, so its log-probs count the
    left padding as positions; pipezero keeps generation's on purpose)."""
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -logits_to_keep - 1:-1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]
    return logps, torch.zeros_like(logps), None


STEP_REDUCTIONS = [Reduction.GRPO, Reduction.DAPO]  # DAPO: the divisor counts both ranks' tokens (9 and 12)


def _one_process(reduction: Reduction) -> tuple[float, dict[str, torch.Tensor]]:
    model = _hf_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    (ids, mask, _), target = _batch()
    loss = _trl_loss(model, _trl_inputs(ids[:, :P], mask[:, :P], target), GRPOConfig(beta=0.1, reduction=reduction),
                     logps=_positions_logps)
    loss.backward()
    opt.step()
    return loss.item(), {n: p.detach().clone() for n, p in model.state_dict().items()}


def _data2_step(stage: int):
    out = []
    for reduction in STEP_REDUCTIONS:
        grid = Grid(pipe=1)
        module = PipelineModule(hf_layer_specs(_hf_model()), grid=grid)
        opt = ZeroOptimizer(torch.optim.SGD(module.parameters(), lr=LR), group=grid.data_group,
                            module=module if stage == 3 else None, config=ZeroConfig(stage=stage))
        inputs, target = _batch()
        half = slice(grid.data_rank * B // 2, (grid.data_rank + 1) * B // 2)
        mine = tuple(t[half] for t in inputs), RolloutTarget(*(t[half] for t in target[:5]))
        mine = mine[0], mine[1]._replace(mean_tokens=mean_completion_tokens(mine[1].mask, grid.data_group))
        loss = PolicyLoss(GRPOConfig(beta=0.1, reduction=reduction))
        value = train_step(module, opt, Rollout(*mine, rewards=torch.zeros(B // 2)), loss)
        losses = torch.tensor([value])
        torch.distributed.all_reduce(losses)
        with opt.gathered_parameters() if stage == 3 else nullcontext():
            state = {n: t.clone() for n, t in hf_state_dict(module).items()}
        out.append((losses.item() / 2, state))
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_grpo_step_data2_zero3_equals_trl_one_process(stage):
    truth = [_one_process(reduction) for reduction in STEP_REDUCTIONS]
    for rank, results in enumerate(run(_data2_step, 2, stage)):
        for reduction, (loss_1p, params), (loss, state) in zip(STEP_REDUCTIONS, truth, results, strict=True):
            assert loss == pytest.approx(loss_1p, rel=1e-5, abs=1e-6), (reduction, rank)
            assert set(state) == set(params), set(params) ^ set(state)
            for name, value in state.items():
                torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5,
                                           msg=f"{reduction}, rank {rank}: {name}")
            changed = max((state[n] - _hf_model().state_dict()[n]).abs().max().item() for n in state)
            assert changed > 1e-3  # the step really moved the weights


# -- a rollout under ZeRO-3: memory and optimizer state ------------------------------------------
def _rollout_memory():
    grid = Grid(pipe=1)
    module = PipelineModule(hf_layer_specs(transformers.LlamaConfig(**CONFIG)), grid=grid)
    reference = FrozenCopy(module)
    opt = ZeroOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-3), group=grid.data_group, module=module,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=64))
    loss = PolicyLoss(GRPOConfig(beta=0.1))
    ids = torch.randint(2, VOCAB, (2, P), generator=torch.Generator().manual_seed(grid.data_rank))
    mask = torch.ones_like(ids)

    def reward(prompts, prompt_mask, completion, done):
        return (completion == 5).float().sum(-1)
    kwargs = dict(group_size=4, max_new_tokens=N, sampling=Sampling(temperature=1.0), stop_tokens=[1],
                  pad_token_id=0, config=loss.config, reference=reference, generator=torch.Generator().manual_seed(0))
    train_step(module, opt, rollout(module, opt, ids, mask, reward, **kwargs), loss)
    state = [t.clone() for b in opt.buckets for t in [b.master, *opt.state[b.master].values()]]
    before = parameter_bytes(module, opt)
    batch = rollout(module, opt, ids, mask, reward, score_old=True, **kwargs)
    after = parameter_bytes(module, opt)
    untouched = all(torch.equal(a, b) for a, b in zip(state, [t for b in opt.buckets
                                                               for t in [b.master, *opt.state[b.master].values()]]))
    train_step(module, opt, batch, loss)
    return before, after, untouched, batch.target.old_logp.shape, sorted(batch.timings)


def test_rollout_under_zero3_returns_memory_and_leaves_optimizer_state():
    for before, after, untouched, old_shape, timings in run(_rollout_memory, 2):
        assert after == before and untouched
        assert old_shape[0] == 8 and old_shape[1] >= 1
        assert timings == ["gather_s", "generate_s", "reward_s", "score_s"]


# -- rewards: NaN left out, lists taken, a malformed reward named on every rank ---------------------
def short_reward(prompts, prompt_mask, completion, done):
    return torch.zeros(3)


def _reward_faults():
    grid = Grid(pipe=1)
    module = PipelineModule(hf_layer_specs(_hf_model()), grid=grid)
    opt = ZeroOptimizer(torch.optim.SGD(module.parameters(), lr=LR), group=grid.data_group, stage=1)
    ids = torch.randint(2, VOCAB, (2, P), generator=torch.Generator().manual_seed(grid.data_rank))
    kwargs = dict(group_size=4, max_new_tokens=N, sampling=Sampling(temperature=1.0), stop_tokens=[1],
                  pad_token_id=0, config=GRPOConfig(), generator=torch.Generator().manual_seed(0))

    def as_list(prompts, prompt_mask, completion, done):  # a Python list; None: cannot score this one
        return [None if i == 1 else float(i % 3) for i in range(len(completion))]

    def with_nan(prompts, prompt_mask, completion, done):
        return torch.tensor([math.nan] * 2 + [0.5] * 6)
    batch = rollout(module, opt, ids, torch.ones_like(ids), [as_list, with_nan], **kwargs)
    train_step(module, opt, batch, PolicyLoss(kwargs["config"]))
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    errors = []
    for bad in ([short_reward, as_list][grid.data_rank], lambda *a: {"r": 1.0}):
        try:
            rollout(module, opt, ids, torch.ones_like(ids), bad, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return batch.rewards, batch.target.advantages, finite, errors


def test_rewards_nan_and_lists_are_taken_and_a_wrong_count_names_the_function():
    """One NaN reward turned every weight into NaN; a list return raised AttributeError; a wrong count
    blamed the prompts (group_advantages' repeat_interleave), and only on the rank whose function erred."""
    for rank, (rewards, advantages, finite, errors) in enumerate(run(_reward_faults, 2)):
        want = torch.tensor([0.0, math.nan] + [float(i % 3) + 0.5 for i in range(2, 8)])  # nansum of the two
        # row 0: 0.0 + NaN is 0.0 (nansum); row 1: both functions gave NaN, unscorable
        torch.testing.assert_close(rewards, want, equal_nan=True)
        assert advantages[1] == 0 and torch.isfinite(advantages).all(), advantages
        assert finite, f"rank {rank}: a NaN reward reached the weights"
        if rank == 0:
            assert errors[0].startswith("ValueError: rollout: reward function short_reward returned a tensor of "
                                        "shape (3,); expected 8 rewards, one per completion (2 prompts x "
                                        "group_size 4)"), errors[0]
        else:
            assert errors[0].startswith("RuntimeError: rollout: the reward function failed on 1 other data rank"), (
                errors[0])
        assert "reward function _reward_faults.<locals>.<lambda> returned dict; expected 8 rewards" in errors[1], (
            errors[1])


# -- a sampling temperature: every log-prob is of the distribution that sampled -------------------------
def _tempered_rollout():
    grid = Grid(pipe=1)
    module = PipelineModule(hf_layer_specs(_hf_model()), grid=grid)
    opt = ZeroOptimizer(torch.optim.SGD(module.parameters(), lr=0.0), group=grid.data_group, stage=1)
    ids = torch.randint(2, VOCAB, (2, P), generator=torch.Generator().manual_seed(5))
    kwargs = dict(group_size=2, max_new_tokens=N, stop_tokens=[], pad_token_id=0, reference=FrozenCopy(module),
                  generator=torch.Generator().manual_seed(0), score_old=True)
    with pytest.raises(ValueError, match=r"Sampling\(temperature=0.5\) .* GRPOConfig\(temperature=1.0\)"):
        rollout(module, opt, ids, torch.ones_like(ids), lambda *a: torch.zeros(4), sampling=Sampling(temperature=0.5),
                config=GRPOConfig(beta=0.1), **kwargs)
    config = GRPOConfig(beta=0.1, temperature=0.5)
    batch = rollout(module, opt, ids, torch.ones_like(ids), lambda *a: torch.zeros(4),
                    sampling=Sampling(temperature=0.5), config=config, **kwargs)
    loss = PolicyLoss(config)
    loss(module(batch.inputs), batch.target)
    return batch, loss.last_kl


def test_rollout_scores_the_tokens_under_the_sampling_temperature():
    """TRL divides the logits by the sampling temperature before every log-prob (policy, old, reference):
    softmax(logits / T) is the policy the tokens came from, so its gradient is the policy gradient."""
    batch, kl = run(_tempered_rollout, 1)[0]
    assert abs(kl) < 1e-6, "the training forward's log-probs are not the reference's (same weights)"
    ids, mask, positions = batch.inputs
    with torch.no_grad():
        logits = _hf_model()(ids, attention_mask=mask, position_ids=positions).logits[:, P - 1:-1]
    want = torch.log_softmax(logits / 0.5, -1).gather(-1, batch.target.completion[..., None])[..., 0]
    torch.testing.assert_close(batch.target.old_logp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.target.ref_logp, want, rtol=1e-5, atol=1e-5)


# -- the LoRA reference: the policy's own base, adapters off ----------------------------------------
def _lora_reference():
    grid = Grid(pipe=1)
    config = transformers.LlamaConfig(**CONFIG)
    base = PipelineModule(hf_layer_specs(config), grid=grid)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    policy = PipelineModule(lora_specs(hf_layer_specs(config), lora), grid=grid)
    with torch.no_grad():
        for m in policy.modules():
            if isinstance(m, LoraLinear):
                m.lora_B.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    plain, adapted_state = hf_state_dict(base), hf_state_dict(policy)
    same_base = all(torch.equal(t, adapted_state[name]) for name, t in plain.items())
    ids = torch.randint(2, VOCAB, (B, P), generator=torch.Generator().manual_seed(3))
    completion = torch.randint(2, VOCAB, (B, N), generator=torch.Generator().manual_seed(4))
    inputs = policy_inputs(ids, torch.ones_like(ids), completion)
    with torch.no_grad():
        adapted = completion_logprobs(policy(inputs), completion)
    off = AdaptersOff(policy).completion_logprobs(inputs, completion)
    with torch.no_grad():
        adapted_after = completion_logprobs(policy(inputs), completion)
    with pytest.raises(ValueError, match="holds no LoraLinear"):
        AdaptersOff(base)
    return same_base, off, FrozenCopy(base).completion_logprobs(inputs, completion), adapted, adapted_after


def test_lora_reference_is_the_frozen_base():
    same_base, off, frozen, adapted, adapted_after = run(_lora_reference, 1)[0]
    assert same_base, "the LoRA policy's base weights differ from the plain model's: the comparison shows nothing"
    torch.testing.assert_close(off, frozen, rtol=1e-5, atol=1e-5)
    assert (adapted - frozen).abs().max() > 1e-2, "the adapters change nothing: the test would pass without them"
    assert torch.equal(adapted, adapted_after), "the adapters were not put back"


# -- the example learns -----------------------------------------------------------------------------
def _example(argv: list[str]) -> list[float]:
    import grpo_arithmetic

    return grpo_arithmetic.main(argv)


def test_arithmetic_example_reward_rises():
    history = run(_example, 1, ["--iters", "40", "--seed", "0"],
                  timeout=600)[0]
    first, last = sum(history[:8]) / 8, sum(history[-8:]) / 8
    assert last > first + 0.1, history
