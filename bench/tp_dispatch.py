"""What DTensor's eager dispatch costs: a tensor-parallel GPT Block on a one-rank mesh vs the plain Block.

    python bench/tp_dispatch.py                  # CPU, one process (gloo)
    python bench/tp_dispatch.py --device cuda

On a one-rank mesh the sharded Block computes exactly what the plain one does (the shards are
whole, the all-reduces move nothing), so the ratio of their forward + backward times is the
overhead of running the Block's linears as DTensors (gpt_tensor_plan: qkv/fc column-wise, proj/out
row-wise). Issue 31's goal: within 5% (ratio <= 1.05). Alternating repeats, median.
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


def _time(block, x, device, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        block(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compile", action="store_true", help="both Blocks torch.compile'd (compiled DTensor)")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29771")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cfg = GPTConfig(d_model=args.d_model, n_head=args.heads, seq_len=args.seq)
    plain = Block(cfg, 0).to(device)
    tp = copy.deepcopy(plain)
    parallelize_module(tp, init_device_mesh(args.device, (1,)), gpt_tensor_plan()(tp))
    x = torch.randn(args.batch, args.seq, args.d_model, device=device, requires_grad=True)
    if args.compile:
        plain.compile()
        tp.compile()
    torch.testing.assert_close(tp(x), plain(x))  # the same function on one rank
    for block in (plain, tp):
        _time(block, x, device, 2)  # warm-up
    times = {"plain": [], "tp": []}
    for _ in range(args.rounds):
        times["plain"].append(_time(plain, x, device, args.repeats))
        times["tp"].append(_time(tp, x, device, args.repeats))
    a, b = statistics.median(times["plain"]), statistics.median(times["tp"])
    print(f"Block d {args.d_model}, seq {args.seq}, batch {args.batch}, {args.device}, torch {torch.__version__}: "
          f"{'compiled, ' if args.compile else ''}plain {a * 1e3:.2f} ms, tensor-parallel on a one-rank mesh {b * 1e3:.2f} ms, ratio {b / a:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
