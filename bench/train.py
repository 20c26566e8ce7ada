"""Training throughput of the GPT example: pipezero's parts vs torch DDP, side by side in one run.

    python bench/train.py                       # 4 CPU processes (gloo)
    python bench/train.py --device cuda --world 2

Every variant trains the same GPT (examples/gpt.py) on the same global batch of byte tokens
with AdamW: torch's DistributedDataParallel over all ranks (what a user would otherwise pick
when the model fits), pipezero with pipe 1 (ZeRO-2 over all ranks) and pipezero with pipe 2
(1F1B, ZeRO-2 over the rest). Reported: median step time after warm-up, tokens/s, and the
ratio to DDP (below 1 is slower).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_loss, gpt_specs  # noqa: E402


def _batch(step: int, size: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, 256, (size, seq + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _ddp_steps(args, cfg: GPTConfig, device) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPT(cfg).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = args.global_batch // world
    micro = per_rank // args.micro_batches
    times = []
    for step in range(args.steps):
        x, y = _batch(step, args.global_batch, cfg.seq_len, device)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        _sync(device)
        t0 = time.perf_counter()
        for m in range(args.micro_batches):
            sl = slice(m * micro, (m + 1) * micro)
            ctx = ddp.no_sync() if m < args.micro_batches - 1 else _null()
            with ctx:
                (gpt_loss(ddp(x[sl]), y[sl]) / args.micro_batches).backward()
        opt.step()
        opt.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _pipezero_steps(args, cfg: GPTConfig, device, pipe: int) -> list[float]:
    from pipezero.train.build import build

    world = dist.get_world_size()
    data = world // pipe
    config = {"train_batch_size": args.global_batch, "gradient_accumulation_steps": args.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
              "pipeline": {"stages": pipe}}
    parts = build(config, specs=gpt_specs(cfg), loss_fn=gpt_loss, device=device)
    per_rank = args.global_batch // data
    r = parts.grid.data_rank
    times = []
    for step in range(args.steps):
        x, y = _batch(step, args.global_batch, cfg.seq_len, device)
        x, y = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        _sync(device)
        t0 = time.perf_counter()
        parts.runner.train_step(x, y)
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    from pipezero.train.build import init_process_group

    init_process_group()
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    cfg = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, seq_len=args.seq_len)
    results = {"torch DDP": _ddp_steps(args, cfg, device)}
    for pipe in (1, 2):
        results[f"pipezero pipe {pipe} x data {args.world // pipe}, ZeRO-2"] = _pipezero_steps(args, cfg, device, pipe)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(args, port, queue), nprocs=args.world, join=True)
    results = queue.get()
    tokens = args.global_batch * args.seq_len
    base = statistics.median(results["torch DDP"][args.warmup:])
    print(f"GPT {args.layers} layers x d {args.d_model}, seq {args.seq_len}, global batch {args.global_batch} "
          f"in {args.micro_batches} micro-batches, {args.world} x {args.device}, median of {args.steps - args.warmup}")
    print(f"{'variant':<40} {'step ms':>9} {'tokens/s':>10} {'vs DDP':>7}")
    for name, times in results.items():
        t = statistics.median(times[args.warmup:])
        print(f"{name:<40} {1e3 * t:>9.1f} {tokens / t:>10.0f} {base / t:>7.2f}")


if __name__ == "__main__":
    main()
