"""LoRA fine-tuning on one device: pipezero's adapters beside peft + a plain PyTorch loop.

    python bench/lora.py                      # CPU smoke: a tiny Llama, seconds
    python bench/lora.py --device cuda        # one GPU: a Llama-3-8B-shaped model, bf16 base, rank 16

The same transformers Llama (random weights from a config; nothing downloaded), the same
tokens per step, one run after the other in one process:
  pipezero   hf_layer_specs + lora_specs (rank 16 on q/k/v/o and gate/up/down, bf16 base, fp32
             adapters) in a one-stage PipelineModule, `--accum` micro-batches per step
             (OneFOneB over one stage), ZeroOptimizer(AdamW) on the adapters only; the head
             never makes the fp32 logits whole (hf_layer_specs(fused_loss=True)) unless --no-fused-loss
  peft       peft.get_peft_model on AutoModelForCausalLM.from_config (bf16 base, fp32 adapters: peft's
             default autocast_adapter_dtype), torch.optim.AdamW on its trainable parameters, a plain loop
             over the same micro-batches (loss / accum, backward, step)
Prints ms per step, tokens/s and (CUDA) peak allocated memory. `--recompute` turns on activation
checkpointing in both (per decoder layer). A full fine-tune of the 8B shape needs 16 bytes a
parameter (~128 GB) before activations, more than one H200 holds; both LoRA runs fit.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import finish_rank, init_rank  # noqa: E402

from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402
from pipezero.pipe.lora import LoraConfig, lora_specs, trainable_parameters  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402

LR = 1e-4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(args) -> Any:
    """Llama 3 8B's shape on CUDA (layers from --layers), a tiny Llama on CPU."""
    from transformers import LlamaConfig

    if args.device == "cuda":
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=args.layers or 32, num_attention_heads=32, num_key_value_heads=8,
                           max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers or 2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _lora(args) -> LoraConfig:
    base = torch.bfloat16 if args.device == "cuda" else None
    return LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, base_dtype=base)


def _pipezero(args, cfg, device: torch.device) -> Callable[[list], None]:
    specs = lora_specs(hf_layer_specs(cfg, fused_loss=args.fused_loss), _lora(args))
    model = PipelineModule(specs, grid=Grid(pipe=1), loss_fn=causal_lm_loss, device=device,
                           activation_checkpoint_interval=1 if args.recompute else 0)
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model), lr=LR), stage=0)
    runner = PipelineRunner(model, OneFOneB(num_microbatches=args.accum), optimizer=opt)

    def step(batches: list) -> None:
        ids = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        runner.train_step(ids, targets)
        opt.step()
        opt.zero_grad()
    return step


def _peft(args, cfg, device: torch.device) -> Callable[[list], None]:
    import peft
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if args.recompute:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = _lora(args)
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha,
                                                      target_modules=list(TARGETS)))
    if args.recompute:
        model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step(batches: list) -> None:
        for ids, targets in batches:
            loss = causal_lm_loss(model(ids).logits, targets) / len(batches)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


RUNS = {"pipezero": _pipezero, "peft": _peft}


def _batches(args, vocab: int, device: torch.device) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device),
             torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)) for _ in range(args.accum)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args, cfg, device: torch.device) -> tuple[float, float]:
    """(median seconds per step after 2 warm-up steps, peak MiB allocated on CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step, batches = RUNS[name](args, cfg, device), _batches(args, cfg.vocab_size, device)
    times = []
    for _ in range(args.steps + 2):
        _sync(device)
        start = time.perf_counter()
        step(batches)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    del step, batches
    gc.collect()
    return statistics.median(times[2:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32 on CUDA, 2 on CPU)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (lora_alpha = 2r)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 CUDA, 32 CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 2 CUDA, 2 CPU)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 2 warm-up steps")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing per decoder layer")
    parser.add_argument("--no-fused-loss", dest="fused_loss", action="store_false")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--port", type=int, default=29737)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.seq = args.seq or (2048 if cuda else 32)
    args.batch = args.batch or 2
    device = init_rank(0, 1, args.port, args.device)
    cfg = config(args)
    results = {name: measure(name, args, cfg, device) for name in args.runs}
    tokens = args.batch * args.seq * args.accum
    print(f"Llama {cfg.num_hidden_layers}x{cfg.hidden_size}, LoRA r={args.rank} on {', '.join(TARGETS)}, "
          f"{tokens} tokens/step, {args.device}{', recompute' if args.recompute else ''}")
    print("| run | ms/step | tokens/s | peak MiB |")
    print("|---|---|---|---|")
    for name, (sec, peak) in results.items():
        print(f"| {name} | {sec * 1e3:.0f} | {tokens / sec:,.0f} | {peak:,.0f} |")
    if dist.is_initialized():
        finish_rank()


if __name__ == "__main__":
    main()
