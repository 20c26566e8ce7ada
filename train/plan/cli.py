"""`pipezero plan`: the flags, and the run that prints the ranked table and the winner's config.

Kept beside cli.py so the console command only adds one subcommand: the model shape flags
of examples/train_gpt.py, the hardware (this machine measured, or an H200 cluster modelled
from FLOPs), the global batch and precision.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from pipezero.train.flags import PRECISIONS, add_gpt_shape_flags, peak_fraction, positive_int, positive_number

__all__ = ["add_plan_parser", "run_plan"]

BYTE_VOCAB = 256  # the main job's byte-level GPT (GPTConfig.vocab_size), which the printed launch line runs


def add_plan_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """Register `pipezero plan` and its flags (each checked as it is read: argparse's one-line error)."""
    p = sub.add_parser("plan", help="rank every parallel layout by predicted tokens/s; print the winner's config",
                       formatter_class=formatter)
    add_gpt_shape_flags(p)
    p.add_argument("--vocab", type=positive_int, default=BYTE_VOCAB, help="vocabulary size")
    p.add_argument("--global-batch", type=positive_int, default=32, help="sequences per optimizer step")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="the training precision")
    p.add_argument("--hf-config", default=None,
                   help="a Hugging Face config.json (or its folder): the model's shape (grouped key/value heads, "
                        "gated MLP, experts), trained with the fused head + loss; replaces --layers ... --vocab")
    p.add_argument("--hardware", default="local", choices=["local", "h100", "h200"],
                   help="local: this machine, layer times measured; h100 / h200: modelled from FLOPs")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="devices per node (local: processes, default 4; h200: default 8)")
    p.add_argument("--nodes", type=positive_int, default=None, help="h200: nodes (default 1; local is one machine)")
    p.add_argument("--memory-gb", type=positive_number, default=None,
                   help="usable memory per device (default: the preset's)")
    p.add_argument("--host-memory-gb", type=positive_number, default=None,
                   help="h100 / h200: host memory per device, for the offloaded optimizer and checkpointed inputs "
                        "(default 256: a DGX node's 2 TB over 8 GPUs; one GPU in a 128 GiB machine: about 120)")
    p.add_argument("--efficiency", type=peak_fraction, default=None,
                   help="h200: achieved fraction of peak, in (0, 1] (default 0.55)")
    p.add_argument("--intra-gbps", type=positive_number, default=None, help="GB/s per direction within a node")
    p.add_argument("--inter-gbps", type=positive_number, default=None, help="GB/s per device between nodes")
    p.add_argument("--top", type=positive_int, default=10,
                   help="rows of the table (layouts that cannot reach them are not simulated)")
    p.add_argument("--write-config", default=None, help="write the winner's ds_config.json here")


def _check_flags(args: argparse.Namespace) -> None:
    """What the hardware preset cannot use, refused before anything is measured."""
    if args.hardware == "local":
        given = [f"--{k.replace('_', '-')} {v}" for k, v in (("nodes", args.nodes), ("efficiency", args.efficiency),
                                                              ("inter_gbps", args.inter_gbps),
                                                              ("host_memory_gb", args.host_memory_gb)) if v is not None]
        if given and given != ["--nodes 1"]:
            verb = "applies" if len(given) == 1 else "apply"
            raise SystemExit(f"pipezero plan: {', '.join(given)} {verb} only to --hardware h100 / h200 (modelled); "
                             "--hardware local plans this one machine from measured times: drop them, "
                             "or add --hardware h200")
        if args.hf_config is not None:
            raise SystemExit("pipezero plan: --hf-config plans a Hugging Face decoder, whose layers are modelled, "
                             "not timed here (this machine times pipezero's GPT blocks): add --hardware h100 or h200")
    if args.write_config is not None:
        folder = Path(args.write_config).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise SystemExit(f"pipezero plan: --write-config {args.write_config!r}: the folder {str(folder)!r} "
                             f"{'is not writable' if folder.is_dir() else 'does not exist'}; create it first, "
                             "or name a file in a writable folder")


def _hardware(args: argparse.Namespace):
    from pipezero.train.plan.hardware import h100, h200, local_cpu

    if args.hardware == "local":
        hw = local_cpu(args.gpus_per_node or 4, args.memory_gb)
    else:
        hw = (h100 if args.hardware == "h100" else h200)(args.nodes or 1, args.gpus_per_node or 8)
    changes = {k: v for k, v in (("memory_gb", args.memory_gb), ("efficiency", args.efficiency),
                                 ("intra_gbps", args.intra_gbps), ("inter_gbps", args.inter_gbps),
                                 ("host_memory_gb", args.host_memory_gb)) if v is not None}
    if args.hardware == "local":
        changes["nodes"] = 1
    return replace(hw, **changes)


def _shape(args: argparse.Namespace, shape_cls: type):
    """The shape flags', or --hf-config's (a config.json, or the folder holding one)."""
    if args.hf_config is None:
        return shape_cls(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len,
                         vocab=args.vocab)
    path = Path(args.hf_config)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"pipezero plan: --hf-config {args.hf_config!r}: cannot read a JSON config ({e}); "
                         "pass a Hugging Face config.json or the folder holding it") from None
    return shape_cls.from_hf_config(config, args.seq_len, name=path.parent.name or "")


def _finetune_line(args: argparse.Namespace, pred, config_path: str) -> str:
    """pipezero finetune's flags for the winner (--config takes the rest: the ds_config above)."""
    lay, folder = pred.layout, Path(args.hf_config)
    folder = folder if folder.is_dir() else folder.parent
    kit = (f" --activation-checkpointing {lay.recompute}" if lay.checkpoint else "") + (
        f" --activation-checkpoint-layers {lay.checkpoint_layers}" if lay.checkpoint_layers else "") + (
        " --offload-activations" if lay.host_inputs else "") + (
        f" --offload-activation-layers {lay.host_layers}" if lay.host_layers else "") + (
        f" --sequence-parallel {lay.sequence}" if lay.sequence > 1 else "") + (
        f" --tensor {lay.tensor}" if lay.tensor > 1 else "")  # not a ds_config key: world / the rest is data
    return (f"pipezero finetune --nproc {lay.world} --model {folder} --data DATA --seq-len {args.seq_len} "
            f"--config {config_path}{kit}")


def run_plan(args: argparse.Namespace) -> int:
    """Measure or model the layers, rank the layouts, print the table, the winner's parts and config."""
    import torch

    from pipezero.train.plan.planner import (ds_config, explain, format_table, kit_table, plan, torchrun_command,
                                             write_config)
    from pipezero.train.plan.model import MEASURED_LEN, ModelShape, flops_profile, measure_profile

    _check_flags(args)
    start = time.perf_counter()
    try:
        shape = _shape(args, ModelShape)
        hw = _hardware(args)
        if args.hardware == "local":
            torch.set_num_threads(1)  # one thread per rank, as the processes share the cores
            profile = measure_profile(shape, args.precision)
            source = "layer times measured here (one thread, one micro-batch of 2), x%g for %s" % (
                hw.compute_slowdown, hw.name)
            if shape.seq_len > MEASURED_LEN:
                source += f" (timed at {MEASURED_LEN} tokens, scaled to {shape.seq_len} by the FLOPs)"
        else:
            profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
            source = f"layer times modelled: FLOPs / ({hw.peak_tflops:g} TFLOP/s x {hw.efficiency:g})"
        preds = plan(shape, profile, hw, args.global_batch, args.precision, top=args.top)
    except ValueError as e:
        raise SystemExit(f"pipezero plan: {e}") from None
    print(f"{shape.label}, vocab {shape.vocab}, {args.precision}, global batch {args.global_batch} on {hw.name}; "
          f"{source}; the best {len(preds)} layouts that fit")
    if hw.unsettled:
        print(f"(the machine was busy while measuring: {'; '.join(hw.unsettled)}; the ranking may differ from "
              "run to run, so plan again when it is idle)")
    print(format_table(preds))
    print("\nwinner:\n" + explain(preds[0]))
    print("\n" + kit_table(profile, preds[0]))
    print("\nds_config.json:\n" + json.dumps(ds_config(preds[0])))
    path = args.write_config or "plan_ds_config.json"
    if args.write_config:
        try:
            write_config(preds[0], path)
        except OSError as e:
            raise SystemExit(f"pipezero plan: cannot write --write-config {path!r}: {e.strerror or e}") from None
        print(f"wrote {path}")
    else:
        print(f"\nto launch it, save the config above as {path} (or rerun with --write-config {path}), then:")
    if args.hf_config is not None:  # a Hugging Face model trains through pipezero finetune, not the GPT's job
        print(_finetune_line(args, preds[0], path))
    else:
        print(torchrun_command(preds[0], path))
    if args.vocab != BYTE_VOCAB and args.hf_config is None:  # the line's job is byte-level: it cannot run the planned vocabulary
        print(f"(that line runs pipezero's byte-level GPT, vocabulary {BYTE_VOCAB}, on the winner's layout; for the "
              f"planned vocabulary {args.vocab} take the ds_config to your own model: pipezero.train.initialize or "
              "build)")
    print(f"\nplanned in {time.perf_counter() - start:.1f} s")
    return 0
