"""GRPO on a verifiable task: a Llama-shaped model learns to add two numbers, rewarded by code.

    python examples/grpo_arithmetic.py                                   # tiny model, CPU, ~30 s of CPU time
    torchrun --nproc-per-node 2 examples/grpo_arithmetic.py --zero 3     # data 2, ZeRO-3 shards
    python examples/grpo_arithmetic.py --model llama-0.7b --gen-dtype bf16 --iters 200   # one GPU
    python examples/grpo_arithmetic.py --algo reinforce                  # REINFORCE, batch baseline
    python examples/grpo_arithmetic.py --lora 8 --lr 1e-2                # LoRA adapters; the KL reference is
                                                                         # the base with adapters off (no copy)

Prompts are "a+b=" in a character vocabulary (digits, '+', '=', pad, end); the policy
answers and ends with the end token. The reward is computed from the prompt's own text: 1
for the right sum followed by the end token, else partial credit (0.3 for a right first
digit, 0.1 for a digit answer that ends within the budget) so a random policy sees a signal. Each iteration:
1. experience (pipezero.train.rl.rollout): the ZeRO shards are gathered once, the policy
   samples `--group` completions per prompt with its KV cache and scores their log-probs
   while whole, then the copies are freed; rewards; GRPO's group-relative advantages;
2. training: one step of the GRPO loss (clipped ratio, KL to a frozen copy of the starting
   policy, or with --lora to the base model with the adapters switched off) or of REINFORCE,
   under the chosen ZeRO stage.
The model is built from a config (random weights), never downloaded. TensorBoard (--tensorboard):
reward, accuracy, KL, loss, and the gather / generate / score / train seconds per iteration.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from pipezero.pipe import PipelineModule
from pipezero.pipe.hf import hf_layer_specs
from pipezero.pipe.hf.generate import Sampling
from pipezero.pipe.lora import LoraConfig, lora_specs, trainable_parameters
from pipezero.topology import Grid
from pipezero.topology.env import init_distributed
from pipezero.train.log import TensorBoardWriter
from pipezero.train.rl import AdaptersOff, FrozenCopy, GRPOConfig, PolicyLoss, rollout, train_step
from pipezero.zero import ZeroConfig, ZeroOptimizer

CHARS = "0123456789+="
PAD, END = len(CHARS), len(CHARS) + 1
VOCAB = 16
MODELS = {  # Llama-shaped configs; the vocabulary is the task's characters
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "llama-0.7b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--algo", choices=["grpo", "reinforce"], default="grpo")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank per iteration")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's G)")
    p.add_argument("--max-operand", type=int, default=2, help="a, b drawn from 0..max-operand (9: two-digit sums)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (0: no reference copy)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=1)
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on every projection (0: train every weight)")
    p.add_argument("--gen-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the gathered weights while generating (training stays fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensorboard", default="", help="TensorBoard output folder ('' to disable)")
    return p.parse_args(argv)


# -- the task ------------------------------------------------------------------------------
def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i] if i < len(CHARS) else ("." if i == END else "") for i in ids)


def make_prompts(n: int, max_operand: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n prompts "a+b=", left-padded to the longest: (ids [n, P], attention_mask [n, P])."""
    pairs = torch.randint(0, max_operand + 1, (n, 2), generator=gen).tolist()
    texts = [encode(f"{a}+{b}=") for a, b in pairs]
    width = max(map(len, texts))
    ids = torch.tensor([[PAD] * (width - len(t)) + t for t in texts])
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in texts])
    return ids, mask


def reward(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor,
           completion_mask: torch.Tensor) -> torch.Tensor:
    """1 for the right sum then END; else 0.3 for a right first digit + 0.1 for digits that end in the budget."""
    out = []
    for ids, mask, new in zip(prompt_ids.tolist(), prompt_mask.tolist(), completion.tolist()):
        a, b = decode([i for i, m in zip(ids, mask) if m]).rstrip("=").split("+")
        want = str(int(a) + int(b))
        text = decode(new)
        answer, ended = text.split(".")[0], "." in text
        if ended and answer == want:
            out.append(1.0)
        else:  # partial credit: a right first digit; a digit answer that ends
            out.append(0.3 * (answer[:1] == want[:1]) + 0.1 * (ended and answer.isdigit()))
    return torch.tensor(out)


# -- the loop ------------------------------------------------------------------------------
def build(args: argparse.Namespace, grid: Grid):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=None,
                         eos_token_id=END, tie_word_embeddings=False, **MODELS[args.model])
    specs = hf_layer_specs(config)
    if args.lora:
        specs = lora_specs(specs, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    policy = PipelineModule(specs, grid=grid, seed=args.seed)
    reference = None
    if args.beta > 0:  # the frozen copy before ZeRO-3 partitions the policy
        reference = AdaptersOff(policy) if args.lora else FrozenCopy(policy)
    params = trainable_parameters(policy) if args.lora else policy.parameters()
    opt = ZeroOptimizer(torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0), group=grid.data_group,
                        module=policy if args.zero == 3 else None, config=ZeroConfig(stage=args.zero))
    return policy, reference, opt


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    init_distributed()
    grid = Grid(pipe=1)
    rank = dist.get_rank()
    policy, reference, opt = build(args, grid)
    loss = PolicyLoss(GRPOConfig(beta=args.beta, reinforce=args.algo == "reinforce",
                                 temperature=args.temperature or 1.0))  # 0: greedy, any scores alike
    sampling = Sampling(temperature=args.temperature)
    gen_dtype = torch.bfloat16 if args.gen_dtype == "bf16" else None
    tb = TensorBoardWriter(args.tensorboard, f"grpo_arithmetic_{args.algo}", enabled=bool(args.tensorboard))
    data_gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    sample_gen = torch.Generator(device=policy.device).manual_seed(args.seed + 7 + rank)
    history = []
    for it in range(args.iters):
        ids, mask = make_prompts(args.prompts, args.max_operand, data_gen)
        batch = rollout(policy, opt, ids.to(policy.device), mask.to(policy.device), reward, group_size=args.group,
                        max_new_tokens=args.new_tokens, sampling=sampling, stop_tokens=[END], pad_token_id=PAD,
                        config=loss.config, reference=reference, gather_dtype=gen_dtype, generator=sample_gen)
        t0 = time.perf_counter()
        value = train_step(policy, opt, batch, loss)
        batch.timings["train_s"] = time.perf_counter() - t0
        stats = torch.tensor([batch.rewards.mean().item(), (batch.rewards == 1).float().mean().item(), loss.last_kl])
        dist.all_reduce(stats)
        mean_reward, accuracy, kl = (stats / dist.get_world_size()).tolist()
        history.append(mean_reward)
        tb.scalars({"reward/mean": mean_reward, "reward/accuracy": accuracy, "kl/mean": kl, "loss": value,
                    **{f"time/{k}": v for k, v in batch.timings.items()}}, it)
        if rank == 0:
            t = batch.timings
            shown = decode(ids[0][mask[0] == 1].tolist()) + decode(batch.target.completion[0].tolist())
            print(f"iter {it:3d}  reward {mean_reward:.3f}  exact {accuracy:.2f}  kl {kl:.4f}  gather "
                  f"{t['gather_s'] * 1e3:5.1f} ms  generate {t['generate_s'] * 1e3:6.1f} ms  score "
                  f"{t['score_s'] * 1e3:5.1f} ms  train {t['train_s'] * 1e3:6.1f} ms  {shown}", flush=True)
    tb.close()
    return history


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
