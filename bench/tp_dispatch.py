"""What tensor parallelism's dispatch costs: a GPT Block split on a one-rank mesh vs the plain Block.

    python bench/tp_dispatch.py                  # CPU, one process (gloo)
    python bench/tp_dispatch.py --device cuda    # one GPU (nccl)
    python bench/tp_dispatch.py --device cuda --compile

On a one-rank mesh a split Block computes exactly what the plain one does (the shards are
whole, the all-reduces move nothing), so the ratio of their forward + backward times is the
host overhead of the split (gpt_tensor_plan: qkv/fc column-wise, proj/out row-wise), in two
implementations: DTensor (torch's parallelize_module, the old path) and local tensors
(pipe/tensor_linear.py, what apply_tensor_plan runs now: hooks and explicit all-reduces).
Issue 31's goal: the split Block within 5% of the plain one (ratio <= 1.05). Alternating
repeats, median of the rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import Block, GPTConfig, gpt_tensor_plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import profiled  # noqa: E402


def _time(block, x, device, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        block(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def _blocks(args, device) -> dict[str, torch.nn.Module]:
    """The plain Block and its two one-rank splits, equal weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipezero.pipe.tensor_parallel import shard_module

    cfg = GPTConfig(d_model=args.d_model, n_head=args.heads, seq_len=args.seq)
    plain = Block(cfg, 0).to(device=device, dtype=getattr(torch, args.dtype))
    mesh = init_device_mesh(device.type, (1,))
    blocks = {"plain": plain}
    for name, dtensor in (("DTensor", True), ("local tensors", False)):
        split = copy.deepcopy(plain)
        shard_module(split, mesh, gpt_tensor_plan()(split), dtensor=dtensor)
        blocks[name] = split
    return blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compile", action="store_true", help="every Block torch.compile'd")
    p.add_argument("--profile", default=None, help="a folder: one more forward + backward of each block under "
                   "torch.profiler (bench/profiling.py)")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29771")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    blocks = _blocks(args, device)
    x = torch.randn(args.batch, args.seq, args.d_model, device=device, dtype=getattr(torch, args.dtype),
                    requires_grad=True)
    if args.compile:
        for block in blocks.values():
            block.compile()
    for name, block in blocks.items():  # the same function on one rank
        torch.testing.assert_close(block(x), blocks["plain"](x), msg=name)
        _time(block, x, device, 2)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in blocks}
    for _ in range(args.rounds):
        for name, block in blocks.items():
            times[name].append(_time(block, x, device, args.repeats))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, block in blocks.items():  # --profile: one more forward + backward of each, under torch.profiler
        with profiled(args.profile, f"tp-dispatch-{name.replace(' ', '-')}{'-compiled' if args.compile else ''}"):
            _time(block, x, device, 1)
    print(f"GPT Block d {args.d_model}, {args.heads} heads, seq {args.seq}, batch {args.batch}, {args.dtype}, "
          f"{args.device}{', compiled' if args.compile else ''}, torch {torch.__version__}; forward + backward, "
          f"median of {args.rounds} x {args.repeats}")
    print(f"| {'block':<32} | {'ms':>8} | {'vs plain':>8} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 10}|")
    for name, t in median.items():
        label = name if name == "plain" else f"tensor-parallel, {name}"
        print(f"| {label:<32} | {t * 1e3:>8.3f} | {t / median['plain']:>8.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
