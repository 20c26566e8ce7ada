"""What summing weight gradients inside their GEMM would save: one block's weight-gradient GEMMs, three ways.

    python bench/grad_fusion.py                  # CPU, a small shape
    python bench/grad_fusion.py --device cuda    # the 1.34B GPT's and TinyLlama's Linear shapes, bf16

For every Linear of one block (out x in, over `tokens` rows of one micro-batch), side by side:
  bf16-sum   the bf16 product dW = g^T x, then added into a bf16 bucket (what a bf16 model sums by default)
  fp32-sum   the same product added into an fp32 bucket (ZeroConfig(grad_accum_dtype=torch.float32) today)
  fused      the GEMM adds into the fp32 bucket itself (torch.addmm with out_dtype: bf16 inputs, fp32
             output, beta = 1: Megatron-LM's gradient-accumulation fusion; CUDA only)
Prints ms per micro-batch for the block's Linears and, for the whole model, the step's share
(layers x micro-batches), so the gain can be set against a measured step time.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_seconds  # bench/, beside this file

SHAPES = {  # name: (layers, micro-batches a step, tokens a micro-batch, [(out, in) of each Linear of a block])
    "gpt-1.34B": (24, 8, 8192, [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]),
    "llama-1.1B": (22, 4, 8192, [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048),
                                 (5632, 2048), (5632, 2048), (2048, 5632)]),
}


def _variants(device: torch.device) -> dict:
    def add_product(bucket, g, x):  # the bf16 product, then added into the bucket's dtype
        bucket.add_(g.t() @ x)

    def fused(bucket, g, x):
        torch.addmm(bucket, g.t(), x, out_dtype=torch.float32, out=bucket)

    out = {"bf16-sum": (torch.bfloat16, add_product), "fp32-sum": (torch.float32, add_product)}
    if device.type == "cuda":
        out["fused"] = (torch.float32, fused)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = SHAPES if device.type == "cuda" else {"small": (4, 4, 256, [(384, 128), (128, 512)])}
    dtype = torch.bfloat16
    print(f"weight-gradient GEMMs of one block per micro-batch, {device}, inputs {dtype}")
    print("| model | variant | ms per block per micro-batch | ms per step (all layers, all micro-batches) |")
    print("|---|---|---|---|")
    for name, (layers, micro, tokens, linears) in shapes.items():
        for variant, (bucket_dtype, fn) in _variants(device).items():
            work = [(torch.zeros(o, i, dtype=bucket_dtype, device=device),
                     torch.randn(tokens, o, dtype=dtype, device=device),
                     torch.randn(tokens, i, dtype=dtype, device=device)) for o, i in linears]
            ms = median_seconds(lambda: [fn(*w) for w in work], device, args.repeats, warmup=3) * 1e3
            print(f"| {name} | {variant} | {ms:.3f} | {ms * layers * micro:.1f} |")


if __name__ == "__main__":
    main()
