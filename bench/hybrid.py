"""The hybrid engine's generation speed: gathered weights + KV cache vs naive ZeRO-3 vs one whole model.

    python bench/hybrid.py                     # CPU, gloo, 2 processes, a small GPT, fp32
    python bench/hybrid.py --device cuda       # one process per GPU, nccl, the ~1.3B GPT (24 x 2048), bf16

Every rank holds a ZeRO-3 shard of examples/gpt.py's GPT (ZeroOptimizer(Adam, stage=3)) and
generates greedily for its own batch of prompts, the RLHF actor's experience phase:
  gathered + KV cache    pipezero.zero.gathered.gathered(opt): one all-gather of every shard
                         (in the inference dtype), then generate() with the KV cache; on
                         CUDA its decode step is a CUDA graph replayed per token (the default)
  gathered + KV, no CUDA graph
                         the same with generate(cuda_graph=False): the decode step's ~500
                         small kernels launched from Python for every token
  streamed (k=1) + KV    gathered(opt, layers_at_a_time=1): one block whole at a time, so
                         every token gathers every layer again (for models that don't fit);
                         the weights move, so no CUDA graph
  naive ZeRO-3           no context: the stage-3 hooks gather each layer for every forward,
                         and no KV cache (each token reruns the sequence): what a plain
                         ZeRO-3 model does under HF-style generate
  whole model (ceiling)  a plain GPT with every weight on the device, KV cache (and CUDA
                         graph), no ZeRO
Prints tokens/s per rank, the ratio to the naive path and to the ceiling, and the switch
cost (gather on entering + free on leaving gathered(), ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from generate import generate  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402
from pipezero.zero.gathered import gathered  # noqa: E402

GATHERED, NO_GRAPH, STREAMED, NAIVE, CEILING = RUNS = (
    "gathered + KV cache", "gathered + KV, no CUDA graph", "streamed (k=1) + KV", "naive ZeRO-3",
    "whole model (ceiling)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--prompt", type=int)
    p.add_argument("--new-tokens", type=int)
    args = p.parse_args(argv)
    big = args.device == "cuda"  # ~1.3B GPT on H200, a small one on 2 CPU cores
    defaults = dict(layers=24, hidden=2048, heads=16, vocab=50304, batch=16, prompt=128, new_tokens=128) if big \
        else dict(layers=4, hidden=256, heads=8, vocab=256, batch=8, prompt=32, new_tokens=32)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(fns: dict, device, repeats: int) -> dict[str, float]:
    """Median seconds of each fn() over repeats, the runs alternating (a noisy machine hits all
    alike), after one warm-up each; the slowest rank counts."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
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


def _switch(opt, dtype) -> None:
    """Enter and leave gathered(opt): all-gather every shard, free the copies."""
    with gathered(opt, dtype=dtype):
        pass


def worker(rank: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.hidden,
                    seq_len=args.prompt + args.new_tokens, seed=0)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(rank)).to(device)
    model = GPT(cfg).to(device, dtype)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4), module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=10 * args.hidden))
    whole = GPT(cfg).to(device, dtype)
    gen = dict(temperature=0)

    def run_gathered(k=None, **kwargs):
        with gathered(opt, dtype=dtype, layers_at_a_time=k):
            generate(model.layers, prompts, args.new_tokens, **gen, **kwargs)

    seconds = _timed({
        GATHERED: run_gathered,
        NO_GRAPH: lambda: run_gathered(cuda_graph=False),
        STREAMED: lambda: run_gathered(1),
        NAIVE: lambda: generate(model.layers, prompts, args.new_tokens, use_cache=False, **gen),
        CEILING: lambda: generate(whole.layers, prompts, args.new_tokens, **gen),
        "switch": lambda: _switch(opt, dtype),
    }, device, args.repeats)
    switch = 1e3 * seconds.pop("switch")
    if rank == 0:
        _report(args, cfg, sum(p.numel() for p in whole.parameters()), seconds, switch, dtype)
    dist.barrier()
    dist.destroy_process_group()


def _report(args, cfg, params: int, seconds: dict, switch_ms: float, dtype) -> None:
    tokens = args.batch * args.new_tokens
    precision = str(dtype).split(".")[-1]
    print(f"\nGPT {cfg.n_layer} x {cfg.d_model} ({params / 1e6:.1f}M params), {args.world} ranks, {args.device}, "
          f"{precision}, batch {args.batch} per rank, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, "
          f"median of {args.repeats}\n")
    print("| run | s | tokens/s per rank | vs naive ZeRO-3 | vs ceiling |")
    print("|---|---|---|---|---|")
    naive, ceiling = seconds[NAIVE], seconds[CEILING]
    for name, s in seconds.items():
        print(f"| {name} | {s:.3f} | {tokens / s:.0f} | {naive / s:.2f} | {ceiling / s:.2f} |")
    print(f"\nswitch cost (gather + free, gathered() entered and left): {switch_ms:.1f} ms")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--device cuda --world {args.world} needs {args.world} GPUs, found "
                         f"{torch.cuda.device_count()}")
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
