"""Mixture-of-experts training on one GPU: pipezero beside transformers' experts and torchtitan's MoE.

    python bench/moe.py --tiny                  # CPU, fp32: a tiny Qwen3-MoE, every runner, seconds
    python bench/moe.py                         # CUDA, bf16: Qwen3-30B-A3B's layer shape, 8 of its 48 layers
    python bench/moe.py --runs pipezero hf-grouped_mm-compiled --layers 6 --batch 4 --seq 2048
    python bench/moe.py --runs pipezero-compiled hf-grouped_mm-compiled --explain /tmp/why  # the peak by place

The model: Qwen3-30B-A3B's shape per layer (hidden 2048, 32 query / 4 key-value heads of 128,
128 experts of 768, top 8, vocab 151,936, untied head), random weights, nothing downloaded; one
H100 holds 8 of its 48 layers with bf16 weights, gradients and AdamW state (--layers), so the
head's share of the FLOPs is larger than in the whole model. Each runner trains the same tokens
(--batch x --seq, every position a target but each row's last) for a step of forward, backward
and AdamW (fused on CUDA; no fp32 master copy anywhere), --warmup steps then --steps timed:
  pipezero       hf_layer_specs(experts="grouped_mm", fused_loss=True) in a one-stage
                 PipelineModule under PipelineRunner, config.output_router_logits=True (the
                 load-balancing loss through pipe/hf/router.py), as `pipezero finetune` builds it
  pipezero-compiled  the same with PipelineModule(compile=...): each decoder layer compiled
  hf-<impl>      transformers' Qwen3MoeForCausalLM with experts_implementation=<impl> (grouped_mm,
                 batched_mm, eager: the loop over experts, sonicmoe, deepgemm; the last two need
                 Hub kernels), output_router_logits=True, its own loss; -compiled: each decoder
                 layer torch.compile'd (`layer.compile()`)
  torchtitan     torchtitan's Qwen3 MoE (its 30B-A3B layer builder, flex attention, grouped_mm
                 experts, its bias-based balancing in the forward; the bias update between steps
                 is not run), bf16, torchtitan's cross_entropy_loss per valid token;
                 -compiled: torchtitan's apply_compile (each block, fullgraph)
pipezero and the hf-* runners start from the same weights (one seeded transformers model; pipezero
copies it by name), so their first losses agree. Each runner is a fresh subprocess on CUDA (its
peak is its own: torch.cuda.max_memory_allocated from the first step on); --tiny runs them all in
one process (a smoke of every path; no memory column). A runner that cannot run prints why.
MFU: (6 x active parameters x tokens + 12 x layers x heads x head_dim x seq x tokens) per step
over 989 TFLOP/s (H100 / H200 SXM dense bf16); active = all but the embedding and the experts a
token is not routed to. The last column: tokens/s over hf-grouped_mm-compiled's in the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import torch

PEAK_FLOPS = 989e12
LR = 1e-4
BASELINE = "hf-grouped_mm-compiled"
HF_EXPERTS = ("grouped_mm", "batched_mm", "eager", "sonicmoe", "deepgemm")
SHAPES = {  # Qwen3-30B-A3B's config.json (48 layers), and a tiny one for the CPU smoke
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, vocab_size=151936, num_hidden_layers=8),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=256,
                 num_hidden_layers=2),
}
RUNS = ("pipezero", "pipezero-compiled", *(f"hf-{e}{c}" for e in HF_EXPERTS for c in ("", "-compiled")),
        "torchtitan", "torchtitan-compiled")
DEFAULT_RUNS = ("pipezero", "pipezero-compiled", "hf-grouped_mm", "hf-grouped_mm-compiled", "hf-batched_mm",
                "hf-eager", "hf-sonicmoe", "hf-deepgemm", "torchtitan", "torchtitan-compiled")


def qwen3_moe_config(args) -> Any:
    from transformers import Qwen3MoeConfig

    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    return Qwen3MoeConfig(**shape, max_position_embeddings=max(args.seq, 64), norm_topk_prob=True,
                          output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False,
                          rope_theta=1e6, rms_norm_eps=1e-6, use_cache=False, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None)


def _batch(args, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) [batch, seq]: the targets are the ids shifted left, the last position ignored."""
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return ids.to(device), targets.to(device)


def _adamw(params, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=device.type == "cuda")


def _hf_model(config, experts: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model, the same seeded weights for every runner that starts from it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=experts)
    return model.train()


def _free(model: torch.nn.Module) -> None:
    """Give back a source model's memory: the specs built from it keep its state_dict by reference
    for the module's life (pipe/hf/weights.py's ModelTensors), while the module trains copies."""
    for tensor in model.state_dict().values():
        tensor.untyped_storage().resize_(0)


# -- the runners: each returns step(ids, targets) -> loss ------------------------------------
def _pipezero(config, device, dtype, compiled: bool, backend: str) -> Callable:
    from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.topology import Grid

    source = _hf_model(config, "grouped_mm", device, dtype)
    specs = hf_layer_specs(source, fused_loss=True, experts="grouped_mm")
    with device:
        module = PipelineModule(specs, grid=Grid(pipe=1), loss_fn=causal_lm_loss, device=device,
                                compile=CompileConfig(backend=backend) if compiled else False).to(dtype)
    _free(source)
    runner = PipelineRunner(module, make_schedule("1f1b", 1))
    opt = _adamw(module.parameters(), device)

    def step(ids, targets):
        loss = runner.train_step(ids, targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _hf(config, device, dtype, experts: str, compiled: bool, backend: str) -> Callable:
    model = _hf_model(config, experts, device, dtype)
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend=backend)
    opt = _adamw(model.parameters(), device)

    def step(ids, targets):
        loss = model(input_ids=ids, labels=ids).loss  # the cross-entropy + coef x the balancing loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _torchtitan_model(config, seq: int) -> Any:
    """torchtitan's Qwen3 MoE config with our shape, built by its 30B-A3B layer builder."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers,
                                         _qwen3_norm)

    dim, head_dim, vocab = config.hidden_size, config.head_dim, config.vocab_size
    layers = _build_qwen3_moe_layers(
        n_layers=config.num_hidden_layers, dim=dim, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, head_dim=head_dim, moe_hidden_dim=config.moe_intermediate_size,
        num_experts=config.num_experts, top_k=config.num_experts_per_tok, attn_backend="flex",
        moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1e6))
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT))


def _torchtitan(config, device, dtype, compiled: bool, backend: str, seq: int) -> Callable:
    from torchtitan.components.loss import cross_entropy_loss

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as torchtitan's training.dtype="bfloat16" builds it
    try:
        with torch.device("meta"):
            model = _torchtitan_model(config, seq).build()
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if compiled:
        from torchtitan.config import CompileConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.compile import apply_compile

        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=dims)
    opt = _adamw(model.parameters(), device)

    def step(ids, targets):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # one document a row
        masks = model.get_attention_masks(positions=positions)
        logits = model(ids, positions=positions, attention_masks=masks)
        loss = cross_entropy_loss(logits, targets) / (targets != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def build(run: str, config, device: torch.device, dtype: torch.dtype, args) -> Callable:
    compiled, name = run.endswith("-compiled"), run.removesuffix("-compiled")
    if name == "pipezero":
        return _pipezero(config, device, dtype, compiled, args.backend)
    if name == "torchtitan":
        return _torchtitan(config, device, dtype, compiled, args.backend, args.seq)
    return _hf(config, device, dtype, name.removeprefix("hf-"), compiled, args.backend)


# -- measuring ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _failure(err: BaseException) -> str:
    if isinstance(err, torch.OutOfMemoryError):
        return "out of memory"
    text = str(err).strip()
    if "raised exception " in text:  # torch.compile re-raises the eager error inside its own message
        return text.split("raised exception ", 1)[1].splitlines()[0][:300]
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def measure(run: str, args) -> dict:
    """One runner in this process: {ms, loss, peak_gib} or {error}."""
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = qwen3_moe_config(args)
    try:
        step = build(run, config, device, dtype, args)
        ids, targets = _batch(args, config.vocab_size, device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        first = float(step(ids, targets))  # warm-up (compiles)
        for _ in range(args.warmup - 1):
            step(ids, targets)
        _sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step(ids, targets)
        _sync(device)
        seconds = (time.perf_counter() - start) / args.steps
    except Exception as err:  # noqa: BLE001 - a runner that cannot run says why; the others still run
        return {"error": _failure(err)}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    result = {"ms": seconds * 1e3, "loss": first, "peak_gib": peak}
    try:
        explain(run, step, ids, targets, args.explain)
    except Exception as err:  # noqa: BLE001 - the measurement stands; say why the explanation is missing
        result["explain"] = _failure(err)
    return result


def explain(run: str, step: Callable, ids: torch.Tensor, targets: torch.Tensor, folder: str | None) -> None:
    """--explain: two more steps, one under the allocator's history (what is alive at the peak, by place:
    bench/memory_history.py), one under torch.profiler (the kernels by GPU time: bench/profiling.py)."""
    if not folder:
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory_history import peak_history
    from profiling import profiled

    with peak_history(folder, run):
        step(ids, targets)
    with profiled(folder, run):
        step(ids, targets)


def _in_subprocess(run: str, argv: list[str], timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # every runner alike
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: a Hub kernel's runner fails at once
    try:
        done = subprocess.run([sys.executable, __file__, *argv, "--worker", run], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {run: {"error": f"timed out after {timeout:.0f} s"}}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        killed = done.returncode in (-9, 137)
        return {run: {"error": "killed (host memory?)" if killed else
                      (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}}
    return json.loads(lines[-1])


def active_parameters(config) -> tuple[int, int]:
    """(all parameters, those one token's forward uses but the embedding: its top-k experts only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = experts * (1 - config.num_experts_per_tok / config.num_experts)
    return total, int(total - model.get_input_embeddings().weight.numel() - idle)


def step_flops(config, args) -> float:
    tokens = args.batch * args.seq
    _, active = active_parameters(config)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * args.seq
    return (6 * active + attention) * tokens


def _row(run: str, r: dict, args, flops: float, base: float | None) -> str:
    if "error" in r:
        return f"| {run} | {r['error']} | | | | | |"
    tokens_s = args.batch * args.seq / (r["ms"] / 1e3)
    mfu = f"{flops / (r['ms'] / 1e3) / PEAK_FLOPS:.1%}" if not args.tiny else "-"
    peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
    ratio = f"{tokens_s / base:.2f}x" if base else "-"
    return f"| {run} | {tokens_s:,.0f} | {r['ms']:.0f} | {peak} | {mfu} | {ratio} | {r['loss']:.4f} |"


def table(results: dict, args, config) -> list[str]:
    flops, (total, active) = step_flops(config, args), active_parameters(config)
    base = results.get(BASELINE, {})
    base_tokens = args.batch * args.seq / (base["ms"] / 1e3) if "ms" in base else None
    device = "CPU (fp32)" if args.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name()
    lines = [f"Qwen3-MoE {config.num_hidden_layers} x {config.hidden_size}, {config.num_experts} experts top "
             f"{config.num_experts_per_tok} ({total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active), "
             f"{args.batch} x {args.seq} tokens per step, {device}",
             f"| run | tokens/s | step ms | peak GiB | MFU | x {BASELINE} | first loss |",
             "|---|---|---|---|---|---|---|"]
    return lines + [_row(run, r, args, flops, base_tokens) for run, r in results.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU, a tiny model, every runner in one process")
    p.add_argument("--runs", nargs="+", default=None, help=f"one GPU: {' '.join(RUNS)}; with --nproc: "
                   "expert, expert-overlap, dense, dualpipev, 1f1b, torchtitan, each also -compiled "
                   "(bench/moe_multi.py)")
    p.add_argument("--nproc", type=int, default=None, help="N processes, one a GPU (--tiny: gloo on CPU): expert "
                   "parallel N beside data parallel, torchtitan and pipe 2 (bench/moe_multi.py)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="with --nproc: one-row microbatches a rank at pipe 1 (default 4; --tiny 2)")
    p.add_argument("--checkpoint", choices=["auto", "none", "full"], default="auto", help="with --nproc: "
                   "activation checkpointing of pipezero's layers (auto: where the planner says it does not fit)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --tiny 2)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default 4; --tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 2048; --tiny 32)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the compiled runs compile)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --tiny 1)")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend (default inductor; --tiny aot_eager)")
    p.add_argument("--explain", default=None, help="a folder: after the timed steps, each runner's peak by "
                   "place (<run>-peak.txt, CUDA) and its kernels by GPU time (<run>.txt)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a runner's process may take")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.nproc:
        _multi(p, args)
        return
    if args.runs and set(args.runs) - set(RUNS):
        p.error(f"--runs {' '.join(sorted(set(args.runs) - set(RUNS)))}: not a one-GPU run ({', '.join(RUNS)}); "
                "the expert-parallel runs need --nproc N")
    args.shape = "tiny" if args.tiny else "qwen3-30b-a3b"
    args.batch, args.seq = args.batch or (2 if args.tiny else 4), args.seq or (32 if args.tiny else 2048)
    args.steps = args.steps or (1 if args.tiny else 5)
    args.warmup = 1 if args.tiny else max(1, args.warmup)
    args.backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    runs = args.runs or list(DEFAULT_RUNS)
    if not args.tiny and not args.worker and not torch.cuda.is_available():
        sys.exit("bench/moe.py: the Qwen3-30B-A3B-shaped model needs a CUDA GPU (5.6B parameters at 8 "
                 "layers); on CPU run `python bench/moe.py --tiny`")
    if args.worker:  # one or more runners in this process, one JSON line
        print(json.dumps({run: measure(run, args) for run in args.worker.split(",")}), flush=True)
        return
    argv = sys.argv[1:]
    if args.tiny:
        results = _in_subprocess(",".join(runs), argv, args.timeout)
        if len(results) == 1 and len(runs) > 1:  # the process itself failed
            results = {run: next(iter(results.values())) for run in runs}
    else:
        results = {}
        for run in runs:
            results.update(_in_subprocess(run, argv, args.timeout))
            print(f"{run}: {results[run]}", flush=True)
    print("\n".join(table(results, args, qwen3_moe_config(args))), flush=True)


def _multi(p: argparse.ArgumentParser, args) -> None:
    """--nproc N: bench/moe_multi.py's runs, with its defaults sized to the machine."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # a script's folder, for the ranks too
    import moe_multi

    if args.nproc < 2 or args.batch:
        p.error(f"--nproc {args.nproc}{' --batch' if args.batch else ''}: the expert-parallel runs take 2 or more "
                "processes, and one row a microbatch (give --microbatches, not --batch)")
    if args.runs and set(args.runs) - set(moe_multi.MULTI_RUNS):
        p.error(f"--runs {' '.join(sorted(set(args.runs) - set(moe_multi.MULTI_RUNS)))} with --nproc: expected "
                f"some of {', '.join(moe_multi.MULTI_RUNS)}")
    if not args.tiny and not args.worker and torch.cuda.device_count() < args.nproc:
        sys.exit(f"bench/moe.py --nproc {args.nproc}: {torch.cuda.device_count()} CUDA GPUs here; on CPU run "
                 f"`python bench/moe.py --nproc {args.nproc} --tiny`")
    args.shape = "tiny" if args.tiny else "qwen3-30b-a3b"
    args.seq = args.seq or (32 if args.tiny else 4096)
    args.microbatches = args.microbatches or (2 if args.tiny else 4)
    if not args.tiny and not args.layers:  # sized to the machine: 48 on 8 GPUs, the whole model
        args.layers = moe_multi.fitting_layers(args, args.nproc)
        sys.argv += ["--layers", str(args.layers)]  # the runs' processes take the same
    args.steps = args.steps or (1 if args.tiny else 3)
    args.warmup = 1 if args.tiny else max(1, args.warmup)
    args.backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    moe_multi.main(args, sys.argv[1:])


if __name__ == "__main__":
    main()
