"""Generation from the training weights of a Hugging Face model vs transformers' own generate, one run.

    python bench/hybrid_hf.py                        # CPU, a tiny Llama, fp32 (a smoke run; --tiny)
    python bench/hybrid_hf.py --device cuda          # one GPU: a 1.1B Llama built from a config, bf16
    python bench/hybrid_hf.py --device cuda --tiny   # one GPU, the tiny Llama (does it run at all)
    torchrun --nproc-per-node 2 bench/hybrid_hf.py --device cuda   # ZeRO-3 shards over 2 GPUs

The same Llama-shaped model (random weights from one config), the same prompts, greedy, a
fixed number of new tokens (no stop token), tokens/s per rank:
  pipezero, gathered ZeRO-3    the training policy (PipelineModule of hf_layer_specs under
                               ZeroOptimizer(stage=3)) inside gathered(opt, dtype=bf16): one
                               all-gather, then pipe/hf/generate.py's static-cache decode step,
                               captured as a CUDA graph once per call (the graph's capture and
                               the gather are inside the time)
  pipezero, gathered, dynamic  the same with static_cache=False (transformers' DynamicCache,
                               every step launched from Python)
  pipezero, ZeRO-3 hooks       the same without gathered: the stage-3 hooks gather each layer
                               for every token (--naive; slow)
  transformers, ZeRO-3         transformers' generate on the model itself wrapped by
                               ZeroOptimizer(stage=3, module=model): what DeepSpeed-Chat compares
                               its hybrid engine with (per-layer gathers, default cache)
  transformers, whole          transformers' generate on a whole bf16 copy, default DynamicCache
  transformers, static         the same with cache_implementation="static" (transformers
                               compiles the decode step for a static cache on CUDA; the
                               compile happens in the warm-up, outside the time)
Then the split of one GRPO iteration (train/rl rollout + train_step, group 4): gather /
generate / score / train seconds. Prints a Markdown table; ratios are vs "transformers,
whole", vs the fastest transformers row and vs "transformers, ZeRO-3"; and how many of our
greedy tokens equal transformers' (bf16 kernels differ, so a few rows may part after a near tie).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from pipezero.pipe import PipelineModule
from pipezero.pipe.hf import hf_layer_specs
from pipezero.pipe.hf.generate import Sampling, hf_generate
from pipezero.topology import Grid
from pipezero.topology.env import init_distributed
from pipezero.train.rl import GRPOConfig, PolicyLoss, rollout, train_step
from pipezero.zero import ZeroConfig, ZeroOptimizer, gathered

SHAPES = {
    "cpu": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2),
    "cuda": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU shape on any device (a smoke run)")
    p.add_argument("--batch", type=int)
    p.add_argument("--prompt", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive", action="store_true", help="also time ZeRO-3 hooks without gathered (slow)")
    p.add_argument("--no-static", action="store_true", help="skip transformers' static cache")
    p.add_argument("--cuda-graph", choices=["on", "auto", "off"], default="on",
                   help="our static decode step on CUDA: on (a step that cannot be captured fails the row, "
                        "named), auto (falls back to eager), off")
    args = p.parse_args(argv)
    args.shape = "cpu" if args.tiny else args.device
    big = args.shape == "cuda"
    for key, value in dict(batch=32 if big else 4, prompt=128 if big else 16, new_tokens=128 if big else 16).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each fn over repeats (alternating), after one warm-up; the slowest rank counts."""
    for name, fn in list(fns.items()):  # warm-up; a run this transformers version refuses is reported, not fatal
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a bench reports what failed and goes on
            print(f"rank {dist.get_rank()}: {name} failed and is left out: {type(err).__name__}: {err}", flush=True)
            del fns[name]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(v) for v in times.values()], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist()))


def _models(args, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(max_position_embeddings=args.prompt + args.new_tokens + 8, pad_token_id=0,
                         bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, **SHAPES[args.shape])
    torch.manual_seed(0)
    with device:
        whole = AutoModelForCausalLM.from_config(config).eval()
    grid = Grid(pipe=1)
    policy = PipelineModule(hf_layer_specs(whole), grid=grid, device=device)  # the same weights, by name
    opt = ZeroOptimizer(torch.optim.AdamW(policy.parameters(), lr=1e-6), group=grid.data_group, module=policy,
                        config=ZeroConfig(stage=3))
    with device:
        wrapped = AutoModelForCausalLM.from_config(config).eval()
    wrapped.load_state_dict(whole.state_dict())
    hf_opt = ZeroOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-6), group=grid.data_group, module=wrapped,
                           config=ZeroConfig(stage=3))
    return whole, policy, opt, wrapped, hf_opt


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    whole, policy, opt, wrapped, hf_opt = _models(args, device)
    whole.to(dtype)
    vocab = whole.config.vocab_size
    prompts = torch.randint(1, vocab, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    n = args.new_tokens
    hf = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    tokens: dict[str, torch.Tensor] = {}

    graph = {"on": device.type == "cuda" or None, "auto": None, "off": False}[args.cuda_graph]

    def ours(static: bool):
        with gathered(opt, dtype=dtype):
            tokens[f"ours {static}"] = hf_generate(policy, prompts, n, static_cache=static,
                                                   cuda_graph=graph if static else False)

    runs = {"pipezero, gathered ZeRO-3": lambda: ours(True), "pipezero, gathered, dynamic": lambda: ours(False)}
    if args.naive:
        runs["pipezero, ZeRO-3 hooks"] = lambda: hf_generate(policy, prompts, n)
    runs["transformers, ZeRO-3"] = lambda: wrapped.generate(prompts, **hf)
    runs["transformers, whole"] = lambda: tokens.__setitem__("transformers", whole.generate(prompts, **hf))
    if not args.no_static:
        runs["transformers, static"] = lambda: whole.generate(prompts, cache_implementation="static", **hf)
    with torch.no_grad():
        seconds = _timed(runs, device, args.repeats)
    split = _iteration_split(args, policy, opt, prompts, dtype)
    same = {name: float((tokens[key] == tokens["transformers"]).all(-1).float().mean())
            for name, key in [("static", "ours True"), ("dynamic", "ours False")]
            if key in tokens and "transformers" in tokens}
    if dist.get_rank() == 0:
        _report(args, sum(p.numel() for p in whole.parameters()), seconds, split, dtype, same)
    dist.barrier()


def _iteration_split(args, policy, opt, prompts, dtype) -> dict[str, float]:
    """Median gather / generate / score / train seconds of a few GRPO iterations (group 4)."""
    loss = PolicyLoss(GRPOConfig(beta=0.0))
    group = 4
    few = prompts[:max(1, args.batch // group)]

    def reward(ids, mask, completion, done):
        return (completion % 7 == 0).float().mean(-1)
    splits: dict[str, list[float]] = {}
    for _ in range(args.repeats + 1):
        batch = rollout(policy, opt, few, torch.ones_like(few), reward, group_size=group,
                        max_new_tokens=args.new_tokens, sampling=Sampling(temperature=1.0), stop_tokens=[],
                        pad_token_id=0, config=loss.config, gather_dtype=dtype, score_old=True)
        _sync(prompts.device)
        t0 = time.perf_counter()
        train_step(policy, opt, batch, loss)
        _sync(prompts.device)
        batch.timings["train_s"] = time.perf_counter() - t0
        for key, value in batch.timings.items():
            splits.setdefault(key, []).append(value)
    return {key: statistics.median(values[1:]) for key, values in splits.items()}


def _report(args, params: int, seconds: dict, split: dict, dtype, same: dict[str, float]) -> None:
    tokens = args.batch * args.new_tokens
    print(f"\nLlama {SHAPES[args.shape]['num_hidden_layers']} x {SHAPES[args.shape]['hidden_size']} "
          f"({params / 1e6:.0f}M params), {dist.get_world_size()} ranks, {args.device}, {str(dtype).split('.')[-1]}, "
          f"batch {args.batch} per rank, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, "
          f"median of {args.repeats}\n")
    print("| run | s | tokens/s per rank | vs transformers whole | vs fastest transformers | vs transformers ZeRO-3 |")
    print("|---|---|---|---|---|---|")
    nan = float("nan")
    base, zero3 = seconds.get("transformers, whole", nan), seconds.get("transformers, ZeRO-3", nan)
    fastest = min((s for name, s in seconds.items() if name.startswith("transformers")), default=nan)
    for name, s in seconds.items():
        print(f"| {name} | {s:.3f} | {tokens / s:.0f} | {base / s:.2f} | {fastest / s:.2f} | {zero3 / s:.2f} |")
    print("\nRows whose greedy tokens equal transformers' whole-model generate: "
          + ", ".join(f"{k} {v:.0%}" for k, v in same.items()))
    print("\nOne GRPO iteration (rollout of batch/4 prompts x 4, then one step), seconds: "
          + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in split.items()))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
