"""ZeRO-3 inside the pipeline on pipe 2 x data 2: pipezero vs torch.distributed.pipelining + fully_shard.

The peer is torchtitan's composition: each pipeline stage's layers wrapped by FSDP2
(`fully_shard` over the data axis, one unit per stage, reshard_after_forward=False as
torchtitan sets it under pipelining) and run by torch's schedule of the same name. Ours:
PipelineModule + ZeroOptimizer(stage=3) + PipelineRunner, both settings of
reshard_after_forward. Same GPT (examples/gpt.py layers, untied, since torch's pipelining
cannot tie across stages), same cut, same microbatches, Adam, fp32 (bf16 autocast on CUDA).
Printed per schedule: median step seconds, ratio torch/ours (> 1: we are faster), and the
peak per step: on CUDA the peak allocated above the step's start, on CPU the peak bytes of
whole (gathered) parameters of our ZeRO-3 buckets (what the knob changes).

    python bench/zero3_pipe.py                                    # CPU, gloo, 4 processes
    python bench/zero3_pipe.py --device cuda --layers 24 --d-model 2048 --heads 16 --seq 2048 \\
        --vocab 32000 --batch 32 --microbatches 8                  # 4 GPUs (bench/gpu.sh zero3-pipe)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pipe import SCHEDULES, _autocast, _batch, _cfg, _max_over_ranks, _specs, _sync  # noqa: E402
from bench.pipe import setup_torch as torch_pipeline  # noqa: E402
from bench.launch import init_rank  # noqa: E402
from examples.gpt import gpt_loss  # noqa: E402
from pipezero.pipe import PipelineModule, PipelineRunner  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402


def setup_ours(name, args, grid, device, reshard: bool):
    """Our runner at stage 3; returns (one step, layer bounds, a function -> peak whole bytes since last call)."""
    sched = SCHEDULES[name][0](num_microbatches=args.microbatches)
    model = PipelineModule(_specs(_cfg(args)), grid=grid, loss_fn=gpt_loss, num_chunks=sched.num_chunks,
                           placement=sched.placement, partition_method="type:Block", device=device)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4), group=grid.data_group, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    runner = PipelineRunner(model, sched, optimizer=opt, reshard_after_forward=reshard)
    ids, targets = _batch(args, device)
    peak = [0]
    gather = opt.gather_params

    def counting_gather(params, wait=True):  # whole bytes after each gather: the step's parameter peak
        gather(params, wait)
        whole = sum(b.padded * b.flat.element_size() for b in opt.buckets if b.flat is not None)
        peak[0] = max(peak[0], whole)
    opt.gather_params = counting_gather

    def step():
        with _autocast(device, args):
            runner.train_step(ids, targets)
        opt.step()
        opt.zero_grad()

    def take_peak() -> int:
        value, peak[0] = peak[0], 0
        return value
    return step, model.bounds, take_peak


def setup_torch(name, args, grid, device, bounds):
    """torch.distributed.pipelining's schedule over stages that fully_shard shards over the data axis."""
    from torch.distributed.fsdp import fully_shard

    return torch_pipeline(name, args, grid, device, bounds,
                          prepare=lambda layers: fully_shard(layers, mesh=grid.mesh["data"], reshard_after_forward=False),
                          make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-4))


def _timed(step, device, steps: int, take_peak=None) -> tuple[float, float]:
    """Median step seconds (max over ranks) and the peak per step in MiB (max over ranks and steps)."""
    cuda = device.type == "cuda"
    step()  # warm-up
    times, peaks = [], []
    for _ in range(steps):
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        if take_peak:
            take_peak()
        start = time.perf_counter()
        step()
        _sync(device)
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base if cuda else (take_peak() if take_peak else 0)
        elapsed, peak = _max_over_ranks([elapsed, peak], device)
        times.append(elapsed)
        peaks.append(peak)
    return statistics.median(times), max(peaks) / 2**20


def worker(rank, world, args, port, queue):
    if args.device == "cpu":
        torch.set_num_threads(1)
    device = init_rank(rank, world, port, args.device, timeout_s=600)
    grid = Grid(pipe=2)
    rows = []
    for name in args.schedules:
        row = [name]
        for reshard in (False, True):
            step, bounds, take_peak = setup_ours(name, args, grid, device, reshard)
            row += _timed(step, device, args.steps, take_peak)
        try:
            row += _timed(setup_torch(name, args, grid, device, bounds), device, args.steps)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this schedule is reported, not fatal
            row += [float("nan"), float("nan")]
            if rank == 0:
                print(f"torch {name} + fully_shard failed: {type(e).__name__}: {e}", flush=True)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--schedules", nargs="+", default=["1F1B", "Interleaved1F1B", "ZeroBubbleV"],
                    choices=list(SCHEDULES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="per data rank")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    args.precision = "autocast"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(4, args, port, queue), nprocs=4, join=True)
    rows = queue.get()
    what = "peak allocated MiB" if args.device == "cuda" else "peak whole-param MiB"
    print(f"pipe 2 x data 2, ZeRO-3, {args.device}, {args.layers} layers d{args.d_model}, batch {args.batch} "
          f"per data rank, m {args.microbatches}; median of {args.steps} steps ({what})")
    print(f"{'schedule':16} {'ours whole s':>12} {'peak':>7} {'ours reshard s':>14} {'peak':>7} "
          f"{'torch+fsdp s':>12} {'peak':>7} {'ratio':>6}")
    for name, t0, m0, t1, m1, tt, mt in rows:
        print(f"{name:16} {t0:12.4f} {m0:7.1f} {t1:14.4f} {m1:7.1f} {tt:12.4f} {mt:7.1f} {tt / min(t0, t1):6.2f}")


if __name__ == "__main__":
    main()
