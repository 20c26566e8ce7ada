"""A Hugging Face Llama-style model under pipezero beside DeepSpeed and FSDP2.

    python bench/hf.py                                   # CPU smoke: a tiny Llama, gloo, 2 processes
    python bench/hf.py --device cuda                     # every GPU, a ~1.1B Llama (TinyLlama's shape), bf16
    python bench/hf.py --runs deepspeed-pipe deepspeed-1 deepspeed-3   # the DeepSpeed peers on CPU (gloo)

The same transformers model (random weights, built from a config; nothing downloaded), the
same tokens per step, one run after the other in the same processes:
  pipe-<Schedule>  pipezero's pipeline over all ranks (hf_layer_specs, one stage per rank,
                   `--microbatches` = accum x ranks micro-batches), Adam on fp32 masters
  pipe-<Schedule>-fast  the same with compiled decoder layers and loss and the fused head + loss
                   (PipelineModule(compile=True), hf_layer_specs(fused_loss=True))
  pipezero-1/2/3   ZeroOptimizer on the model itself (module=), data parallel over all ranks
  pipezero-1-fast  ZeRO-1 on the model with each decoder layer and the loss compiled (pipe/compile.py)
                   and the fused head + loss (pipe/fused_loss.py: the logits never whole); -compile /
                   -fused: one of the two (any pipezero-S or pipe-<Schedule> run takes these suffixes)
  pipezero-initialize  a DeepSpeed user's loop on pipezero.initialize over deepspeed-1's ds_config (on
                   CUDA by default: the decoder layers compiled, ds_config's Adam on torch's fused kernel)
  torch-eager      plain PyTorch, no pipezero: the model's loss, AdamW on fp32 masters kept by hand
  torch-compiled   the same with each decoder layer torch.compile'd (`layer.compile()`)
  deepspeed-pipe   DeepSpeed's PipelineModule (1F1B, ZeRO-1) over hf_layer_specs as its LayerSpecs, one
                   stage per rank, the pipe-* runs' micro-batches (tests/test_hf_deepspeed.py: it trains
                   exactly as pipezero's pipeline)
  deepspeed-1/2/3  deepspeed.initialize on the same model
                   (the deepspeed-* runs: when `import deepspeed` works; on CPU only when named in --runs,
                   since DeepSpeed's CPU accelerator first compiles its shared-memory comm kernel, minutes, once)
  fsdp2            fully_shard on every decoder layer and the root, bf16 params, fp32 reduce
`--grad-accum-dtype fp32` makes the two ds_config loops (deepspeed-S, pipezero-initialize) sum
gradients in fp32 (DeepSpeed's BF16_Optimizer at stage 1). `--float8 RECIPE` trains the decoder
layers' Linears in fp8: torchao's conversion by hand in the torch-* runs (what a plain-PyTorch
user writes), float8= (pipe/float8.py) in the pipe-*, pipezero-S and pipezero-initialize runs; the
others stay bf16 (their precision column says so).
Prints ms per step, tokens/s, MFU (CUDA: 6N + 12 L h s FLOPs per token over the H200's 989
TFLOP/s dense bf16) and (CUDA) peak allocated memory per rank. Precision on CUDA:
a bf16 model with fp32 masters for pipezero and DeepSpeed, fp32 weights with bf16 compute for
FSDP2; CPU: fp32 everywhere.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import finish_rank, init_rank  # noqa: E402
from profiling import profiled  # noqa: E402

from pipezero.pipe import PipelineModule, PipelineRunner, TiedLayerSpec, make_schedule, schedule_names  # noqa: E402
from pipezero.pipe.compile import CompileConfig, compile_layers, compile_loss  # noqa: E402
from pipezero.pipe.float8 import Float8Config, to_float8  # noqa: E402
from pipezero.pipe.fused_loss import HeadLogits  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402
from pipezero.precision import MasterWeights  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402

LR = 1e-4
PEAK_FLOPS = 989e12  # H200 SXM dense bf16 (datasheet), the MFU denominator of issue 31


class Run(NamedTuple):
    """One contender: step(batches) trains one optimizer step on this rank's micro-batches."""

    step: Callable[[list], None]
    precision: str


def config(args) -> Any:
    from transformers import LlamaConfig

    if args.device == "cuda":  # TinyLlama-1.1B's shape
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000)
    else:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
    # use_cache=False: training keeps no KV cache (with it, each decoder layer is called with the cache
    # and a compiled layer recompiles per layer index)
    return LlamaConfig(**shape, max_position_embeddings=args.seq, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None, use_cache=False)


def _hf_model(cfg, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(cfg).to(dtype)


def build(name: str, args, cfg, device: torch.device) -> Run:
    low = device.type == "cuda"
    dtype = torch.bfloat16 if low else torch.float32
    masters = "bf16 model, fp32 masters" if low else "fp32"
    if args.float8:
        fp8_here = name.startswith(("pipe-", "torch-", "pipezero-1", "pipezero-2", "pipezero-3", "pipezero-init"))
        masters += f", fp8 {args.float8}" if fp8_here else ", no fp8 here"
    suffix = next((s for s in ("-fast", "-compile", "-fused") if name.endswith(s)), "")
    name, compiled, fused = name.removesuffix(suffix), suffix in ("-fast", "-compile"), suffix in ("-fast", "-fused")
    if name.startswith("pipe-"):
        return _pipeline(name[5:], args, cfg, device, dtype, masters, compiled, fused)
    if name.startswith("torch-"):
        return _plain(cfg, device, dtype, masters, compiled=name == "torch-compiled", mode=args.compile_mode,
                      float8=args.float8)
    if name == "pipezero-initialize":
        return _initialize(args, cfg, device, dtype, masters)
    if name.startswith("pipezero-"):
        stage = int(name[-1])
        model = _hf_model(cfg, device, dtype)
        if args.float8:  # as build(model=..., float8=...) does: before the optimizer and compile
            to_float8(model.model.layers, Float8Config(recipe=args.float8), device)
        zero = ZeroConfig(stage=stage, overlap_comm=True, reduce_every_microbatch=stage == 2,
                          stage3_param_persistence_threshold=10 * cfg.hidden_size)
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), module=model, config=zero)
        loss_fn = causal_lm_loss
        if compiled:  # as PipelineModule(compile=True) does: each decoder layer and the loss
            layers, how = list(model.model.layers), CompileConfig(mode=args.compile_mode)
            compile_layers(layers, how, {type(layers[0])})
            loss_fn = compile_loss(causal_lm_loss, how)
        return Run(lambda batches: _accumulate(model, opt, batches, fused, loss_fn), masters)
    if name == "deepspeed-pipe":
        return _deepspeed_pipe(args, cfg, device, dtype, masters)
    if name.startswith("deepspeed-"):
        return _deepspeed(int(name[-1]), args, cfg, device, dtype, masters)
    return _fsdp2(cfg, device, low)


def _pipeline(schedule: str, args, cfg, device, dtype, masters, compiled: bool = False, fused: bool = False) -> Run:
    grid = Grid(pipe=dist.get_world_size())
    sched = make_schedule(schedule, args.accum * dist.get_world_size())
    model = PipelineModule(hf_layer_specs(cfg, fused_loss=fused), grid=grid, loss_fn=causal_lm_loss,
                           num_chunks=sched.num_chunks, placement=sched.placement, device=device,
                           compile=CompileConfig(mode=args.compile_mode) if compiled else False,
                           float8=Float8Config(recipe=args.float8) if args.float8 else None).to(dtype)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=LR)) if dtype != torch.float32 \
        else torch.optim.AdamW(model.parameters(), lr=LR)
    runner = PipelineRunner(model, sched, optimizer=opt)

    def step(batches: list) -> None:  # as many tokens as the data-parallel runs' global batch
        x = torch.cat([b[0] for b in batches] * dist.get_world_size())
        y = torch.cat([b[1] for b in batches] * dist.get_world_size())
        runner.train_step(x, y)
        opt.step()
        opt.zero_grad()
    return Run(step, masters)


def _accumulate(model, opt, batches: list, fused: bool = False, loss_fn: Callable = causal_lm_loss) -> None:
    for i, (x, y) in enumerate(batches):
        with opt.no_sync() if i < len(batches) - 1 else _Null():
            opt.backward(_loss(model, x, y, fused, loss_fn) / len(batches))
    opt.step()
    opt.zero_grad()


def _loss(model, x, y, fused: bool, loss_fn: Callable) -> torch.Tensor:
    """The model's loss; fused: its head and the loss in chunks (pipe/fused_loss.py; a Llama has no logit scale)."""
    if not fused:
        return loss_fn(model(x).logits, y)
    hidden = model.model(x).last_hidden_state
    return loss_fn(HeadLogits(hidden, model.lm_head.weight, model.lm_head.bias), y)


def _plain(cfg, device, dtype, masters_note: str, compiled: bool, mode: str | None = None,
           float8: str | None = None) -> Run:
    """What a user writes without pipezero: bf16 model, fp32 masters by hand, AdamW, accumulation
    (float8: each decoder layer through torchao's conversion, before compiling it)."""
    model = _hf_model(cfg, device, dtype)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for layer in model.model.layers:
            convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(float8))
    if compiled:
        for layer in model.model.layers:
            layer.compile(mode=mode)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params] if dtype != torch.float32 else params
    opt = torch.optim.AdamW(masters, lr=LR)

    def step(batches: list) -> None:
        for x, y in batches:
            (causal_lm_loss(model(x).logits, y) / len(batches)).backward()
        if masters is not params:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not params:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
    return Run(step, masters_note)


def _ds_config(args, stage: int, low: bool) -> dict:
    """The ds_config both DeepSpeed-shaped loops read (deepspeed-S and pipezero-initialize)."""
    ds = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
          "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}}
    if low:
        ds["bf16"] = {"enabled": True}
    if args.grad_accum_dtype:
        ds["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    return ds


def _initialize(args, cfg, device, dtype, masters) -> Run:
    """A DeepSpeed user's loop on pipezero.initialize, the deepspeed-1 run's ds_config: what it gives
    by default (on CUDA: the decoder layers compiled, build(model=...); ds_config's Adam fused)."""
    from pipezero.train import initialize

    model = _hf_model(cfg, device, torch.float32)
    engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                            config=_ds_config(args, 1, dtype == torch.bfloat16),
                            float8=Float8Config(recipe=args.float8) if args.float8 else None)

    def step(batches: list) -> None:  # the engine divides by the accumulation itself, as DeepSpeed's
        for x, y in batches:
            engine.backward(causal_lm_loss(engine(x).logits, y))
            engine.step()
    return Run(step, masters)


def _deepspeed(stage, args, cfg, device, dtype, masters) -> Run:
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    model = _hf_model(cfg, device, torch.float32)
    ds = _ds_config(args, stage, dtype == torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(batches: list) -> None:  # DeepSpeed divides by the accumulation itself
        for x, y in batches:
            engine.backward(causal_lm_loss(engine(x).logits, y))
            engine.step()
    return Run(step, masters)


def deepspeed_layer_specs(specs: list) -> list:
    """pipezero's LayerSpec / TiedLayerSpec list as DeepSpeed's: same class, arguments, tie key and forward_fn."""
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import TiedLayerSpec as DSTiedLayerSpec

    return [DSTiedLayerSpec(s.key, s.cls, *s.args, forward_fn=s.forward_fn, tied_weight_attr=list(s.tied_weight_attrs),
                            **s.kwargs) if isinstance(s, TiedLayerSpec) else DSLayerSpec(s.cls, *s.args, **s.kwargs)
            for s in specs]


def _deepspeed_pipe(args, cfg, device, dtype, masters) -> Run:
    """DeepSpeed's pipeline (1F1B, one stage per rank, ZeRO-1) over hf_layer_specs turned into its LayerSpecs."""
    import deepspeed
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    world = dist.get_world_size()
    with device:  # each stage builds its own layers on its device
        model = DSPipelineModule(layers=deepspeed_layer_specs(hf_layer_specs(cfg)), num_stages=world,
                                 loss_fn=causal_lm_loss, partition_method="parameters")
    ds = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum * world,
          "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}}
    if dtype == torch.bfloat16:  # bf16 weights and activations, fp32 gradient accumulation and masters
        ds.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(batches: list) -> None:  # the pipe-* runs' micro-batches: as many tokens as the data-parallel runs
        engine.train_batch(data_iter=iter(batches * world))
    return Run(step, masters)


def _fsdp2(cfg, device, low: bool) -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _hf_model(cfg, device, torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batches: list) -> None:
        for i, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            (causal_lm_loss(model(x).logits, y) / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Run(step, "fp32 weights, bf16 compute" if low else "fp32")


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- measuring ------------------------------------------------------------------------------
def _batches(args, vocab: int, device: torch.device) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device),
             torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)) for _ in range(args.accum)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args, cfg, device: torch.device) -> tuple[float, float, str]:
    """(median seconds per step after 2 warm-up steps, peak MiB allocated on CUDA, precision)."""
    held = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)  # left by earlier runs (compiled code may keep a model)
        if held > 2**30:
            print(f"{name}: {held / 2**20:,.0f} MiB still allocated from earlier runs; peak counted above it")
    run, batches = build(name, args, cfg, device), _batches(args, cfg.vocab_size, device)
    times = []
    for _ in range(args.steps + 2):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        run.step(batches)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - held) / 2**20 if device.type == "cuda" else 0.0
    with profiled(args.profile, f"hf-{name}"):  # one more step, when --profile names a folder
        run.step(batches)
    precision = run.precision
    del run, batches
    gc.collect()
    return statistics.median(times[2:]), peak, precision


def _runs(args) -> list[str]:
    names = [f"pipe-{s}" for s in args.schedules] + ["pipezero-1", "pipezero-2", "pipezero-3", "fsdp2"]
    names += ["torch-eager", "torch-compiled", "pipezero-1-fast"]
    variants = ("", "-fast", "-compile", "-fused")
    named = [f"pipe-{s}{v}" for s in schedule_names() for v in variants]  # only when named in --runs
    named += [f"pipezero-{stage}{v}" for stage in (1, 2, 3) for v in variants] + ["pipezero-initialize"]
    try:  # on CPU only when named: DeepSpeed's CPU accelerator first compiles its shm comm op (minutes, once)
        import deepspeed  # noqa: F401
        # the pipeline last: its engine leaves its grid in deepspeed's globals, which a later
        # deepspeed.initialize reads as model parallelism (and fails)
        peers = ["deepspeed-1", "deepspeed-2", "deepspeed-3", "deepspeed-pipe"]
        names += [n for n in peers if args.device == "cuda" or n in (args.runs or [])]
    except Exception:  # noqa: BLE001 - optional peer
        pass
    if args.runs:  # in the order given
        return [n for n in args.runs if n in names or n in named]
    return names


def worker(rank: int, world: int, args) -> None:
    device = init_rank(rank, world, args.port, args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = config(args)
    results = {}
    for name in _runs(args):
        try:
            results[name] = measure(name, args, cfg, device)
        except Exception as err:  # noqa: BLE001 - one failing contender must not hide the others' numbers
            if rank == 0:
                print(f"{name} failed: {type(err).__name__}: {err}"[:2000], flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0 and name in results:
            print(f"{name}: {results[name][0] * 1e3:.0f} ms/step, peak {results[name][1]:,.0f} MiB", flush=True)
    if rank == 0:
        _print(results, args, cfg, world)
    finish_rank()


def _print(results: dict, args, cfg, world: int) -> None:
    tokens = args.batch * args.seq * args.accum * world
    params = sum(p.numel() for p in _meta_model(cfg).parameters())
    print(f"{type(cfg).__name__} {cfg.num_hidden_layers}x{cfg.hidden_size} ({params / 1e9:.2f}B parameters), "
          f"{tokens} tokens/step, {world} ranks, {args.device}")
    flops = 6 * params + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq  # per token, forward + backward
    print("| run | precision | ms/step | tokens/s | MFU | peak MiB per rank |")
    print("|---|---|---|---|---|---|")
    for name, (sec, peak, precision) in results.items():
        mfu = f"{tokens / sec * flops / world / PEAK_FLOPS:.1%}" if args.device == "cuda" else "-"
        print(f"| {name} | {precision} | {sec * 1e3:.0f} | {tokens / sec:,.0f} | {mfu} | {peak:,.0f} |")


def _meta_model(cfg) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: 2, or every GPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 on CUDA, 32 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 4 CUDA, 2 CPU)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 2 warm-up steps")
    parser.add_argument("--schedules", nargs="+", default=["dualpipev", "interleaved_1f1b"], choices=schedule_names())
    parser.add_argument("--runs", nargs="*", default=None, help="only these runs (e.g. pipe-dualpipev fsdp2)")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode for every compiled run, the "
                        "plain one's too (e.g. max-autotune-no-cudagraphs)")
    parser.add_argument("--float8", default=None, choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                        help="the decoder layers' Linears in fp8 with this torchao recipe (see the docstring)")
    parser.add_argument("--profile", default=None, help="a folder: one more step of each run under torch.profiler "
                        "(bench/profiling.py writes hf-<run>.txt there)")
    parser.add_argument("--grad-accum-dtype", default=None, choices=["fp32"],
                        help="ds_config data_types.grad_accum_dtype of the deepspeed-S and pipezero-initialize runs "
                        "(bf16 gradients summed in fp32; default: in bf16, DeepSpeed's default)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.seq = args.seq or (2048 if cuda else 32)
    args.batch = args.batch or (4 if cuda else 2)
    world = args.nproc or (torch.cuda.device_count() if cuda else 2)
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
