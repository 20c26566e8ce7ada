"""Expert parallelism on several GPUs (issue 49): `python bench/moe.py --nproc N` runs this file.

    python bench/moe.py --nproc 2 --tiny          # CPU, gloo: a tiny Qwen3-MoE, every run in one world, seconds
    python bench/moe.py --nproc 8                 # 8 GPUs: Qwen3-30B-A3B's shape, all 48 layers, ZeRO-3
    python bench/moe.py --nproc 8 --runs dualpipev 1f1b   # pipe 2 x expert 4: the all-to-all hidden or not

The model: Qwen3-30B-A3B's layer shape (bench/moe.py's), random weights, sized to the machine:
the most decoder layers up to 6 x N with which the planner fits the expert run on these GPUs (N = 8:
the whole 48-layer model, 30.5B parameters, 3.04B active; 2 x H100: 10 layers), bf16
weights and gradients, ZeRO-3 (pipezero's keeps fp32 masters and Adam state: the planner counts them),
every layer's activations recomputed only where the planner says the layout does not fit without
(--checkpoint auto; "ck1" in the layout column; on 8 x H100 at 4096 tokens a row it predicts 93 GiB a GPU
for expert 8 without, 67 with), the load-balancing loss on. A step
trains the same tokens in every run: N x --microbatches rows of --seq tokens (one row a
microbatch), each data x expert replica its own rows of one seeded batch, so the pipezero runs'
first losses agree (their weights are the same: PipelineModule seeds each layer). Runs, each in
fresh processes (one spawn of N ranks, a time limit each; --tiny: all of them in one world):
  expert      pipezero at pipe 1 x expert N: each rank holds E/N experts of every layer, the tokens
              go to them by all-to-all (pipe/expert/); the dense parameters ZeRO-3 over the N ranks
  expert-overlap  the same with ds_config "expert_parallel" "overlap": true: each layer's tokens in two
              halves, each half's all-to-alls in flight while the other half's experts compute
              (pipe/expert/overlap.py); its "a2a hidden" beside expert's is the gain to look for (on
              CPU, gloo's threads move the rows: the tiny rows check the path, not the gain)
  dense       pipezero at pipe 1 x data N (expert 1): every rank all experts, ZeRO-3 over N
  dualpipev   pipezero at pipe 2 x expert N/2 under DualPipeV (the V, 2 chunks a rank), 2 x the
              microbatches per replica (half as many replicas), ZeRO-3 over the N/2 ranks of a stage
  1f1b        the same layout under 1F1B
  dualpipev-pairs  dualpipev with ds_config "expert_parallel" "overlap_pairs": true: each F / B pair of the
              steady state in turns, one microbatch's all-to-all travelling while the other computes
              (pipe/expert/relay.py); eager (refused beside compiled layers), so its "a2a hidden" and step
              time go beside dualpipev's (eager), not dualpipev-compiled's
  torchtitan  torchtitan 0.3.0's Qwen3 MoE (bench/moe.py's builder) with its expert parallel N and FSDP2
              over N, applied in these processes as its trainer applies them (ParallelDims(dp_shard=N,
              ep=N), its sharding config, parallelize_qwen3), flex attention, its all-to-all token
              dispatcher, bf16 parameters and AdamW state (as bench/moe.py builds it; no fp32 copy,
              so it holds less than pipezero's runs), no activation checkpointing. Its
              "partial_dtensor" backend (DTensor on the expert axis, FSDP2 on plain parameters):
              under its default "spmd_types" fully_shard refused the parameters (torch 2.13, CPU;
              they are no DTensors there; the backend is set globally first, as its trainer does).
              It cannot run on CPU: it imports Triton (its async-EP kernels), builds its mesh on
              "cuda" when there is no accelerator, flex attention has no CPU backward, and FSDP2
              reduces its gradients with ReduceOp.PREMUL_SUM (its division turned off), which gloo
              lacks; with local stand-ins for those four (outside the repo) torchtitan and
              torchtitan-compiled each trained a step on two gloo ranks. Its loss is its trainer's:
              FSDP2 sums the gradients, the loss is over the global tokens. Without torchtitan (or
              Triton) its row says why
  -compiled   (any run) its decoder layers torch.compile'd: PipelineModule(compile=...), torchtitan's
              apply_compile (dualpipev-compiled checked on CPU with aot_eager and inductor)
Default runs: expert-compiled dense-compiled torchtitan-compiled dualpipev-compiled 1f1b-compiled.
pipezero's runs are built as `pipezero finetune` builds them: the planner's ds_config for the layout
(pipezero.train.plan: predict -> ds_config, AdamW added) through pipezero.train.build over
hf_layer_specs(config, fused_loss=True, experts="grouped_mm"). Columns, per run:
  tokens/s/GPU  tokens of a step / the step's seconds / N; step ms: the median of --steps timed steps
              after --warmup, each the slowest rank's (barrier, then the devices synchronised)
  MFU         (6 x active parameters + 12 x layers x heads x head_dim x seq) FLOPs a token (bench/moe.py's
              count: active = all but the embedding and the experts a token is not routed to) x tokens / N
              / the step's seconds / 989 TFLOP/s (H100 / H200 SXM dense bf16)
  peak GiB    torch.cuda.max_memory_allocated from the first step on, the fullest rank (the build's
              peak is not counted: it holds a stage's layers with every expert, bf16, before the
              experts are cut and ZeRO-3 shards; the 48-layer model at pipe 1: ~57 GiB a GPU)
  a2a ms, hidden   one more step under torch.profiler: the expert all-to-all's time a rank (mean of the
              ranks; counts and rows, forward and backward) and the share of it during which other
              kernels computed (bench/overlap.py says how). The runner's timeline (pipe/schedule/
              timeline.py) records compute actions and pipeline waits, not the all-to-all inside an
              action, so the share comes from the profiler. pipezero's executor runs a DualPipeV pair's
              forward and backward one after the other on one stream, so little is expected hidden,
              unless the pairs take turns (dualpipev-pairs)
  bubble      the runner's measured bubble (pipe/schedule/timeline.py, the last timed step) / the
              planner's simulated one (pipe runs)
  plan ms, plan GiB, plan a2a ms   the planner's step time, peak memory of the fullest rank and its
              expert all-to-all time (the busiest rank's) for the same layout on the H100 / H200 preset
              of N GPUs (on CPU the H100 preset: the path is checked, not the numbers)
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe import PEAK_FLOPS, _failure, _torchtitan_model, active_parameters, qwen3_moe_config

MULTI_RUNS = tuple(f"{run}{c}" for run in ("expert", "expert-overlap", "dense", "dualpipev", "1f1b",
                                            "torchtitan") for c in ("", "-compiled")) + ("dualpipev-pairs",)
DEFAULT_MULTI_RUNS = ("expert-compiled", "dense-compiled", "torchtitan-compiled", "dualpipev-compiled",
                      "1f1b-compiled")
PIPE_RUNS = ("dualpipev", "1f1b")
LR = 1e-4


# -- the layouts -------------------------------------------------------------------------------
def _layout(run: str, world: int, args, checkpoint: bool = False) -> Any:
    """The planner's Layout of a pipezero run (ZeRO-3; checkpoint: every layer's activations recomputed)."""
    from pipezero.train.plan.layout import Layout

    name = run.removesuffix("-compiled").removesuffix("-overlap").removesuffix("-pairs")  # the same layouts
    pipe = 2 if name in PIPE_RUNS else 1
    expert = 1 if name == "dense" else world // pipe
    microbatches = args.microbatches * pipe  # the same rows a step: half the replicas at pipe 2
    return Layout(pipe=pipe, data=world // (pipe * expert), tensor=1, schedule=name if pipe > 1 else "1f1b",
                  chunks=2 if name == "dualpipev" else 1, microbatches=microbatches, microbatch_size=1, zero=3,
                  expert=expert, checkpoint=int(checkpoint))


def _prediction(run: str, config, world: int, args, cuda: bool, precision: str = "bf16") -> Any:
    """The planner's step for the run's layout (--checkpoint auto: checkpointed if it does not fit without)."""
    from pipezero.train.plan import predict
    from pipezero.train.plan.hardware import h100, h200
    from pipezero.train.plan.model import ModelShape, flops_profile

    preset = h200 if cuda and "H200" in torch.cuda.get_device_name() else h100
    hw = preset(nodes=1, gpus_per_node=world)  # on CPU the H100's: the path is checked, not the numbers
    shape = ModelShape.from_hf_config(config, args.seq, name="qwen3-moe")
    profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
    pred = predict(profile, _layout(run, world, args, args.checkpoint == "full"), hw, shape, precision)
    if args.checkpoint == "auto" and not pred.fits:
        pred = predict(profile, _layout(run, world, args, True), hw, shape, precision)
    return pred


def fitting_layers(args, world: int) -> int:
    """The most decoder layers, up to 6 x world (Qwen3-30B-A3B's 48 on 8 GPUs), even, with which the planner
    fits the expert run's layout on these GPUs (checkpointed if need be); 4 when none does."""
    for layers in range(6 * world, 4, -2):
        args.layers = layers
        if _prediction("expert", qwen3_moe_config(args), world, args, cuda=True).fits:
            return layers
    return 4


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Layers made in the training dtype: the whole model never exists in fp32 on a device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# -- the runners: (step(ids, targets) -> loss, this replica, replicas, the row's extras, bubble() or None) --
def _pipezero(run: str, config, args, device: torch.device, dtype: torch.dtype) -> tuple:
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.train import build
    from pipezero.train.plan import ds_config

    world, cuda = dist.get_world_size(), device.type == "cuda"
    pred = _prediction(run, config, world, args, cuda, "bf16" if dtype == torch.bfloat16 else "fp32")
    cfg = dict(ds_config(pred), optimizer={"type": "AdamW", "params": {"lr": LR}})
    if "-overlap" in run:  # pipezero's own key in DeepSpeed's AutoEP section (train/config/expert.py)
        cfg["expert_parallel"] = {**cfg["expert_parallel"], "overlap": True}
    if run.endswith("-pairs"):  # its other one: DualPipeV's pairs in turns (pipe/pairs.py), eager only
        cfg["expert_parallel"] = {**cfg["expert_parallel"], "overlap_pairs": True}
    compiled = CompileConfig(backend=args.backend) if run.endswith("-compiled") else False
    with _default_dtype(dtype):
        parts = build(cfg, specs=hf_layer_specs(config, fused_loss=True, experts="grouped_mm"),
                      loss_fn=causal_lm_loss, compile=compiled, device=device, hidden_size=config.hidden_size)

    def step(ids, targets):
        loss = parts.runner.train_step(ids, targets)
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        return loss
    extras = {"layout": pred.layout.label, "plan_ms": pred.time.total * 1e3, "plan_gib": pred.memory.total / 2**30,
              "plan_a2a_ms": pred.time.expert_comm * 1e3, "plan_bubble": pred.time.bubble}
    bubble = parts.runner.measured_bubble if pred.layout.pipe > 1 else None
    return step, parts.grid.data_expert_rank, parts.grid.data_expert_size, extras, bubble


def _torchtitan(run: str, config, args, device: torch.device, dtype: torch.dtype) -> tuple:
    """torchtitan's expert parallel as its trainer applies it, in this process group."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    world = dist.get_world_size()
    set_spmd_backend("partial_dtensor")  # as its trainer sets the config's, before building anything
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=world,
                                    spmd_backend="partial_dtensor")  # DTensor on the expert axis, FSDP2 the rest
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    model_config = _torchtitan_model(config, args.seq)
    set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=world > 1)  # its update_from_config's
    with _default_dtype(dtype), torch.device("meta"):
        model = model_config.build()
    precision = "bfloat16" if dtype == torch.bfloat16 else "float32"
    parallelize_qwen3(model, parallel_dims=dims,
                      training=TrainingConfig(mixed_precision_param=precision, mixed_precision_reduce="float32"),
                      parallelism=parallelism,
                      compile_config=CompileConfig(enable=run.endswith("-compiled"), backend=args.backend),
                      ac_config=None, dump_folder=tempfile.gettempdir())
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")

    def step(ids, targets):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        masks = model.get_attention_masks(positions=positions)
        logits = model(ids, positions=positions, attention_masks=masks)
        # its trainer's scaling: FSDP2 sums the gradients (its division off), the loss is over the global tokens
        loss = cross_entropy_loss(logits, targets) / ((targets != -100).sum() * world)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() * world  # the mean over this rank's tokens, as the other rows show it
    return step, dist.get_rank(), world, {"layout": f"fsdp {world} x ep {world}"}, None


# -- measuring one run on this rank ------------------------------------------------------------------
def _rows(args, replica: int, replicas: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This replica's rows of the step's one seeded batch: (ids, targets shifted left, the last -100)."""
    total = dist.get_world_size() * args.microbatches
    ids = torch.randint(0, vocab, (total, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.chunk(replicas)[replica]
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return ids.to(device), targets.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduced(value: float, op, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _timed(step: Callable, batch: tuple, args, device: torch.device) -> tuple[float, float]:
    """(first loss, the median step's seconds, each the slowest rank's)."""
    first = float(step(*batch))
    for _ in range(args.warmup - 1):
        step(*batch)
    times = []
    for _ in range(args.steps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step(*batch)
        _sync(device)
        times.append(_reduced(time.perf_counter() - start, dist.ReduceOp.MAX, device))
    return first, statistics.median(times)


def _profiled(step: Callable, batch: tuple, device: torch.device) -> tuple[float, float]:
    """(all-to-all seconds a rank, the share of it hidden behind compute) over one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    from overlap import all_to_all_overlap

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        step(*batch)
        _sync(device)
    a2a, hidden = all_to_all_overlap(prof)
    world = dist.get_world_size()
    total, hidden = _reduced(a2a, dist.ReduceOp.SUM, device), _reduced(hidden, dist.ReduceOp.SUM, device)
    return total / world, hidden / total if total else 0.0


def measure(run: str, config, args, device: torch.device) -> dict:
    """One run on every rank: the numbers of rank 0's row (every rank returns them)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build = _torchtitan if run.startswith("torchtitan") else _pipezero
    step, replica, replicas, extras, bubble = build(run, config, args, device, dtype)
    batch = _rows(args, replica, replicas, config.vocab_size, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first, seconds = _timed(step, batch, args, device)
    out = dict(extras, ms=seconds * 1e3, loss=_reduced(first, dist.ReduceOp.SUM, device) / dist.get_world_size())
    if bubble is not None:
        out["bubble"] = bubble()
    if device.type == "cuda":
        out["peak_gib"] = _reduced(torch.cuda.max_memory_allocated(device), dist.ReduceOp.MAX, device) / 2**30
    a2a, out["hidden"] = _profiled(step, batch, device)
    out["a2a_ms"] = a2a * 1e3
    out["tokens"] = dist.get_world_size() * args.microbatches * args.seq
    return out


def _rank(rank: int, world: int, runs: list[str], args, port: int) -> None:
    from launch import finish_rank, init_rank

    # --tiny runs every run in one world: a run failing on one rank only leaves its peers waiting a minute
    timeout = 60 if args.tiny else args.timeout
    device = init_rank(rank, world, port, "cpu" if args.tiny else "cuda", timeout_s=timeout)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = qwen3_moe_config(args)
    results = {}
    for run in runs:
        try:
            results[run] = measure(run, config, args, device)
        except Exception as err:  # noqa: BLE001 - a run that cannot run says why; the others still run
            results[run] = {"error": _failure(err)}
            traceback.print_exc()  # now: a peer of this rank may wait for it until the group's timeout
        torch._dynamo.reset()  # the next run compiles its own layers (its warm-up, not this run, pays for it)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(json.dumps(results), flush=True)
    finish_rank()


# -- the processes -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(runs: list[str], argv: list[str], timeout: float) -> dict:
    """The runs in one world of fresh processes (this file's worker mode), killed whole at the time limit."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    moe = str(Path(__file__).with_name("moe.py"))
    proc = subprocess.Popen([sys.executable, moe, *argv, "--worker", ",".join(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too: they are this session's
        _, err = proc.communicate()
        last = [line for line in err.splitlines() if "Error" in line][-1:]  # what a failing rank said, if any
        return {run: {"error": f"timed out after {timeout:.0f} s" + "".join(f" ({e[:200]})" for e in last)}
                for run in runs}
    finally:
        if proc.poll() is None:  # this process was stopped (bench/gpu.sh's timeout): its ranks go with it
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        why = (err.strip().splitlines() or ["failed"])[-1][:300]
        return {run: {"error": why} for run in runs}
    return json.loads(lines[-1])


def _row(run: str, r: dict, args, flops_per_token: float, world: int) -> str:
    if "error" in r:
        return f"| {run} | {r['error']} |" + " |" * 11
    seconds = r["ms"] / 1e3
    per_gpu = r["tokens"] / seconds / world
    mfu = f"{per_gpu * flops_per_token / PEAK_FLOPS:.1%}" if not args.tiny else "-"

    def num(key: str, form: str) -> str:
        return format(r[key], form) if r.get(key) is not None else "-"
    bubble = f"{num('bubble', '.2f')} / {num('plan_bubble', '.2f')}" if "bubble" in r else "-"
    return (f"| {run} | {r['layout']} | {per_gpu:,.0f} | {r['ms']:.0f} | {mfu} | {num('peak_gib', '.1f')} | "
            f"{num('a2a_ms', '.1f')} | {num('hidden', '.0%')} | {bubble} | {num('plan_ms', '.0f')} | "
            f"{num('plan_gib', '.1f')} | {num('plan_a2a_ms', '.1f')} | {r['loss']:.4f} |")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def table(results: dict, args, config, world: int) -> list[str]:
    total, active = active_parameters(config)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * args.seq
    device = "CPU (fp32, gloo)" if args.tiny else f"{world} x {torch.cuda.get_device_name()}"
    lines = [f"Qwen3-MoE {config.num_hidden_layers} x {config.hidden_size}, {config.num_experts} experts top "
             f"{config.num_experts_per_tok} ({_count(total)} parameters, {_count(active)} active), "
             f"{world * args.microbatches} x {args.seq} tokens per step, ZeRO-3, {device}",
             "| run | layout | tokens/s/GPU | step ms | MFU | peak GiB | a2a ms | a2a hidden | bubble / plan | "
             "plan ms | plan GiB | plan a2a ms | first loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return lines + [_row(run, r, args, 6 * active + attention, world) for run, r in results.items()]


def main(args, argv: list[str]) -> None:
    """bench/moe.py --nproc N: the runs, then the table (rank 0 of each world prints its JSON line)."""
    import torch.multiprocessing as mp

    world = args.nproc
    if args.worker:
        mp.spawn(_rank, args=(world, args.worker.split(","), args, _free_port()), nprocs=world, join=True)
        return
    runs = list(args.runs or DEFAULT_MULTI_RUNS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`'s TERM: _launch's finally kills the ranks
    if args.tiny:
        results = _launch(runs, argv, args.timeout)
    else:
        results = {}
        for run in runs:
            results.update(_launch([run], argv, args.timeout))
            print(f"{run}: {results[run]}", flush=True)
    print("\n".join(table(results, args, qwen3_moe_config(args), world)), flush=True)
