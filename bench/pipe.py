"""Pipeline step time: pipezero's PipelineRunner vs torch.distributed.pipelining, same model, same split.

For each schedule both run the same GPT (examples/gpt.py layers, embedding and head untied
since torch.distributed.pipelining cannot tie weights across stages), cut at the same layer
boundaries (pipezero's partition: "type:Block", or with --partition measured the per-layer
forward + backward times measured on the device, so the head and loss weigh what they cost),
the same microbatches and the same fp32
(or, on CUDA, bf16-autocast) policy. Printed: median step seconds, ratio torch/ours
(> 1: we are faster), and for 1F1B DeepSpeed's PipelineModule (bench/ds_pipe.py, where
deepspeed imports; its own bf16 policy with fp32 masters on CUDA); the measured bubble of our
runner next to the simulator's prediction fed the measured action times (their mean, and
each rank's and chunk's own) and the measured time of one activation between ranks; on CUDA
also tokens/s and each runner's step memory (peak allocated above the step's start).
Schedules: GPipe, 1F1B, Interleaved1F1B, ZeroBubbleV, DualPipeV (torch's ScheduleDualPipeV).

    python bench/pipe.py                       # CPU, gloo, 2 and 4 processes
    python bench/pipe.py --device cuda --world 2 --layers 24 --d-model 2048 --heads 16 \\
        --seq 2048 --vocab 32000 --batch 32 --microbatches 8      # the lead's 2 x H200 run
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gaps import device_kernels, gap_report  # noqa: E402
from bench.launch import init_rank  # noqa: E402
from examples.gpt import GPTConfig, gpt_layers, gpt_loss  # noqa: E402
from pipezero.pipe import (Action, Costs, DualPipeV, GPipe, Interleaved1F1B, LayerSpec, OneFOneB,  # noqa: E402
                           PipelineModule, PipelineRunner, ZeroBubbleV, measure_layer_costs, simulate)
from pipezero.pipe.schedule.placement import owner  # noqa: E402
from pipezero.pipe.schedule.timeline import chrome_trace, gather_events  # noqa: E402
from pipezero.precision import MasterWeights  # noqa: E402
from pipezero.topology import Grid  # noqa: E402

# ours -> torch.distributed.pipelining's schedule of the same name
SCHEDULES = {"GPipe": (GPipe, "ScheduleGPipe"), "1F1B": (OneFOneB, "Schedule1F1B"),
             "Interleaved1F1B": (Interleaved1F1B, "ScheduleInterleaved1F1B"),
             "ZeroBubbleV": (ZeroBubbleV, "ScheduleZBVZeroBubble"), "DualPipeV": (DualPipeV, "ScheduleDualPipeV")}


def _specs(cfg: GPTConfig) -> list:
    return [LayerSpec(r.cls, *r.args) for r in gpt_layers(cfg)]


def _batch(args, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    return ids, torch.roll(ids, -1, dims=1)


def _autocast(device, args):
    """bf16 autocast over fp32 weights on CUDA unless the weights themselves are bf16 (--precision bf16)."""
    on = device.type == "cuda" and args.precision == "autocast"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _weights_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.precision == "bf16" else torch.float32


def _optimizer(params: list, args):
    """The same optimizer for both runners: SGD on the weights, or (--optimizer adam-masters)
    Adam on fp32 master copies of bf16 weights, the policy of DeepSpeed's bf16 anchor."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4)
    return MasterWeights(torch.optim.Adam(params, lr=1e-4))


def layer_costs(args, device) -> list[float]:
    """Forward + backward milliseconds of each layer on one microbatch (pipe.measure_layer_costs,
    the head with the loss; the max over ranks): what `--partition measured` balances."""
    ids, targets = (t[:args.batch // args.microbatches] for t in _batch(args, device))
    with _autocast(device, args):
        return measure_layer_costs(_specs(_cfg(args)), ids, loss_fn=gpt_loss, targets=targets,
                                   dtype=_weights_dtype(args))


def setup_ours(name, args, grid, device, costs=None):
    """Our runner on the GPT; returns (one training step, the model's layer boundaries, the runner)."""
    cls, _ = SCHEDULES[name]
    sched = cls(num_microbatches=args.microbatches)
    model = PipelineModule(_specs(_cfg(args)), grid=grid, loss_fn=gpt_loss, num_chunks=sched.num_chunks,
                           placement=sched.placement, partition_method=costs or "type:Block", device=device)
    if grid.rank == 0 and costs:
        print(f"{name}: stage bounds {model.bounds} from measured layer costs (ms) "
              f"{[round(c, 2) for c in costs[:2]]} ... {[round(c, 2) for c in costs[-2:]]}", flush=True)
    model.to(_weights_dtype(args))
    opt = _optimizer(list(model.parameters()), args)
    runner = PipelineRunner(model, sched, optimizer=opt)
    ids, targets = _batch(args, device)

    def step():
        with _autocast(device, args):
            runner.train_step(ids, targets)
        opt.step()
        opt.zero_grad()
    return step, model.bounds, runner


def setup_torch(name, args, grid, device, bounds, prepare=None, make_optimizer=None):
    """torch.distributed.pipelining's schedule of the same name on the same layers and cut.

    `prepare(layers)` readies each stage's layers (default: the weights' dtype; bench/zero3_pipe.py
    passes fully_shard), `make_optimizer(params)` builds the optimizer (default: this bench's).
    """
    from torch.distributed import pipelining

    _, torch_name = SCHEDULES[name]
    ours = SCHEDULES[name][0](num_microbatches=args.microbatches)
    p, chunks = grid.pipe_size, ours.num_chunks
    specs = _specs(_cfg(args))
    stages = []
    for stage in range(p * chunks):
        if owner(stage, p, ours.placement)[0] != grid.pipe_rank:
            continue
        with device:
            layers = torch.nn.Sequential(*[s.build() for s in specs[bounds[stage]:bounds[stage + 1]]])
        prepare(layers) if prepare is not None else layers.to(_weights_dtype(args))
        stages.append(pipelining.PipelineStage(layers, stage, p * chunks, device, group=grid.pipe_group))
    schedule_cls = getattr(pipelining, torch_name)
    sched = schedule_cls(stages if chunks > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=gpt_loss)
    params = [q for s in stages for q in s.submod.parameters()]
    opt = make_optimizer(params) if make_optimizer is not None else _optimizer(params, args)
    ids, targets = _batch(args, device)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step():
        with _autocast(device, args):
            sched.step(*((ids,) if first else ()), target=targets if last else None)
        opt.step()
        opt.zero_grad()
    return step


def compare(name, args, grid, device, costs=None):
    """Alternate our step and torch's (so machine noise hits both alike); medians and our bubble."""
    ours, bounds, runner = setup_ours(name, args, grid, device, costs)
    try:
        theirs = setup_torch(name, args, grid, device, bounds)
    except Exception as e:  # noqa: BLE001 - report the peer's failure in the table, keep going
        theirs = None
        if grid.rank == 0:
            print(f"torch {name}: {type(e).__name__}: {e}", flush=True)
    deepspeed = _deepspeed_peer(name, args, grid, device, bounds)
    times: dict[str, list[float]] = {"ours": [], "torch": [], "deepspeed": []}
    peaks, retries = dict.fromkeys(times, 0.0), dict.fromkeys(times, 0)
    bubbles, costs = [], {}
    for i in range(args.warmup + args.steps):
        for label, step in (("ours", ours), ("torch", theirs), ("deepspeed", deepspeed)):
            if step is None:
                continue
            elapsed, peak, retried = _timed(step, device)
            if i >= args.warmup:
                times[label].append(elapsed)
                peaks[label] = max(peaks[label], peak)
                retries[label] += retried
                if label == "ours":
                    bubbles.append(runner.measured_bubble())
                    events = gather_events(runner.timeline.events, grid.pipe_group)
                    costs = _costs(events)
    if args.trace and grid.rank == 0:  # the last step of ours, one row per rank
        os.makedirs(args.trace, exist_ok=True)
        chrome_trace(events, os.path.join(args.trace, f"pipe-{grid.pipe_size}-{name}.json"))
    if args.profile:
        for label, step in (("ours", ours), ("torch", theirs)):
            if step is not None:
                _profile(f"pipe-{grid.pipe_size}-{name}-{label}", step, device, args.profile)
    median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    memory = {label: f"{peaks[label] / 2**30:.1f}" + (f" ({retries[label]} retries)" if retries[label] else "")
              for label in peaks}
    return {label: median(ts) for label, ts in times.items()}, memory, median(bubbles), costs


def _timed(step, device) -> tuple[float, float, int]:
    """One step: seconds, peak bytes allocated above the step's start (activations, gradients
    and buffers the step adds; every runner's resting weights excluded) and the allocator's
    retries (a full cache freed and cudaMalloc'ed again: slow), each the max over ranks."""
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    start = time.perf_counter()
    step()
    _sync(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    retried = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries if cuda else 0
    elapsed, peak, retried = _max_over_ranks([elapsed, peak, retried], device)
    return elapsed, peak, int(retried)


def _profile(tag, step, device, folder) -> None:
    """One more step under torch.profiler; every rank writes where its GPU idled (bench/gaps.py)
    and its kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    os.makedirs(folder, exist_ok=True)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
    with open(os.path.join(folder, f"{tag}-rank{dist.get_rank()}.txt"), "w") as f:
        f.write(gap_report(device_kernels(prof)) + "\n\n" + table)


def _deepspeed_peer(name, args, grid, device, bounds):
    """DeepSpeed's PipelineModule (bench/ds_pipe.py) for 1F1B, its only schedule, where it imports."""
    if name != "1F1B" or args.no_deepspeed or importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        from bench.ds_pipe import setup_deepspeed
        return setup_deepspeed(args, grid, device, bounds, _specs(_cfg(args)))
    except Exception as e:  # noqa: BLE001 - an optional peer: report and go on
        if grid.rank == 0:
            print(f"deepspeed {name}: {type(e).__name__}: {e}", flush=True)
        return None


def _costs(events) -> dict:
    """Mean seconds of each op letter (F, B, I, W): over every rank's compute events (key
    "all") and per (pipe rank, chunk), from a step's events (names such as "1W3"; a pair run in turns,
    "0F3|1B1" under overlap_pairs, is no one op's time and is left out)."""
    by_op: dict = {}
    for e in events:
        if e.kind == "compute" and "|" not in e.name:
            a = Action.parse(e.name)
            for key in ("all", (e.rank, a.chunk)):
                by_op.setdefault(key, {}).setdefault(a.op.value, []).append(e.end - e.start)
    return {key: {op: statistics.mean(d) for op, d in ops.items()} for key, ops in by_op.items()}


def _cfg(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                     seq_len=args.seq)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float], device) -> list[float]:
    """Each value's max over ranks, in one all-reduce (float64: byte counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(rank, world, args, port, queue):
    if args.device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    device = init_rank(rank, world, port, args.device, timeout_s=600)
    grid = Grid(pipe=world)
    costs = layer_costs(args, device) if args.partition == "measured" else None
    rows = [(name, *compare(name, args, grid, device, costs)) for name in args.schedules]
    p2p = p2p_seconds(args, grid, device)
    if rank == 0:
        queue.put((rows, p2p))
    dist.destroy_process_group()


def p2p_seconds(args, grid, device, repeats: int = 5) -> float:
    """One-way time of one activation (a microbatch's hidden states in the dtype the stages
    send) between pipe ranks 0 and 1: a ping-pong, halved; the max over ranks."""
    elapsed = 0.0
    if grid.pipe_rank < 2 <= grid.pipe_size:
        dtype = torch.float32 if args.precision == "autocast" else _weights_dtype(args)
        x = torch.zeros(args.batch // args.microbatches, args.seq, args.d_model, dtype=dtype, device=device)
        peer = grid.rank_of(pipe=1 - grid.pipe_rank)
        first, second = (dist.send, dist.recv) if grid.pipe_rank == 0 else (dist.recv, dist.send)

        def ping():
            first(x, peer)
            second(x, peer)
        ping()  # warm-up: the pair's connection
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            ping()
        _sync(device)
        elapsed = (time.perf_counter() - start) / repeats / 2
    return _max_over_ranks([elapsed], device)[0]


def _predicted_bubble(name, p, m, measured: dict, per_chunk: bool, p2p: float = 0.0) -> float:
    """The simulator's bubble for the same schedule, fed the measured action times (their
    mean over all ranks and chunks, or per_chunk each (rank, chunk)'s own) and p2p time."""
    sched = SCHEDULES[name][0](num_microbatches=m)
    as_costs = lambda ms: Costs(forward=ms["F"], backward_input=ms.get("I", ms.get("B", 0.0) / 2),  # noqa: E731
                                backward_weight=ms.get("W", ms.get("B", 0.0) / 2), p2p=p2p)
    costs = {key: as_costs(ms) for key, ms in measured.items() if key != "all"} if per_chunk \
        else as_costs(measured["all"])
    try:
        return simulate(sched, num_stages=p, costs=costs, channels="kind", sends="async").bubble
    except Exception as e:  # noqa: BLE001 - the table then shows nan
        print(f"simulate {name}: {e}")
        return float("nan")


def _policy(args) -> str:
    if args.precision == "bf16":
        return "bf16 weights, no autocast, " + ("SGD on the bf16 weights" if args.optimizer == "sgd"
                                               else "Adam on fp32 masters")
    return "bf16 autocast, fp32 weights" if args.device == "cuda" else "fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="pipeline sizes to run")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    parser.add_argument("--partition", choices=["type", "measured"], default="type",
                        help="type: equal Block counts (type:Block); measured: balance measured per-layer costs")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed peer even if it imports")
    parser.add_argument("--profile", default=None, help="folder for kernel tables of one more step (ours, torch)")
    parser.add_argument("--trace", default=None, help="folder for a chrome trace of our last step per schedule")
    parser.add_argument("--optimizer", choices=["sgd", "adam-masters"], default="sgd",
                        help="sgd: SGD on the weights; adam-masters: Adam on fp32 master copies (MasterWeights)")
    parser.add_argument("--precision", choices=["autocast", "bf16"], default="autocast",
                        help="autocast: bf16 autocast over fp32 weights on CUDA (fp32 on CPU); "
                             "bf16: bf16 weights for both runners, no autocast")
    args = parser.parse_args()
    print(f"{datetime.date.today()} torch {torch.__version__} device={args.device} GPT {args.layers}x{args.d_model} "
          f"heads {args.heads} seq {args.seq} vocab {args.vocab} batch {args.batch} m={args.microbatches} "
          f"({_policy(args)})")
    gpu = args.device == "cuda"
    print("| p | schedule | ours s | torch s | torch/ours | DeepSpeed s | DeepSpeed/ours | bubble measured "
          "| simulated (mean costs) | simulated (per-chunk costs) |"
          + (" tokens/s (ours) | step GiB ours / torch / DeepSpeed |" if gpu else ""))
    print("|---" * (12 if gpu else 10) + "|")
    ctx = mp.get_context("spawn")
    for world in args.world:
        queue = ctx.SimpleQueue()
        port = 29500 + os.getpid() % 1000 + world
        mp.spawn(worker, args=(world, args, port, queue), nprocs=world, join=True)
        tokens = args.batch * args.seq
        rows, p2p = queue.get()
        print(f"p = {world}: one activation between ranks takes {p2p * 1e3:.2f} ms (the simulator's p2p)", flush=True)
        for name, secs, gib, bubble, costs in rows:
            ours, theirs, ds = secs["ours"], secs["torch"], secs["deepspeed"]
            sim, sim_chunks = (_predicted_bubble(name, world, args.microbatches, costs, per_chunk, p2p)
                               for per_chunk in (False, True))
            row = (f"| {world} | {name} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f} | {ds:.3f} | "
                   f"{ds / ours:.2f} | {bubble:.2f} | {sim:.2f} | {sim_chunks:.2f} |")
            if gpu:
                row += f" {tokens / ours:,.0f} | {gib['ours']} / {gib['torch']} / {gib['deepspeed']} |"
            print(row, flush=True)

if __name__ == "__main__":
    main()
