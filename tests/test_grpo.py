"""GRPO and REINFORCE parts (train/rl/) against hand-computed numbers and a one-process reference.

TRL is not installed here, so the loss is checked against its definition written out by
hand: a 2 x 3 example computed with plain Python arithmetic (ratio, clip, k3 KL, the three
reductions) and TRL's group normalisation (unbiased std + 1e-4). A GRPO step of a pipe 1 x
data 2 ZeRO-3 policy (each rank half the rollout) must give the parameters of one process
that applies an independently written loss to the whole batch on the transformers model
(SGD, so the update is the gradient itself). A rollout under ZeRO-3 must leave parameter
memory at its ZeRO-3 level and the optimizer state untouched; the arithmetic example's
reward must rise in a short CPU run.
"""

import math
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import PipelineModule  # noqa: E402
from pipezero.pipe.hf import hf_layer_specs, hf_state_dict  # noqa: E402
from pipezero.pipe.hf.generate import Sampling  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.pipe.lora import LoraConfig, LoraLinear, lora_specs  # noqa: E402
from pipezero.train.rl import (AdaptersOff, FrozenCopy, GRPOConfig, PolicyLoss, Reduction, Rollout,  # noqa: E402
                               RolloutTarget, completion_logprobs, completion_mask, group_advantages,
                               grpo_token_loss, policy_inputs, reduce_tokens, rollout, train_step)
from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402
from pipezero.zero.gathered import parameter_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

VOCAB, P, N, B, LR = 32, 4, 3, 8, 0.5
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=None, eos_token_id=1)


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
    target = RolloutTarget(torch.zeros(2, 3, dtype=torch.long), torch.tensor(mask), torch.tensor(adv),
                           torch.tensor(old), torch.tensor(ref))
    lp = torch.tensor(logp, dtype=torch.float64)
    for reduction, value in want.items():
        config = GRPOConfig(beta=beta, epsilon=eps, reduction=reduction, max_completion_length=3)
        per_token, _ = grpo_token_loss(lp, target, config)
        got = reduce_tokens(per_token, target.mask, reduction, config.max_completion_length)
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


def _reference_loss(logits: torch.Tensor, t: RolloutTarget, beta: float, eps: float) -> torch.Tensor:
    """TRL's GRPO loss written out again, independently of train/rl/loss.py."""
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, t.completion.unsqueeze(-1)).squeeze(-1)
    coef = torch.exp(logp - t.old_logp)
    loss = -torch.minimum(coef * t.advantages[:, None], coef.clamp(1 - eps, 1 + eps) * t.advantages[:, None])
    loss = loss + beta * (torch.exp(t.ref_logp - logp) - (t.ref_logp - logp) - 1)
    return ((loss * t.mask).sum(1) / t.mask.sum(1)).mean()


def _one_process() -> tuple[float, dict[str, torch.Tensor]]:
    model = _hf_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    (ids, mask, positions), target = _batch()
    loss = _reference_loss(model(ids, attention_mask=mask, position_ids=positions).logits, target, 0.1, 0.2)
    loss.backward()
    opt.step()
    return loss.item(), {n: p.detach().clone() for n, p in model.state_dict().items()}


def _data2_step(stage: int):
    grid = Grid(pipe=1)
    module = PipelineModule(hf_layer_specs(_hf_model()), grid=grid)
    opt = ZeroOptimizer(torch.optim.SGD(module.parameters(), lr=LR), group=grid.data_group,
                        module=module if stage == 3 else None, config=ZeroConfig(stage=stage))
    inputs, target = _batch()
    half = slice(grid.data_rank * B // 2, (grid.data_rank + 1) * B // 2)
    mine = tuple(t[half] for t in inputs), RolloutTarget(*(t[half] for t in target))
    loss = train_step(module, opt, Rollout(*mine, rewards=torch.zeros(B // 2)), PolicyLoss(GRPOConfig(beta=0.1)))
    losses = torch.tensor([loss])
    torch.distributed.all_reduce(losses)
    with opt.gathered_parameters() if stage == 3 else nullcontext():
        state = {n: t.clone() for n, t in hf_state_dict(module).items()}
    return losses.item() / 2, state


@pytest.mark.parametrize("stage", [1, 3])
def test_grpo_step_data2_zero3_equals_one_process(stage):
    loss_1p, params = _one_process()
    for rank, (loss, state) in enumerate(run(_data2_step, 2, stage)):
        assert loss == pytest.approx(loss_1p, rel=1e-5, abs=1e-6)
        assert set(state) == set(params), set(params) ^ set(state)
        for name, value in state.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
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
