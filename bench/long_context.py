"""Long packed sequences: tokens/s and peak memory per length, pipezero beside a plain PyTorch loop and ALST.

    python bench/long_context.py                                  # CPU: finetune's tiny Llama, 2K..16K
    python bench/long_context.py --lengths 8192 16384 --runs pipezero
    python bench/long_context.py --shape tinyllama --lengths 32768 65536   # CUDA: TinyLlama's shape, bf16
    python bench/long_context.py --shape tinyllama --lengths 32768 --runs pipezero-selective --profile prof
    python bench/long_context.py --shape llama3-8b --layers 8 --runs pipezero-offload alst --lengths 131072

One packed sequence per step (documents of 256..4,096 tokens end to end, positions restarting
per document), a training step each (forward, backward, AdamW), the same random-weight model:
  pipezero  hf_layer_specs(fused_loss=True) in a one-stage PipelineModule under PipelineRunner,
            as `pipezero finetune` builds it: packed documents attended each on its own (no [T, T]
            mask), the MLP in row tiles from 8K tokens, the head + loss in row chunks
  pipezero-whole  the same without the memory kit: the MLP and the norms whole at any length, no layer
            checkpointed (what the kit's cost is measured against)
  pipezero-full / pipezero-offload   the same with every layer checkpointed (recomputed in its
            backward), the second with the checkpointed inputs in pinned host memory
  pipezero-selective   every layer checkpointed selectively: the matmuls' and attention's outputs
            kept, the rest (norms, activations, rotary) recomputed
  torch     transformers' LlamaForCausalLM(sdpa) called with the packed position ids (transformers
            then builds the block-diagonal [T, T] mask), its logits and F.cross_entropy, AdamW
  torch-ckpt  the same with transformers' gradient_checkpointing_enable()
  alst      DeepSpeed 0.19.8's ALST at sequence degree 1 as its one-GPU recipe sets it: ZeRO-3, TiledMLP,
            TiledFusedLogitsLoss, every layer checkpointed with its input on the host
            (bench/long_context_alst.py; CUDA and deepspeed only, else the row says why)
pipezero's AdamW is fused on CUDA, its state in the weights' bf16 (no fp32 masters). With
--offload-optimizer (on by default for llama3-8b, whose fp32 AdamW state does not fit one GPU) the
optimizer steps on the host: pipezero through ZeroOptimizer(stage=1, offload_optimizer) with a fused
AdamW, alst through ZeRO-3's optimizer and parameter offload with DeepSpeed's CPU Adam. A run whose
host memory (fp32 masters and Adam state when offloaded, the offloaded layer inputs) would exceed what
the machine has available is refused with the numbers instead of started: the OOM killer would take
the whole job. `--layers N` keeps a shape's layer width and cuts its depth (llama3-8b's 32 layers need
~120 GiB of host memory for the offloaded optimizer alone). `--offload-layers N`: pipezero-offload
offloads the inputs of each forward's first N layers only (RecomputeConfig.offload_layers), the rest
stay on the GPU, for a machine whose host memory is short of all of them.
pipezero and torch are eager (pipezero's default compile is off here: a fresh process per length would
recompile); pipezero-*-compiled: the same run with PipelineModule(compile=True), its layers and loss
compiled (selective keeps its layers eager: pipe/memory/recompute.py's compiles_checkpointed); alst
attends through flash_attention_2 if installed, else flex_attention (compiled).
Each (run, length) is a fresh subprocess, so the peak is that run's alone: CPU, the process's
maximum resident set (getrusage; the interpreter and libraries included, ~0.4 GB); CUDA,
torch.cuda.max_memory_allocated. A run that does not fit prints "out of memory".
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

SHAPES = {  # finetune's default model (train/finetune.py default_config) and TinyLlama's shape
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}
_OFFLOADS_ACTIVATIONS = ("pipezero-offload", "alst")
_GIB = 2**30
_PROCESS_GIB = 6.0  # the interpreter, torch, the CUDA context and its pinned pools, on the host


def parameter_count(config) -> int:
    """A Llama config's parameters: embedding and head (untied), the layers, the final norm."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv = config.num_key_value_heads * (h // heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size + 2 * h
    return 2 * config.vocab_size * h + config.num_hidden_layers * layer + h


def host_need(run: str, config, length: int, offload_optimizer: bool,
              cuda: bool = True, offload_layers: int | None = None) -> tuple[float, str]:
    """(GiB, how it adds up) of host memory one (run, length) takes: the offloaded optimizer (pipezero:
    fp32 masters, Adam's two moments and the fp32 gradient landing buffers, 16 B/param; ALST's ZeRO-3
    offload adds the bf16 parameters, 18 B/param), the offloaded layer inputs (inputs x length x hidden
    bf16: ALST's decoder layers'; pipezero's as the planner counts them, train/plan/memory.py, checked
    against the runtime's: the decoder layers' and the final norm's and the fused head's brief copy, or
    with offload_layers those among the pipeline's first N layers, the embedding's token ids the first),
    and the process itself. Without CUDA everything is on the host: fp32 weights, gradients and Adam,
    16 B/param, at the least."""
    parts, total = [], _PROCESS_GIB
    if not cuda:
        gib = parameter_count(config) * 16 / _GIB
        parts.append(f"fp32 training state {parameter_count(config) / 1e9:.2f}B params x 16 B = {gib:.1f} GiB")
        total += gib
    elif offload_optimizer and (run.startswith("pipezero") or run == "alst"):
        per = 18 if run == "alst" else 16
        gib = parameter_count(config) * per / _GIB
        parts.append(f"optimizer {parameter_count(config) / 1e9:.2f}B params x {per} B = {gib:.1f} GiB")
        total += gib
    if run.removesuffix("-compiled") in _OFFLOADS_ACTIVATIONS:
        inputs = config.num_hidden_layers if run == "alst" else offloaded_inputs(config, length, offload_layers)
        gib = inputs * length * config.hidden_size * 2 / _GIB
        parts.append(f"layer inputs {inputs} x {length:,} x {config.hidden_size} x 2 B = {gib:.1f} GiB")
        total += gib
    return total, " + ".join(parts + [f"{_PROCESS_GIB:.0f} GiB for the process"])


def offloaded_inputs(config, length: int, offload_layers: int | None) -> int:
    """The [length, hidden] inputs a one-stage pipezero-offload run holds on the host at once (the planner's
    count, train/plan/memory.py's host_bytes)."""
    from pipezero.train.plan.hardware import h100
    from pipezero.train.plan.layout import Layout
    from pipezero.train.plan.memory import host_bytes, pinned
    from pipezero.train.plan.model import ModelShape, flops_profile

    shape = ModelShape.from_hf_config(config, length)
    profile = flops_profile(shape, 1.0)
    layout = Layout(1, 1, 1, "1f1b", 1, 1, 1, 0, False, 1, host_inputs=True, host_layers=offload_layers)
    held = host_bytes(profile, range(len(profile)), 1.0, layout, h100(1, 1), "bf16", shape.d_model, length).inputs
    return round(held / pinned(length * config.hidden_size * 2))


def host_available_gib() -> float:
    """MemAvailable of /proc/meminfo (inf where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return float("inf")
    return int(fields["MemAvailable"].split()[0]) * 1024 / _GIB


def host_refusal(run: str, config, length: int, offload_optimizer: bool, available: float,
                 cuda: bool = True, offload_layers: int | None = None) -> str | None:
    """The message that refuses a run whose host memory would exceed `available` GiB, or None."""
    need, parts = host_need(run, config, length, offload_optimizer, cuda, offload_layers)
    if need <= available:
        return None
    return (f"refused: needs ~{need:.0f} GiB of host memory ({parts}), {available:.0f} GiB available; "
            "try shorter --lengths or fewer --layers")


def _config(shape: str, length: int, layers: int | None = None):
    from transformers import LlamaConfig

    dims = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    return LlamaConfig(**dims, max_position_embeddings=length, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def packed_positions(length: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Position ids [1, length] of documents of 256..4,096 tokens packed end to end (restarting at each)."""
    gen = gen or torch.Generator().manual_seed(0)
    positions, filled = [], 0
    while filled < length:
        n = min(int(torch.randint(256, 4097, (), generator=gen)), length - filled)
        positions.append(torch.arange(n))
        filled += n
    return torch.cat(positions)[None]


def _row(length: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions) [1, length]: packed_positions' documents, random ids."""
    gen = torch.Generator().manual_seed(0)
    positions = packed_positions(length, gen)
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    return ids.to(device), positions.to(device)


WARM_ROW = 4096  # --steps 0: the tokens of the step before the timed one
_PIPEZERO = ("pipezero", "pipezero-whole", "pipezero-full", "pipezero-selective", "pipezero-offload")
RUNS = (*_PIPEZERO, *(f"{run}-compiled" for run in _PIPEZERO), "torch", "torch-ckpt", "alst")


def _pipezero_step(config, device, dtype, run="pipezero", offload_optimizer=False, offload_layers=None):
    return pipezero_parts(config, device, dtype, run, offload_optimizer, offload_layers)[1]


def pipezero_parts(config, device, dtype, run="pipezero", offload_optimizer=False, offload_layers=None):
    """(module, step) of a pipezero run (bench/live_tensors.py names the allocations by the module's layers)."""
    from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    kind = run.removesuffix("-compiled")
    mode = {"pipezero": "none", "pipezero-whole": "none", "pipezero-selective": "selective"}.get(kind, "full")
    if kind == "pipezero-whole":  # the kit off: the MLP and the norms whole at any length (a fresh process)
        from pipezero.pipe import tiled_mlp

        tiled_mlp.TILE_FROM_ROWS = tiled_mlp.NORM_TILE_FROM_ROWS = sys.maxsize
    offload = kind == "pipezero-offload"
    recompute = RecomputeConfig(mode=mode, offload=offload, offload_layers=offload_layers if offload else None)
    with torch.device(device):
        module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1),
                                loss_fn=causal_lm_loss, recompute=recompute,
                                compile=run.endswith("-compiled")).to(dtype)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=offload_optimizer or device.type == "cuda" or None)
    if offload_optimizer:  # fp32 masters and Adam on the host; the fused CPU AdamW steps them
        from pipezero.zero import ZeroConfig, ZeroOptimizer

        opt = ZeroOptimizer(opt, module=module, config=ZeroConfig(stage=1, offload_optimizer=True))
    runner = PipelineRunner(module, make_schedule("1f1b", 1), optimizer=opt)

    def step(ids, positions):
        runner.train_step((ids, None, positions), ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return module, step


def _torch_step(config, device, dtype, run="torch", offload_optimizer=False):
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    if run == "torch-ckpt":
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids, positions):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _alst_step(config, device, dtype, run="alst", offload_optimizer=False):
    from long_context_alst import alst_step

    return alst_step(config, device, offload_optimizer)


def measure(run: str, shape: str, length: int, steps: int, layers: int | None = None,
            offload_optimizer: bool = False, profile: str | None = None, offload_layers: int | None = None) -> dict:
    """One run at one length in this process: {tokens_per_s, peak_gb} or {error}; with `profile` (a folder)
    one more step under torch.profiler after the timed ones, its table in <profile>/<run>-<length>.txt."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = _config(shape, length, layers)
    if run == "alst":
        from long_context_alst import unavailable

        if reason := unavailable():
            return {"error": reason}
    build = _alst_step if run == "alst" else _pipezero_step if run.startswith("pipezero") else _torch_step
    extra = {"offload_layers": offload_layers} if build is _pipezero_step else {}
    step = build(config, device, dtype, run, offload_optimizer, **extra)
    ids, positions = _row(length, config.vocab_size, device)
    try:
        # the warm-up: --steps 0 (a row too long to run twice) warms up on a short row, which makes the
        # optimizer's state all the same, then times one step of the long row
        warm = _row(min(length, WARM_ROW), config.vocab_size, device) if steps == 0 else (ids, positions)
        _timed(step, *warm, cuda)
        timed = [_timed(step, ids, positions, cuda) for _ in range(max(steps, 1))]
        peak = (torch.cuda.max_memory_allocated() if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if profile:
            from profiling import profiled

            with profiled(profile, f"{run}-{length}"):
                step(ids, positions)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    seconds = sum(timed)
    return {"tokens_per_s": max(steps, 1) * length / seconds, "peak_gb": peak / 2**30}


def _timed(step, ids: torch.Tensor, positions: torch.Tensor, cuda: bool) -> float:
    start = time.perf_counter()
    step(ids, positions)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _in_subprocess(run: str, shape: str, length: int, steps: int, layers: int | None, offload: bool,
                   profile: str | None = None, offload_layers: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", run, "--shape", shape, "--lengths", str(length),
           "--steps", str(steps), "--offload-optimizer", "on" if offload else "off"]
    cmd += ["--layers", str(layers)] if layers else []
    cmd += ["--profile", profile] if profile else []
    cmd += ["--offload-layers", str(offload_layers)] if offload_layers else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        killed = done.returncode in (-9, 137)
        return {"error": "out of memory" if killed else (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--runs", nargs="+", default=["pipezero", "torch"], choices=RUNS)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step (0: one timed step "
                   f"after a warm-up step of {WARM_ROW} tokens, for rows too long to run twice)")
    p.add_argument("--layers", type=int, default=None, help="the shape's depth cut to N layers (same width)")
    p.add_argument("--offload-optimizer", default="auto", choices=("auto", "on", "off"),
                   help="AdamW state on the host (auto: on for llama3-8b)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="one more step of each (run, length) under torch.profiler, untimed: DIR/<run>-<length>.txt "
                   "(wall against the kernels' time: the GPU waiting on the host; the top ops)")
    p.add_argument("--offload-layers", type=int, default=None, metavar="N",
                   help="pipezero-offload: only each forward's first N layers offload their inputs, the rest "
                   "keep them on the GPU (RecomputeConfig.offload_layers; default: all)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    auto = args.offload_optimizer == "auto"
    offload = args.offload_optimizer == "on" or (auto and args.shape == "llama3-8b")
    if args.worker:
        r = measure(args.worker, args.shape, args.lengths[0], args.steps, args.layers, offload, args.profile,
                    args.offload_layers)
        print(json.dumps(r), flush=True)
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (fp32)"
    depth = f", {args.layers} layers" if args.layers else ""
    print(f"{args.shape} Llama{depth} on {device}, one packed sequence per step; optimizer on the "
          f"{'host' if offload else 'device'}; peak: "
          f"{'max allocated' if torch.cuda.is_available() else 'max RSS of a fresh process'}")
    print(f"{'run':<28} {'length':>8} {'tokens/s':>10} {'peak GB':>9} {'x previous':>11}")
    available = host_available_gib()
    for run in args.runs:
        previous = None
        for length in args.lengths:
            config = _config(args.shape, length, args.layers)
            refusal = host_refusal(run, config, length, offload, available, torch.cuda.is_available(),
                                   args.offload_layers)
            r = {"error": refusal} if refusal else _in_subprocess(run, args.shape, length, args.steps,
                                                                   args.layers, offload, args.profile,
                                                                   args.offload_layers)
            if "error" in r:
                print(f"{run:<28} {length:>8} {r['error']}", flush=True)
                previous = None
                continue
            ratio = f"{r['peak_gb'] / previous:.2f}x" if previous else ""
            print(f"{run:<28} {length:>8} {r['tokens_per_s']:>10.0f} {r['peak_gb']:>9.2f} {ratio:>11}", flush=True)
            previous = r["peak_gb"]


if __name__ == "__main__":
    main()
