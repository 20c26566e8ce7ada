"""Long packed sequences: tokens/s and peak memory per length, pipezero beside a plain PyTorch loop.

    python bench/long_context.py                                  # CPU: finetune's tiny Llama, 2K..16K
    python bench/long_context.py --lengths 8192 16384 --runs pipezero
    python bench/long_context.py --shape tinyllama --lengths 32768 65536   # CUDA: TinyLlama's shape, bf16

One packed sequence per step (documents of 256..4,096 tokens end to end, positions restarting
per document), a training step each (forward, backward, AdamW), the same random-weight model:
  pipezero  hf_layer_specs(fused_loss=True) in a one-stage PipelineModule under PipelineRunner,
            as `pipezero finetune` builds it: packed documents attended each on its own (no [T, T]
            mask), the MLP in row tiles from 8K tokens, the head + loss in row chunks
  pipezero-full / pipezero-offload   the same with every layer checkpointed (recomputed in its
            backward), the second with the checkpointed inputs in pinned host memory
  torch     transformers' LlamaForCausalLM(sdpa) called with the packed position ids (transformers
            then builds the block-diagonal [T, T] mask), its logits and F.cross_entropy, AdamW
  torch-ckpt  the same with transformers' gradient_checkpointing_enable()
Both eager (pipezero's default compile is off here: a fresh process per length would recompile).
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
}


def _config(shape: str, length: int):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=length, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def _row(length: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions) [1, length]: documents of 256..4,096 tokens packed end to end."""
    gen = torch.Generator().manual_seed(0)
    positions, filled = [], 0
    while filled < length:
        n = min(int(torch.randint(256, 4097, (), generator=gen)), length - filled)
        positions.append(torch.arange(n))
        filled += n
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    return ids.to(device), torch.cat(positions)[None].to(device)


RUNS = ("pipezero", "pipezero-full", "pipezero-offload", "torch", "torch-ckpt")


def _pipezero_step(config, device, dtype, run="pipezero"):
    return pipezero_parts(config, device, dtype, run)[1]


def pipezero_parts(config, device, dtype, run="pipezero"):
    """(module, step) of a pipezero run (bench/live_tensors.py names the allocations by the module's layers)."""
    from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    recompute = RecomputeConfig(mode="none" if run == "pipezero" else "full", offload=run == "pipezero-offload")
    with torch.device(device):
        module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1),
                                loss_fn=causal_lm_loss, recompute=recompute, compile=False).to(dtype)
    runner = PipelineRunner(module, make_schedule("1f1b", 1))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step(ids, positions):
        runner.train_step((ids, None, positions), ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return module, step


def _torch_step(config, device, dtype, run="torch"):
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


def measure(run: str, shape: str, length: int, steps: int) -> dict:
    """One run at one length in this process: {tokens_per_s, peak_gb} or {error}."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = _config(shape, length)
    step = (_pipezero_step if run.startswith("pipezero") else _torch_step)(config, device, dtype, run)
    ids, positions = _row(length, config.vocab_size, device)
    try:
        step(ids, positions)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(ids, positions)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens_per_s": steps * length / elapsed, "peak_gb": peak / 2**30}


def _in_subprocess(run: str, shape: str, length: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", run, "--shape", shape, "--lengths", str(length),
           "--steps", str(steps)]
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
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.shape, args.lengths[0], args.steps)), flush=True)
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (fp32)"
    print(f"{args.shape} Llama on {device}, one packed sequence per step; peak: "
          f"{'max allocated' if torch.cuda.is_available() else 'max RSS of a fresh process'}")
    print(f"{'run':<16} {'length':>8} {'tokens/s':>10} {'peak GB':>9} {'x previous':>11}")
    for run in args.runs:
        previous = None
        for length in args.lengths:
            r = _in_subprocess(run, args.shape, length, args.steps)
            if "error" in r:
                print(f"{run:<16} {length:>8} {r['error']}", flush=True)
                previous = None
                continue
            ratio = f"{r['peak_gb'] / previous:.2f}x" if previous else ""
            print(f"{run:<16} {length:>8} {r['tokens_per_s']:>10.0f} {r['peak_gb']:>9.2f} {ratio:>11}", flush=True)
            previous = r["peak_gb"]


if __name__ == "__main__":
    main()
