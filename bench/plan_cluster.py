"""The planner past this machine: best layouts of GPT-style 1.3B, 7B and 70B models on 8-4096 H200s.

    python bench/plan_cluster.py              # a markdown table, every row (about a minute)
    python bench/plan_cluster.py 512 4096     # only these GPU counts

Everything is modelled, nothing measured: layer time = training FLOPs / (989 TFLOP/s x
efficiency 0.55, i.e. 544 TFLOP/s achieved in every layer), 141 GB per GPU of which 2 GB
reserved, 8 GPUs per node on NVLink (450 GB/s per direction, 3 us), one 400 Gb/s NIC per GPU
between nodes (50 GB/s, 8 us), a 30 us launch overhead per layer action, Adam at 98 bytes per
parameter at 3.2 TB/s (what one H200 stepped), offloaded Adam at 1 ns per parameter plus PCIe at 25 GB/s
(train/plan/hardware.py). Global batch: the model's own (1.3B: 512 x 2048 tokens = 1M, as GPT-3 XL;
7B and 70B: 1024 x 4096 = 4M, as Llama 2) or 1024 tokens per GPU, whichever is larger (Llama 3
405B: 16M tokens on 16K GPUs), so the 8-512 GPU rows are strong scaling and 1.3B at 4096
GPUs gets 4M tokens; micro-batches of 1 or 2 sequences. Each row is the planner's first pick
with plan(top=TOP) (branch and bound: plan() docstring). Scaling efficiency = tokens/s per
GPU over the same at 8 GPUs.
"""

from __future__ import annotations

import sys
import time

from pipezero.train.plan import plan
from pipezero.train.plan.hardware import h200
from pipezero.train.plan.model import ModelShape, flops_profile, total_params

MODELS = [  # (shape, the model's own global batch in sequences)
    (ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304, name="1.3B"), 512),
    (ModelShape(layers=32, d_model=4096, heads=32, seq_len=4096, vocab=32000, name="7B"), 1024),
    (ModelShape(layers=80, d_model=8192, heads=64, seq_len=4096, vocab=32000, name="70B"), 1024),
]
GPUS = (8, 64, 512, 4096)
TOP = 5
TOKENS_PER_GPU = 1024


def global_batch(shape: ModelShape, own: int, gpus: int) -> int:
    """Sequences per step: the model's own batch, or TOKENS_PER_GPU per GPU when that is more."""
    return max(own, gpus * TOKENS_PER_GPU // shape.seq_len)


def main(argv: list[str] | None = None) -> None:
    gpus = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or list(GPUS)
    print("| model | GPUs | batch (tokens) | best layout | tokens/s | per GPU | MFU | memory GB | step s | bubble | "
          "exposed comm | scaling eff. | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for n in gpus:  # every model at one count before the next count: the small counts come first
        for shape, own in MODELS:
            hw = h200(nodes=max(1, n // 8), gpus_per_node=min(8, n))
            profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
            batch = global_batch(shape, own, n)
            start = time.perf_counter()
            best = plan(shape, profile, hw, batch, "bf16", top=TOP, microbatch_sizes=(1, 2))[0]
            per_gpu = best.tokens_per_second / n
            base.setdefault(shape.name, per_gpu)
            print(f"| {shape.name} ({total_params(profile) / 1e9:.2f}B) | {n} | {batch * shape.seq_len / 2**20:g}M | "
                  f"{best.layout.label} | {best.tokens_per_second:,.0f} | {per_gpu:,.0f} | {best.mfu:.1%} | "
                  f"{best.memory.total / 1e9:.1f} | {best.time.total:.3g} | {best.time.bubble:.1%} | "
                  f"{best.time.exposed_comm / best.time.total:.1%} | {per_gpu / base[shape.name]:.0%} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
