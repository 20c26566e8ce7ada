"""The planner against real runs: predicted vs measured step time and peak memory per layout.

    python bench/plan.py                 # CPU, 4 gloo processes, a small GPT, fp32 (a few minutes)
    python bench/plan.py --device cuda   # one process per GPU present, nccl, bf16, the ~1.3B GPT
                                         # (1 GPU: micro-batch 1-8, checkpointing, ZeRO-Offload; 2: pipe/data/tensor)

Predictions come from pipezero.train.plan with this machine's measured layer times
(`pipezero plan --hardware local`); each layout then runs for real through
pipezero.train.build(its ds_config) in fresh processes: one warm-up step, then --steps
timed steps (the median, the slowest rank). Peak memory: on CUDA max_memory_allocated; on
CPU the rise of the process's peak anonymous RSS over the same once the process group is up
(it counts allocator slack and Python objects too; see _reset_peak_rss). Prints one row per layout
(on CUDA also each micro-batch size's measured layer times, pipe.measure_layer_costs: the larger
of a layer's kernels and its launches).
"""

from __future__ import annotations

import argparse
import os
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
from pipezero.train.plan.hardware import h200, local_cpu  # noqa: E402
from pipezero.train.plan.layout import Layout  # noqa: E402
from pipezero.train.plan.model import ModelShape, measure_profile  # noqa: E402

CPU_LAYOUTS = [  # (pipe, data, tensor, schedule, chunks, microbatches, size, zero)
    (1, 4, 1, "1f1b", 1, 2, 1, 0), (1, 4, 1, "1f1b", 1, 2, 1, 2), (2, 2, 1, "1f1b", 1, 4, 1, 1),
    (2, 2, 1, "zbv", 2, 4, 1, 0), (4, 1, 1, "1f1b", 1, 8, 1, 0), (4, 1, 1, "gpipe", 1, 8, 1, 0),
    (2, 1, 2, "1f1b", 1, 8, 1, 0), (4, 1, 1, "1f1b", 1, 8, 1, 0, False, 1)]
GPU2_LAYOUTS = [
    (2, 1, 1, "1f1b", 1, 8, 1, 0), (2, 1, 1, "zbv", 2, 8, 1, 0), (2, 1, 1, "gpipe", 1, 8, 1, 0),
    (1, 2, 1, "1f1b", 1, 4, 2, 0), (1, 2, 1, "1f1b", 1, 4, 2, 1), (1, 2, 1, "1f1b", 1, 4, 2, 2),
    (1, 1, 2, "1f1b", 1, 8, 1, 0)]
GPU1_LAYOUTS = [  # one GPU, 16 sequences per step: micro-batch size, checkpointing, ZeRO-Offload
    (1, 1, 1, "1f1b", 1, 16, 1, 0), (1, 1, 1, "1f1b", 1, 8, 2, 0), (1, 1, 1, "1f1b", 1, 4, 4, 0),
    (1, 1, 1, "1f1b", 1, 2, 8, 0), (1, 1, 1, "1f1b", 1, 16, 1, 0, False, 1), (1, 1, 1, "1f1b", 1, 4, 4, 0, False, 1),
    (1, 1, 1, "1f1b", 1, 4, 4, 1, True, 0), (1, 1, 1, "1f1b", 1, 4, 4, 2, True, 1)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="measure every layout this many times (median error)")
    p.add_argument("--only", type=int, nargs="*", default=None, help="indices of the layouts to run")
    return p.parse_args(argv)


def _worker(rank: int, world: int, cfg: dict, shape: ModelShape, tensor: int, steps: int, device: str, port: int,
            out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    base = 0.0 if cuda else _reset_peak_rss()
    gcfg = GPTConfig(n_layer=shape.layers, n_head=shape.heads, d_model=shape.d_model, seq_len=shape.seq_len,
                     vocab_size=shape.vocab)
    parts = build(cfg, specs=gpt_specs(gcfg), loss_fn=gpt_loss, hidden_size=shape.d_model, tensor=tensor,
                  tensor_plan=gpt_tensor_plan())
    per_rank = parts.config.batch.per_rank_batch_size
    gen = torch.Generator().manual_seed(parts.grid.data_rank)
    split = []  # per step: (train_step seconds, optimizer step seconds)
    for _ in range(steps + 1):
        x = torch.randint(0, shape.vocab, (per_rank, shape.seq_len + 1), generator=gen).to(parts.device)
        _sync(cuda)
        t0 = time.perf_counter()
        parts.runner.train_step(x[:, :-1], x[:, 1:])
        _sync(cuda)
        t1 = time.perf_counter()
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        _sync(cuda)
        split.append((t1 - t0, time.perf_counter() - t1))
    peak = torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM") - _status_bytes("RssFile") - base
    pairs = [(a + b, a) for a, b in split[1:]]  # (whole step, train_step): a rank's optimizer step waits for the rest
    t = torch.tensor([x for pair in pairs for x in pair] + [float(peak)], dtype=torch.float64, device=parts.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step the slowest rank, and the fullest rank
    if rank == 0:
        whole, pipe = sorted(t[:-1].view(-1, 2).tolist())[len(pairs) // 2]  # the median step (main's docstring)
        out["split"] = (pipe, whole - pipe)
        out["memory"] = t[-1].item()
    dist.destroy_process_group()


def _reset_peak_rss() -> float:
    """Restart the process's peak RSS at its current RSS; return the anonymous part in bytes.

    getrusage's ru_maxrss cannot serve: Linux carries it over fork and exec, so a spawned rank
    starts with its parent's RSS as its "peak" and a model smaller than the parent shows no rise
    at all. VmHWM belongs to the process's own memory map, and clear_refs "5" resets it. The
    peak is then VmHWM less the file-backed pages (RssFile: libtorch's code paged in as
    kernels are first used, tens of MB that are no tensor's), less this anonymous base.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("RssAnon")


def _status_bytes(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return float(line.split()[1]) * 1024


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(cfg: dict, shape: ModelShape, tensor: int, world: int, steps: int, device: str
            ) -> tuple[tuple[float, float], float]:
    """((train_step, optimizer step) seconds of the median step, peak bytes), slowest and fullest rank."""
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29600 + (os.getpid() + int(time.time())) % 3000  # a fresh port each time: no TIME_WAIT clash
        mp.spawn(_worker, (world, cfg, shape, tensor, steps, device, port, out), nprocs=world)
        return tuple(out["split"]), out["memory"]


def _setup(device: str):
    if device == "cuda":
        world = torch.cuda.device_count()
        shape = ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304, name="GPT 1.3B")
        hw = replace(h200(1, world), name=f"{world}x {torch.cuda.get_device_name()}", layer_overhead_us=0.0,
                     reserved_gb=0.0)  # measured layer times include launches; allocated bytes exclude the context
        return world, shape, "bf16", hw, GPU1_LAYOUTS if world == 1 else GPU2_LAYOUTS
    world, shape = 4, ModelShape(layers=4, d_model=128, heads=4, seq_len=128, vocab=256)
    return world, shape, "fp32", local_cpu(world), CPU_LAYOUTS


def _profile_line(profile: list, tokens: int) -> str:
    """Each distinct layer's measured forward + backward milliseconds for one micro-batch."""
    kinds = {p.kind: p.seconds * tokens * 1e3 for p in profile}
    return f"  profile at {tokens} tokens: " + ", ".join(f"{k} {ms:.3f} ms" for k, ms in kinds.items())


def main(argv=None) -> None:
    """Predict, run, compare; on CPU the layer costs and Adam are re-measured before every layout.

    The machine is shared: a measurement is the true cost plus whatever the neighbours took.
    The planner takes each layer's least time and multiplies it by the contention measured
    with the ranks' number of processes (plan_hardware._contention), the typical slowdown; the
    run reports its median step. Both are taken right before each run, at the layout's
    micro-batch size, so the two see the same neighbours; --rounds repeats everything and
    reports the median error.
    """
    args = parse_args(argv)
    world, shape, precision, hw, layouts = _setup(args.device)
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"{shape.label}, {precision}, on {hw.name}; median of {args.steps} steps per layout, {args.rounds} round(s)")
    print(f"{'layout':<34} {'pred s':>7} {'meas s':>7} {'err':>5} | {'pipe':>6} {'meas':>6} | {'step':>6} {'meas':>6} "
          f"| {'pred MB':>7} {'meas MB':>7} {'err':>5} | load")
    errors: dict[str, list[tuple[float, float]]] = {}
    profiles: dict[int, list] = {}
    for _ in range(args.rounds):
        for i, row in enumerate(layouts):
            layout = Layout(*row)
            if layout.world != world or (args.only is not None and i not in args.only):
                continue
            if args.device == "cpu" or layout.microbatch_size not in profiles:  # a GPU has no neighbours
                hw = local_cpu(world) if args.device == "cpu" else hw
                profiles[layout.microbatch_size] = measure_profile(shape, precision, layout.microbatch_size,
                                                                   rounds=1 if args.device == "cuda" else 5,
                                                                   device=args.device)
                if args.device == "cuda":
                    torch.cuda.empty_cache()  # the ranks get the whole GPU
                    print(_profile_line(profiles[layout.microbatch_size], layout.microbatch_size * shape.seq_len))
            profile = profiles[layout.microbatch_size]
            pred = predict(profile, layout, hw, shape, precision)
            (pipe, step), peak = measure(ds_config(pred), shape, layout.tensor, world, args.steps, args.device)
            t, m = pred.time.total / (pipe + step) - 1, pred.memory.total / max(peak, 1) - 1
            errors.setdefault(layout.label, []).append((t, m))
            print(f"{layout.label:<34} {pred.time.total:>7.3f} {pipe + step:>7.3f} {t:>+5.0%} | "
                  f"{pred.time.pipeline:>6.3f} {pipe:>6.3f} | {pred.time.exposed_comm + pred.time.optimizer:>6.3f} "
                  f"{step:>6.3f} | {pred.memory.total / 1e6:>7.1f} {peak / 1e6:>7.1f} {m:>+5.0%} | "
                  f"{os.getloadavg()[0]:.0f}", flush=True)
    if args.rounds > 1:
        print("\nmedian over rounds: " + "; ".join(
            f"{k}: time {statistics.median(e[0] for e in v):+.0%}, memory {statistics.median(e[1] for e in v):+.0%}"
            for k, v in errors.items()))


if __name__ == "__main__":
    main()
