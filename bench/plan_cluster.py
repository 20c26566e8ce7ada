"""The planner past this machine: best layouts of GPT-style 1.3B, 7B and 70B models on 8-4096 H200s.

    python bench/plan_cluster.py            # a markdown table (minutes on a busy 2-core CPU)

Everything is modelled, nothing measured: layer time = training FLOPs / (989 TFLOP/s x
efficiency 0.55), 141 GB per GPU of which 2 GB reserved, 8 GPUs per node on NVLink
(450 GB/s per direction, 3 us), one 400 Gb/s NIC per GPU between nodes (50 GB/s, 8 us),
a 30 us launch overhead per layer action, Adam at 36 bytes per parameter over 4.8 TB/s,
offloaded Adam at 1 ns per parameter plus PCIe at 25 GB/s (plan_hardware.py). The global
batch is fixed per model (1.3B: 512 x 2048 tokens = 1M, as GPT-3 XL; 7B and 70B: 1024 x
4096 = 4M, as Llama 2), so the larger counts show strong scaling; micro-batches of 1 or 2
sequences. Scaling efficiency =
tokens/s per GPU over the same at 8 GPUs.
"""

from __future__ import annotations

import sys
import time

from pipezero.train.plan import plan
from pipezero.train.plan_hardware import h200
from pipezero.train.plan_model import ModelShape, flops_profile, total_params

MODELS = [  # (shape, global batch in sequences)
    (ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304, name="1.3B"), 512),
    (ModelShape(layers=32, d_model=4096, heads=32, seq_len=4096, vocab=32000, name="7B"), 1024),
    (ModelShape(layers=80, d_model=8192, heads=64, seq_len=4096, vocab=32000, name="70B"), 1024),
]
GPUS = (8, 64, 512, 4096)


def main(argv: list[str] | None = None) -> None:
    gpus = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or list(GPUS)
    print("| model | GPUs | best layout | tokens/s | per GPU | MFU | memory GB | step s | bubble | exposed comm | "
          "scaling eff. | layouts fit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for n in gpus:  # every model at one count before the next count: the small counts come first
        for shape, batch in MODELS:
            hw = h200(nodes=max(1, n // 8), gpus_per_node=min(8, n))
            profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
            start = time.perf_counter()
            preds = plan(shape, profile, hw, batch, "bf16", microbatch_sizes=(1, 2))
            best = preds[0]
            per_gpu = best.tokens_per_second / n
            base.setdefault(shape.name, per_gpu)
            print(f"| {shape.name} ({total_params(profile) / 1e9:.2f}B) | {n} | {best.layout.label} | "
                  f"{best.tokens_per_second:,.0f} | {per_gpu:,.0f} | {best.mfu:.1%} | {best.memory.total / 1e9:.1f} | "
                  f"{best.time.total:.2f} | {best.time.bubble:.1%} | {best.time.exposed_comm / best.time.total:.1%} | "
                  f"{per_gpu / base[shape.name]:.0%} | {len(preds)} ({time.perf_counter() - start:.0f} s) |", flush=True)


if __name__ == "__main__":
    main()
