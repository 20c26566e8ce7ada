"""The planner against real runs: predicted vs measured step time and peak memory per layout.

    python bench/plan.py                 # CPU, 4 gloo processes, a small GPT, fp32 (a few minutes)
    python bench/plan.py --device cuda   # one process per GPU present, nccl, bf16, the ~1.3B GPT

Predictions come from pipezero.train.plan with this machine's measured layer times
(`pipezero plan --hardware local`); each layout then runs for real through
pipezero.train.build(its ds_config) in fresh processes: one warm-up step, then --steps
timed steps (the median, the slowest rank). Peak memory: on CUDA max_memory_allocated; on
CPU the rise of the process's peak RSS over what it held after the process group came up
(it counts allocator slack and lazily loaded kernels too). Prints one row per layout.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig, gpt_loss, gpt_specs, gpt_tensor_plan  # noqa: E402

from pipezero.train import build  # noqa: E402
from pipezero.train.plan import ds_config, predict  # noqa: E402
from pipezero.train.plan_hardware import h200, local_cpu  # noqa: E402
from pipezero.train.plan_layout import Layout  # noqa: E402
from pipezero.train.plan_model import ModelShape, measure_profile  # noqa: E402

CPU_LAYOUTS = [  # (pipe, data, tensor, schedule, chunks, microbatches, size, zero)
    (1, 4, 1, "1f1b", 1, 2, 1, 0), (1, 4, 1, "1f1b", 1, 2, 1, 2), (2, 2, 1, "1f1b", 1, 4, 1, 1),
    (2, 2, 1, "zbv", 2, 4, 1, 0), (4, 1, 1, "1f1b", 1, 8, 1, 0), (4, 1, 1, "gpipe", 1, 8, 1, 0),
    (2, 1, 2, "1f1b", 1, 8, 1, 0)]
GPU2_LAYOUTS = [
    (2, 1, 1, "1f1b", 1, 8, 1, 0), (2, 1, 1, "zbv", 2, 8, 1, 0), (2, 1, 1, "gpipe", 1, 8, 1, 0),
    (1, 2, 1, "1f1b", 1, 4, 2, 0), (1, 2, 1, "1f1b", 1, 4, 2, 1), (1, 2, 1, "1f1b", 1, 4, 2, 2),
    (1, 1, 2, "1f1b", 1, 8, 1, 0)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args(argv)


def _worker(rank: int, world: int, cfg: dict, shape: ModelShape, tensor: int, steps: int, device: str, port: int,
            out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gcfg = GPTConfig(n_layer=shape.layers, n_head=shape.heads, d_model=shape.d_model, seq_len=shape.seq_len,
                     vocab_size=shape.vocab)
    parts = build(cfg, specs=gpt_specs(gcfg), loss_fn=gpt_loss, hidden_size=shape.d_model, tensor=tensor,
                  tensor_plan=gpt_tensor_plan())
    per_rank = parts.config.batch.per_rank_batch_size
    gen = torch.Generator().manual_seed(parts.grid.data_rank)
    times = []
    for _ in range(steps + 1):
        x = torch.randint(0, shape.vocab, (per_rank, shape.seq_len + 1), generator=gen).to(parts.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        parts.runner.train_step(x[:, :-1], x[:, 1:])
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    t = torch.tensor([statistics.median(times[1:]), float(peak)], dtype=torch.float64, device=parts.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out["time"], out["memory"] = t.tolist()
    dist.destroy_process_group()


def measure(cfg: dict, shape: ModelShape, tensor: int, world: int, steps: int, device: str) -> tuple[float, float]:
    """(median step seconds, peak bytes), the slowest and fullest rank, from fresh processes."""
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29600 + (os.getpid() + int(time.time())) % 3000  # a fresh port each time: no TIME_WAIT clash
        mp.spawn(_worker, (world, cfg, shape, tensor, steps, device, port, out), nprocs=world)
        return out["time"], out["memory"]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        world = torch.cuda.device_count()
        shape = ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304, name="GPT 1.3B")
        hw = replace(h200(1, world), name=f"{world}x {torch.cuda.get_device_name()}", layer_overhead_us=0.0,
                     reserved_gb=0.0)  # measured layer times include launches; allocated bytes exclude the context
        precision = "bf16"
        layouts = GPU2_LAYOUTS
    else:
        world, shape, precision = 4, ModelShape(layers=4, d_model=128, heads=4, seq_len=128, vocab=256), "fp32"
        hw, layouts = local_cpu(world), CPU_LAYOUTS
    torch.set_num_threads(1)
    profile = measure_profile(shape, precision, microbatch=1 if args.device == "cuda" else 2, device=args.device)
    print(f"{shape.label}, {precision}, on {hw.name}; {args.steps} timed steps per layout")
    print(f"{'layout':<44} {'pred s':>8} {'meas s':>8} {'err':>6}   {'pred MB':>8} {'meas MB':>8} {'err':>6}")
    for row in layouts:
        layout = Layout(*row)
        if layout.world != world:
            continue
        pred = predict(profile, layout, hw, shape, precision)
        seconds, peak = measure(ds_config(pred), shape, layout.tensor, world, args.steps, args.device)
        print(f"{layout.label:<44} {pred.time.total:>8.3f} {seconds:>8.3f} {pred.time.total / seconds - 1:>+6.0%}   "
              f"{pred.memory.total / 1e6:>8.1f} {peak / 1e6:>8.1f} {pred.memory.total / max(peak, 1) - 1:>+6.0%}",
              flush=True)


if __name__ == "__main__":
    main()
