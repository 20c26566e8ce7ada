"""Which axis pays on 2 devices: tensor 2 vs data 2 vs pipe 2 on the same GPT, same global batch.

Every layout trains examples/gpt.py's GPT with the same global batch (batch x seq tokens per
step) and the same micro-batch size, Adam under ZeroOptimizer stage 1:
  tensor 2  Grid(tensor=2): each Block split Megatron-style (gpt_tensor_plan), both ranks see
            the whole batch; two all-reduces of activations per Block forward and backward.
  data 2    Grid(data=2): each rank half the batch (half the micro-batches); one gradient
            reduce-scatter per step; the whole model (and half the Adam state) on each rank.
  pipe 2    Grid(pipe=2): 1F1B, half the layers per rank; activations sent between stages.
  torch TP  the peer a user would otherwise pick for tensor 2: the single-process GPT with
            torch's parallelize_module on every Block and plain Adam (no pipezero parts).
Printed: median step seconds (slowest rank), tokens/s, the ratio to data 2 (> 1: faster
than data 2), peak memory (CUDA: max_memory_allocated; CPU: peak RSS of the process, which
includes the ~0.3-0.5 GB every torch process holds) and the largest rank's parameters plus
Adam state (what each axis divides: tensor and pipe split weights, ZeRO-1 the Adam state).

    python bench/tensor.py                                   # CPU, gloo, 2 processes, small GPT
    python bench/tensor.py --device cuda --layers 24 --d-model 2048 --heads 16 --seq 2048 \\
        --vocab 32000 --batch 32 --microbatches 8             # the lead's 2 x H200 run: ~1.3B, 65,536 tokens
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.gpt import GPT, GPTConfig, gpt_loss, gpt_specs, gpt_tensor_plan  # noqa: E402
from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402

LAYOUTS = {"tensor 2": dict(tensor=2), "data 2": dict(data=2), "pipe 2": dict(pipe=2), "torch TP": None}


def _cfg(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                     seq_len=args.seq)


def _batch(args, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    return ids, torch.roll(ids, -1, dims=1)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)


def setup_ours(layout: dict, args, device):
    """One training step of pipezero's parts on the layout's grid (its share of the global batch)."""
    grid = Grid(pipe=layout.get("pipe", 1), data=layout.get("data", 1), tensor=layout.get("tensor", 1))
    module = PipelineModule(gpt_specs(_cfg(args)), grid=grid, loss_fn=gpt_loss, tensor_plan=gpt_tensor_plan(),
                            device=device)
    opt = ZeroOptimizer(torch.optim.Adam(module.parameters(), lr=1e-4), stage=1, group=grid.data_group)
    runner = PipelineRunner(module, OneFOneB(num_microbatches=args.microbatches // grid.data_size), optimizer=opt)
    ids, targets = _batch(args, device)
    share = args.batch // grid.data_size
    mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)

    def step():
        with _autocast(device):
            runner.train_step(ids[mine], targets[mine])
        opt.step()
        opt.zero_grad()
    return step, module, opt


def setup_torch_tp(args, device):
    """torch alone: the GPT, parallelize_module per Block on a 1-D mesh, Adam, gradient accumulation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tensor",))
    with torch.device(device):
        model = GPT(_cfg(args))
    plan = gpt_tensor_plan()
    for layer in model.layers:
        if plan(layer):
            parallelize_module(layer, mesh, plan(layer))
    # one param group of DTensors, one of plain tensors: foreach Adam (CUDA's default) cannot mix them
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.Adam([{"params": sharded}, {"params": plain}], lr=1e-4)
    ids, targets = _batch(args, device)

    def step():
        for x, y in zip(ids.chunk(args.microbatches), targets.chunk(args.microbatches)):
            with _autocast(device):
                loss = gpt_loss(model(x), y) / args.microbatches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, model, opt


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(step, args, device) -> float:
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _state_bytes(module, opt) -> float:
    """This rank's parameters (local shards) plus optimizer state: what the layout saves at rest."""
    from pipezero.comm.chain import innermost

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = {id(p): local(p) for p in module.parameters()}
    total = sum(t.numel() * t.element_size() for t in params.values())
    for state in innermost(opt).state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return float(total)


def _peak_bytes(device) -> float:
    if device.type == "cuda":
        t = torch.tensor([float(torch.cuda.max_memory_allocated())], device=device)
    else:
        t = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, world, name, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=600))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    layout = LAYOUTS[name]
    step, module, opt = setup_torch_tp(args, device) if layout is None else setup_ours(layout, args, device)
    seconds = _measure(step, args, device)
    peak = _peak_bytes(device)
    state = torch.tensor([_state_bytes(module, opt)], device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put((seconds, peak, state.item()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4, help="per step on the whole batch (data 2: half)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    args = parser.parse_args()
    if args.microbatches % 2 or args.batch % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} must be even (data 2 runs half) and divide "
                     f"--batch {args.batch}")
    tokens = args.batch * args.seq
    print(f"{datetime.date.today()} torch {torch.__version__} device={args.device} GPT {args.layers}x{args.d_model} "
          f"heads {args.heads} seq {args.seq} vocab {args.vocab}; {tokens:,} tokens/step in {args.microbatches} "
          f"micro-batches of {args.batch // args.microbatches}; 2 processes; "
          f"{'bf16 autocast, fp32 weights' if args.device == 'cuda' else 'fp32'}; Adam, ZeRO-1 over data")
    print("| layout | step s | tokens/s | vs data 2 | peak memory GB | params + Adam state MB |")
    print("|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    results = {}
    for i, name in enumerate(args.layouts):
        queue = ctx.SimpleQueue()
        port = 29500 + os.getpid() % 1000 + i
        mp.spawn(worker, args=(2, name, args, port, queue), nprocs=2, join=True)
        results[name] = queue.get()
    base = results.get("data 2", (float("nan"),))[0]
    for name, (seconds, peak, state) in results.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {base / seconds:.2f} | {peak / 1e9:.2f} | "
              f"{state / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
