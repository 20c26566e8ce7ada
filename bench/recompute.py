"""Activation checkpointing on one device: peak memory and step time, none / full / selective / offload.

    python bench/recompute.py                                   # CPU, small: the code paths, no numbers
    python bench/recompute.py --device cuda --layers 8 --d-model 2048 --heads 16 --seq 8192 --dtype bf16

The package's GPT as one pipeline stage (PipelineModule, pipe 1, 1F1B over --micro micro-batches of
one sequence) trains with each RecomputeConfig; the table prints the step time (median of --steps after
one warm-up), the peak device memory of the step (CUDA) and that peak over the plain run's, and checks
that every variant's loss equals the plain one's. Compile follows PipelineModule's default (on CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
from pipezero.pipe.memory.recompute import RecomputeConfig
from pipezero.topology import Grid
from pipezero.train.gpt.model import GPTConfig, gpt_loss, gpt_specs

VARIANTS = {"none": None, "full": RecomputeConfig(mode="full"), "selective": RecomputeConfig(mode="selective"),
            "full+offload": RecomputeConfig(mode="full", offload=True),
            "selective+offload": RecomputeConfig(mode="selective", offload=True)}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step (one sequence each)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", default=None, choices=["on", "off"], help="default: PipelineModule's")
    p.add_argument("--variants", default=",".join(VARIANTS))
    return p.parse_args()


def _run(args: argparse.Namespace, grid: Grid, recompute: RecomputeConfig | None) -> tuple[float, float, float]:
    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                    seq_len=args.seq, seed=0)
    compile = None if args.compile is None else args.compile == "on"
    model = PipelineModule(gpt_specs(cfg), grid, loss_fn=gpt_loss, device=device, recompute=recompute,
                           compile=compile).to(dtype)
    runner = PipelineRunner(model, OneFOneB(num_microbatches=args.micro))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen).to(device)
    times, loss = [], 0.0
    for step in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = runner.train_step(ids[:, :-1], ids[:, 1:]).item()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    del runner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times) * 1e3, peak, loss


def main() -> None:
    args = _args()
    grid = Grid(pipe=1)
    rows = {name: _run(args, grid, VARIANTS[name]) for name in args.variants.split(",")}
    base = rows.get("none")
    print(f"GPT {args.layers} x {args.d_model}, seq {args.seq}, {args.micro} micro-batches, {args.dtype}, "
          f"{args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'})")
    print(f"{'variant':<18} {'step ms':>9} {'peak GiB':>9} {'x plain':>8}  loss")
    for name, (ms, peak, loss) in rows.items():
        ratio = peak / base[1] if base and base[1] == base[1] else float("nan")
        print(f"{name:<18} {ms:9.1f} {peak:9.2f} {ratio:8.2f}  {loss:.6f}")
        if base is not None:
            assert abs(loss - base[2]) <= 1e-3 * max(1.0, abs(base[2])), (name, loss, base[2])


if __name__ == "__main__":
    main()
