"""Training throughput of the GPT example: pipezero's parts vs torch DDP, side by side in one run.

    python bench/train.py                       # 4 CPU processes (gloo)
    python bench/train.py --device cuda --world 2
    python bench/train.py --device cuda --world 1 --layers 24 --d-model 2048 --heads 16 --seq-len 2048 \
        --vocab 32000 --global-batch 32 --micro-batches 8 --runs torch-eager torch-compiled pipezero-1 pipezero-1-fast

Every variant trains the same GPT (examples/gpt.py) on the same global batch of byte tokens
with AdamW: torch's DistributedDataParallel over all ranks (what a user would otherwise pick
when the model fits), pipezero with pipe 1 (ZeRO-2 over all ranks) and pipezero with pipe 2
(1F1B, ZeRO-2 over the rest). Reported: median step time after warm-up, tokens/s, and the
ratio to DDP (below 1 is slower). On one GPU (`--runs`, bf16): plain PyTorch (fp32 weights
under bf16 autocast, AdamW; eager, and each Block `torch.compile`d) beside pipezero's ZeRO-1
(a bf16 model with fp32 masters; eager, and `-fast`: compiled Blocks, pipe/compile.py, and the
fused head + loss, pipe/fused_loss.py), with MFU (6N + 12 L d s FLOPs per token, 989 TFLOP/s)
and peak memory. `--float8 RECIPE`: every run's Blocks' Linears in fp8 (torchao; MFU still counts
against the bf16 peak, as the tokens/s a user sees).
"""

from __future__ import annotations

import argparse
import gc
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
from gpt import GPT, GPTConfig, flops_per_token, gpt_loss, gpt_specs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import profiled  # noqa: E402

PEAK_FLOPS = 989e12  # H200 SXM dense bf16 (datasheet)


def _batch(step: int, size: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, 256, (size, seq + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def _ddp_steps(args, cfg: GPTConfig, device, compiled: bool = False, label: str = "ddp") -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPT(cfg).to(device)
    if args.float8:  # what a plain-PyTorch user writes for fp8: torchao's conversion of each Block
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for layer in model.layers[1:-2]:
            convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(args.float8))
    if compiled:
        for layer in model.layers[1:-2]:  # the Blocks
            layer.compile(mode=args.compile_mode)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", torch.bfloat16) if args.runs and device.type == "cuda" else _null()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = args.global_batch // world
    micro = per_rank // args.micro_batches

    def one_step(x, y) -> None:
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        for m in range(args.micro_batches):
            sl = slice(m * micro, (m + 1) * micro)
            ctx = ddp.no_sync() if m < args.micro_batches - 1 else _null()
            with ctx, autocast:
                loss = gpt_loss(ddp(x[sl]), y[sl]) / args.micro_batches
            loss.backward()
            total = loss.detach() if m == 0 else total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total
    return _timed(args, cfg, device, one_step, label)


def _pipezero_steps(args, cfg: GPTConfig, device, pipe: int, stage: int = 2, compiled: bool = False,
                    fused: bool = False, label: str = "pipezero") -> list[float]:
    from pipezero.train.build import build

    world = dist.get_world_size()
    data = world // pipe
    config = {"train_batch_size": args.global_batch, "gradient_accumulation_steps": args.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
              "pipeline": {"stages": pipe}}
    if args.runs and device.type == "cuda":
        config.update(bf16={"enabled": True}, gradient_clipping=0.0)
    if args.grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.float8 import Float8Config

    compile = CompileConfig(mode=args.compile_mode) if compiled else False
    float8 = Float8Config(recipe=args.float8) if args.float8 else None
    parts = build(config, specs=gpt_specs(cfg, fused_loss=fused), loss_fn=gpt_loss, device=device, compile=compile,
                  float8=float8)
    per_rank = args.global_batch // data
    r = parts.grid.data_rank

    def one_step(x, y) -> None:
        loss = parts.runner.train_step(x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank])
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        return loss
    return _timed(args, cfg, device, one_step, label)


def _timed(args, cfg: GPTConfig, device, one_step, label: str) -> list[float]:
    """Seconds of each of args.steps steps (one_step(x, y) on that step's global batch, returning its
    loss: rank 0 prints the last, fp8 beside bf16's); then, with --profile, one more step under
    torch.profiler (bench/profiling.py)."""
    times = []
    for step in range(args.steps):
        x, y = _batch(step, args.global_batch, cfg.seq_len, device)
        _sync(device)
        t0 = time.perf_counter()
        loss = one_step(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(f"{label}: loss {float(loss):.5f} after step {args.steps} (its rank's micro-batches)", flush=True)
    with profiled(args.profile, f"train-{label}"):
        one_step(*_batch(args.steps, args.global_batch, cfg.seq_len, device))
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
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len,
                    vocab_size=args.vocab)
    results, peaks = {}, {}
    if not args.runs:
        results["torch DDP"] = _ddp_steps(args, cfg, device)
        for pipe in (1, 2):
            results[f"pipezero pipe {pipe} x data {args.world // pipe}, ZeRO-2"] = _pipezero_steps(args, cfg, device,
                                                                                                  pipe)
    for name in args.runs or ():
        held = 0
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)  # left by earlier runs: the peak is counted above it
        try:
            if name.startswith("torch-"):
                results[name] = _ddp_steps(args, cfg, device, compiled=name == "torch-compiled", label=name)
            else:
                results[name] = _pipezero_steps(args, cfg, device, 1, int(name.split("-")[1]),
                                                compiled=name.endswith(("-fast", "-compile")),
                                                fused=name.endswith(("-fast", "-fused")), label=name)
        except Exception as err:  # noqa: BLE001 - one failing contender must not hide the others' numbers
            if rank == 0:
                print(f"{name} failed: {type(err).__name__}: {err}"[:2000], flush=True)
            continue
        peaks[name] = (torch.cuda.max_memory_allocated(device) - held) / 2**20 if device.type == "cuda" else 0.0
        if rank == 0:
            print(f"{name}: {statistics.median(results[name][args.warmup:]) * 1e3:.0f} ms/step", flush=True)
    if rank == 0:
        queue.put((results, peaks))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--runs", nargs="*", default=None,
                   choices=["torch-eager", "torch-compiled"] + [f"pipezero-{s}{v}" for s in (1, 2) for v in
                                                                 ("", "-fast", "-compile", "-fused")],
                   help="instead of DDP vs pipe 1 / pipe 2: these one-stage runs (-compile: Blocks compiled, "
                        "-fused: the fused head + loss, -fast: both)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--float8", default=None, choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                   help="every run's Blocks' Linears in fp8 with this torchao recipe (plain runs: torchao's "
                   "conversion by hand; pipezero: build(float8=...))")
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode for every compiled run, the plain "
                   "one's too (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--grad-accum-dtype", default=None, choices=["fp32"],
                   help="the pipezero runs' ds_config data_types.grad_accum_dtype (bf16 gradients summed in fp32)")
    p.add_argument("--profile", default=None, help="a folder: one more step of each run under torch.profiler "
                   "(bench/profiling.py writes train-<run>.txt there)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(args, port, queue), nprocs=args.world, join=True)
    results, peaks = queue.get()
    tokens = args.global_batch * args.seq_len
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len,
                    vocab_size=args.vocab)
    first = next(iter(results.values()), None)
    base = statistics.median(first[args.warmup:]) if first else float("nan")
    print(f"GPT {args.layers} layers x d {args.d_model}, seq {args.seq_len}, vocab {args.vocab}, global batch "
          f"{args.global_batch} in {args.micro_batches} micro-batches, {args.world} x {args.device}, median of "
          f"{args.steps - args.warmup}" + (f", the Blocks' Linears in fp8 ({args.float8})" if args.float8 else ""))
    print(f"| variant | step ms | tokens/s | vs {next(iter(results), '-')} | MFU | peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, times in results.items():
        t = statistics.median(times[args.warmup:])
        mfu = f"{tokens / t * flops_per_token(cfg) / args.world / PEAK_FLOPS:.1%}" if args.device == "cuda" else "-"
        print(f"| {name} | {1e3 * t:.1f} | {tokens / t:,.0f} | {base / t:.2f} | {mfu} | {peaks.get(name, 0):,.0f} |")


if __name__ == "__main__":
    main()
