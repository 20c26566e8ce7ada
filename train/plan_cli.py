"""`pipezero plan`: the flags, and the run that prints the ranked table and the winner's config.

Kept beside cli.py so the console command only adds one subcommand: the model shape flags
of examples/train_gpt.py, the hardware (this machine measured, or an H200 cluster modelled
from FLOPs), the global batch and precision.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """Register `pipezero plan` and its flags."""
    p = sub.add_parser("plan", help="rank every parallel layout by predicted tokens/s; print the winner's config",
                       formatter_class=formatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--hardware", default="local", choices=["local", "h200"],
                   help="local: this machine, layer times measured; h200: modelled from FLOPs")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (local: processes; h200: 8)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--memory-gb", type=float, default=None, help="usable memory per device (default: the preset's)")
    p.add_argument("--efficiency", type=float, default=None, help="h200: achieved fraction of peak (default 0.55)")
    p.add_argument("--intra-gbps", type=float, default=None, help="GB/s per direction within a node")
    p.add_argument("--inter-gbps", type=float, default=None, help="GB/s per device between nodes")
    p.add_argument("--top", type=int, default=10,
                   help="rows of the table (layouts that cannot reach them are not simulated)")
    p.add_argument("--write-config", default=None, help="write the winner's ds_config.json here")


def _hardware(args: argparse.Namespace):
    from pipezero.train.plan_hardware import h200, local_cpu

    if args.hardware == "local":
        hw = local_cpu(args.gpus_per_node or 4, args.memory_gb)
    else:
        hw = h200(args.nodes, args.gpus_per_node or 8)
    changes = {k: v for k, v in (("memory_gb", args.memory_gb), ("efficiency", args.efficiency),
                                 ("intra_gbps", args.intra_gbps), ("inter_gbps", args.inter_gbps)) if v is not None}
    if args.hardware == "local":
        changes["nodes"] = 1
    return replace(hw, **changes)


def run_plan(args: argparse.Namespace) -> int:
    """Measure or model the layers, rank the layouts, print the table, the winner's parts and config."""
    import torch

    from pipezero.train.plan import ds_config, explain, format_table, plan, torchrun_command, write_config
    from pipezero.train.plan_model import ModelShape, flops_profile, measure_profile

    start = time.perf_counter()
    try:
        shape = ModelShape(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len,
                           vocab=args.vocab)
        hw = _hardware(args)
        if args.hardware == "local":
            torch.set_num_threads(1)  # one thread per rank, as the processes share the cores
            profile = measure_profile(shape, args.precision)
            source = "layer times measured here (one thread, one micro-batch of 2), x%g for %s" % (
                hw.compute_slowdown, hw.name)
        else:
            profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
            source = f"layer times modelled: FLOPs / ({hw.peak_tflops:g} TFLOP/s x {hw.efficiency:g})"
        preds = plan(shape, profile, hw, args.global_batch, args.precision, top=args.top)
    except ValueError as e:
        raise SystemExit(f"pipezero plan: {e}") from None
    print(f"{shape.label}, vocab {shape.vocab}, {args.precision}, global batch {args.global_batch} on {hw.name}; "
          f"{source}; the best {len(preds)} layouts that fit")
    print(format_table(preds))
    print("\nwinner:\n" + explain(preds[0]))
    print("\nds_config.json:\n" + json.dumps(ds_config(preds[0])))
    path = args.write_config or "plan_ds_config.json"
    if args.write_config:
        write_config(preds[0], path)
        print(f"wrote {path}")
    print("\n" + torchrun_command(preds[0], path))
    print(f"\nplanned in {time.perf_counter() - start:.1f} s")
    return 0
