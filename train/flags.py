"""The command line: argparse types, the defaults formatter, and the flags of the main job and finetune.

Every command (`pipezero simulate | plan | train | finetune`) builds its parser from here, and this
module imports neither torch nor another pipezero module, so `--help` answers before torch loads
and the commands' modules (cli.py, gpt/job.py, finetune.py, plan/cli.py) do not import each other
for their flags. The choices the parsers offer are written here as data (SCHEDULE_NAMES,
FLOAT8_RECIPES); tests/test_cli_help.py checks them against the registry and pipe/float8.py.
What the main job and finetune share is written once: the layout, batch and output flags
(add_layout_flags, add_batch_flags, add_output_flags) and their values into a ds_config dict
(layout_section, as wandb_section does --wandb's).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

__all__ = ["ALL_LINEAR", "FLOAT8_RECIPES", "LORA_DEFAULTS", "PRECISIONS", "RECOMPUTE_MODES", "SCHEDULE_NAMES",
           "DefaultsHelp", "add_batch_flags", "add_expert_flag", "add_gpt_shape_flags", "add_layout_flags",
           "add_lora_flags", "add_output_flags", "add_preempt_flag", "add_recompute_flags", "add_sequence_flag",
           "add_wandb_flag", "cost", "expert_section", "finetune_parser", "job_parser", "layout_section",
           "parse_job_args", "peak_fraction", "positive_int", "positive_number", "wandb_section"]

DEFAULT_WANDB_PROJECT = "pipezero"  # --wandb without a name, where the config names no project
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")  # pipe/schedule/registry.py's
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")                     # pipe/float8.py's RECIPES
PRECISIONS = ("fp32", "bf16", "fp16")                                                # --precision's choices
RECOMPUTE_MODES = ("none", "full", "selective")                                      # pipe/memory/recompute.py's MODES
LORA_DEFAULTS = dict(lora_alpha=8.0, lora_dropout=0.0, target_modules=("q_proj", "v_proj"))  # pipe/lora.py's LoraConfig
ALL_LINEAR = "all-linear"                                                             # pipe/lora.py's ALL_LINEAR


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default; a flag whose default is None says in its own help what applies,
    and an on/off switch (--resume, --no-packing) says what it does, not its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _checked(value: Any, ok: bool, refusal: str) -> Any:
    """`value`, or argparse's one-line usage error saying `refusal` (the argparse types below)."""
    if not ok:
        raise argparse.ArgumentTypeError(refusal)
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error)."""
    value = int(text)
    return _checked(value, value >= 1, f"{value} is not a positive integer (expected >= 1)")


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0 (a size, a bandwidth)."""
    value = float(text)
    return _checked(value, 0 < value < math.inf, f"{text} is not a finite number > 0")


def peak_fraction(text: str) -> float:
    """argparse type: an achieved fraction of a device's peak, in (0, 1]."""
    value = float(text)
    return _checked(value, 0 < value <= 1, f"{text} is not a fraction of peak in (0, 1] (e.g. 0.55)")


def cost(text: str) -> float:
    """argparse type: a finite number >= 0 (a cost in the simulator's time units)."""
    value = float(text)
    return _checked(value, math.isfinite(value) and value >= 0, f"{text} is not a finite number >= 0")


def add_wandb_flag(p: argparse.ArgumentParser) -> None:
    """--wandb [PROJECT]: log the TensorBoard scalars to Weights & Biases too (ds_config's wandb section)."""
    p.add_argument("--wandb", nargs="?", const="", default=None, metavar="PROJECT",
                   help="log every TensorBoard scalar to Weights & Biases too, into PROJECT (default: the "
                        f"config's wandb.project, else {DEFAULT_WANDB_PROJECT!r}); needs pipezero[wandb]; "
                        "WANDB_MODE=offline keeps the run on disk")


def wandb_section(raw: dict[str, Any], project: str | None) -> None:
    """--wandb's value into a ds_config dict: its wandb section enabled, the project named (None: unchanged)."""
    if project is None:
        return
    section = dict(raw["wandb"]) if isinstance(raw.get("wandb"), dict) else {}
    section["enabled"] = True
    if project or not section.get("project"):
        section["project"] = project or DEFAULT_WANDB_PROJECT
    raw["wandb"] = section


def add_preempt_flag(p: argparse.ArgumentParser) -> None:
    """--no-save-on-signal: SIGTERM / SIGUSR1 end the job as Python does by default (train/preempt.py)."""
    p.add_argument("--no-save-on-signal", dest="save_on_signal", action="store_false",
                   help="by default SIGTERM or SIGUSR1 (a preemption, Slurm's warning) saves a checkpoint at the "
                        "next step boundary on every rank and exits 0; with this flag they stop the job as usual")


def add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """--activation-checkpointing, --activation-checkpoint-layers, --offload-activations and
    --offload-activation-layers (train/config/recompute.py writes them into the ds_config:
    apply_recompute_flags)."""
    p.add_argument("--activation-checkpointing", default=None, choices=RECOMPUTE_MODES,
                   help="recompute each layer's forward in backward: all of it (full) or all but the matmuls "
                        "(selective); default: the config's (ds_config pipeline.activation_checkpointing)")
    p.add_argument("--activation-checkpoint-layers", type=int, default=None, metavar="N",
                   help="checkpoint only each forward's first N layers, the rest keep every activation "
                        "(ds_config pipeline.activation_checkpoint_layers; implies --activation-checkpointing "
                        "full unless given)")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep the checkpointed layers' inputs in pinned host memory, fetched back ahead of "
                        "their backward (ds_config activation_checkpointing.cpu_checkpointing; implies "
                        "--activation-checkpointing full unless given)")
    p.add_argument("--offload-activation-layers", type=int, default=None, metavar="N",
                   help="offload only the inputs of each forward's first N layers, the rest kept on the "
                        "device (ds_config pipeline.offload_activation_layers; implies --offload-activations)")


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """pipezero finetune's LoRA flags, as a group (train/finetune_lora.py reads them)."""
    g = parser.add_argument_group("LoRA", "train rank-r adapters on a frozen base (pipe/lora.py); the job "
                                          "exports <out>/adapter (peft) and <out>/model (merged)")
    g.add_argument("--lora-r", type=positive_int, default=None,
                   help="the adapters' rank; turns LoRA on (default: off, every weight trains)")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help=f"the update is scaled by alpha / r (default {LORA_DEFAULTS['lora_alpha']:g}, as peft)")
    g.add_argument("--lora-dropout", type=float, default=None,
                   help=f"dropout on the adapters' input (default {LORA_DEFAULTS['lora_dropout']:g})")
    g.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                   help=f"modules to adapt: names matched as the end of a module's name (q_proj ...), or "
                        f"{ALL_LINEAR} (every Linear but the output layer) (default: "
                        f"{' '.join(LORA_DEFAULTS['target_modules'])})")
    g.add_argument("--lora-config", default=None, metavar="PATH",
                   help="a peft adapter_config.json (or its folder): its r, lora_alpha, lora_dropout, "
                        "target_modules and use_rslora, instead of the flags above")


def add_sequence_flag(p: argparse.ArgumentParser) -> None:
    """--sequence-parallel N: the grid's sequence axis (ds_config sequence_parallel_size)."""
    p.add_argument("--sequence-parallel", type=positive_int, default=None, metavar="N",
                   help="split every sequence over N ranks (Ulysses attention; default: the config's "
                        "sequence_parallel_size, else 1)")


def add_expert_flag(p: argparse.ArgumentParser) -> None:
    """--expert-parallel N: the grid's expert axis (ds_config expert_parallel's autoep_size, DeepSpeed's key)."""
    p.add_argument("--expert-parallel", type=positive_int, default=None, metavar="N",
                   help="split each MoE layer's experts over N ranks of the data axis (default: the config's "
                        "expert_parallel autoep_size, else 1)")


def expert_section(raw: dict, n: int | None) -> None:
    """--expert-parallel N as ds_config's "expert_parallel" section (DeepSpeed's AutoEP keys)."""
    if n is not None:
        raw["expert_parallel"] = {**raw.get("expert_parallel", {}), "enabled": n > 1, "autoep_size": n}


def add_layout_flags(p: argparse.ArgumentParser, *, stages: str, zero_stage: int, chunks: bool = False) -> None:
    """The parallel layout and the precision, each over the config's key (layout_section writes them):
    --pipe (default `stages`), --tensor, --sequence-parallel, --schedule (and --chunks), --zero-stage
    (default `zero_stage`), --precision, --float8 and the activation-checkpointing flags."""
    p.add_argument("--pipe", type=int, default=None, help=f"pipeline stages (default: the config's, else {stages})")
    p.add_argument("--tensor", type=int, default=1,
                   help="tensor-parallel degree: each layer's attention heads and MLP split over this many ranks")
    add_sequence_flag(p)
    add_expert_flag(p)
    p.add_argument("--schedule", default=None, choices=SCHEDULE_NAMES,
                   help="pipeline schedule (default: the config's, else 1f1b)")
    if chunks:
        p.add_argument("--chunks", type=int, default=None,
                       help="virtual chunks per rank (default: the schedule's; interleaved_1f1b takes any >= 2)")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help=f"default: the config's, else {zero_stage}")
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="default: the config's, else fp32")
    p.add_argument("--float8", default=None, choices=FLOAT8_RECIPES,
                   help="the repeated layers' Linears in fp8 with this torchao recipe (a GPU of compute "
                        "capability 8.9+)")
    add_recompute_flags(p)


def add_batch_flags(p: argparse.ArgumentParser, *, rows: str, default_size: int) -> None:
    """--micro-batches (default 4) and --batch-size (`rows` per micro-batch per data rank)."""
    p.add_argument("--micro-batches", type=positive_int, default=None, help="micro-batches per step (default 4)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"{rows} per micro-batch per data rank (default {default_size})")


def add_output_flags(p: argparse.ArgumentParser, *, out: str) -> None:
    """Where the job writes (--out), which checkpoint it resumes (--resume-from), --wandb, --no-save-on-signal."""
    p.add_argument("--out", default=out, help="TensorBoard logs, checkpoints and the exported model")
    p.add_argument("--resume-from", default=None, metavar="STEP_DIR",
                   help="resume from this checkpoint under --out/checkpoints (e.g. step_00000012, or a step "
                        "folder's path), not the latest")
    add_wandb_flag(p)
    add_preempt_flag(p)


def add_gpt_shape_flags(p: argparse.ArgumentParser) -> None:
    """The small GPT's shape (train/gpt/model.py's GPTConfig), which the main job trains and `pipezero plan` plans."""
    p.add_argument("--layers", type=positive_int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=positive_int, default=128, help="model width")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")


def layout_section(raw: dict[str, Any], args: argparse.Namespace, *, stages: int, zero_stage: int) -> None:
    """add_layout_flags' and add_output_flags' values into a ds_config dict, each over the config's key:
    pipeline stages (else `stages`) and schedule (else 1f1b), the ZeRO stage (else `zero_stage`), the
    precision, sequence_parallel_size, expert_parallel, TensorBoard under --out, --wandb; gradient_clipping 1.0 if unset.
    (The activation-checkpointing flags: train/config/recompute.py's apply_recompute_flags.)"""
    pipeline = {"stages": stages, "schedule": "1f1b", **raw.get("pipeline", {})}
    pipeline.update({k: v for k, v in (("stages", args.pipe), ("schedule", args.schedule)) if v is not None})
    raw["pipeline"] = pipeline
    raw["zero_optimization"] = {"stage": zero_stage, **raw.get("zero_optimization", {}),
                                **({"stage": args.zero_stage} if args.zero_stage is not None else {})}
    if args.precision is not None:
        raw["fp16"] = {**raw.get("fp16", {}), "enabled": args.precision == "fp16"}
        raw["bf16"] = {**raw.get("bf16", {}), "enabled": args.precision == "bf16"}
    raw.setdefault("gradient_clipping", 1.0)
    if args.sequence_parallel is not None:
        raw["sequence_parallel_size"] = args.sequence_parallel
    expert_section(raw, args.expert_parallel)
    raw["tensorboard"] = {"enabled": True, "output_path": args.out, "job_name": "tensorboard"}
    wandb_section(raw, args.wandb)


# -- the main job (pipezero train, python -m pipezero.train.gpt.job, examples/train_gpt.py) --------------

def job_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The main job's flags; the parallel layout, precision and batch ones override the config's keys."""
    p = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelp, description=(
        "The main job: train the small GPT with a pipeline, ZeRO and mixed precision, top to bottom."))
    p.add_argument("config_file", nargs="?", default=None, metavar="CONFIG", help="a ds_config.json (as --config)")
    p.add_argument("--data", type=int, default=None, help="data-parallel degree (default: world / pipe)")
    add_layout_flags(p, stages="2", zero_stage=2, chunks=True)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    add_batch_flags(p, rows="sequences", default_size=4)
    add_gpt_shape_flags(p)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warm-up + cosine)")
    p.add_argument("--config", default=None, help="a ds_config.json; the flags above override its keys")
    p.add_argument("--pipeline-timeout", type=float, default=None,
                   help="seconds a rank waits for a pipeline peer (ds_config pipeline.timeout; default 300)")
    _add_job_run_flags(p)
    return p


def _add_job_run_flags(p: argparse.ArgumentParser) -> None:
    """Where the run reads and writes, how often it evaluates, saves and prints, and the GPU smoke."""
    p.add_argument("--data-path", default=None, help="your own text/.bin/.npy file (default: stdlib sources)")
    add_output_flags(p, out="runs/gpt")
    p.add_argument("--resume", action="store_true", help="require a checkpoint in --out to resume from")
    p.add_argument("--eval-interval", type=int, default=50, help="steps between validation losses")
    p.add_argument("--save-interval", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--steps-per-print", type=int, default=None,
                   help="steps between log lines (default: the config's, else 10)")
    p.add_argument("--expect-device", default=None, choices=["cuda", "cpu"],
                   help="check that every parameter and each stage's activations live on this device (GPU smoke)")


def parse_job_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The main job's flags read; CONFIG (positional) and --config are one setting."""
    p = parser or job_parser()
    args = p.parse_args(argv)
    if args.config_file is not None and args.config is not None and args.config_file != args.config:
        p.error(f"CONFIG {args.config_file!r} and --config {args.config!r} name two configs: pass one")
    args.config = args.config or args.config_file
    del args.config_file
    return args


# -- pipezero finetune (python -m pipezero.train.finetune, examples/train_hf.py) ---------------------------

def finetune_parser(prog: str = "pipezero finetune") -> argparse.ArgumentParser:
    """pipezero finetune's flags: the model, the data, the layout, the schedule of steps, where it writes."""
    p = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelp, description=(
        "Fine-tune (or keep pre-training) a Hugging Face causal LM on the user's data, top to bottom."))
    p.add_argument("--model", default=None, help="a local save_pretrained directory (default: a small random Llama)")
    p.add_argument("--data", default=None, help="a file or folder of .txt/.jsonl/.parquet (default: stdlib sources)")
    p.add_argument("--text-field", default="text", help="the records' text field (JSON Lines, Parquet)")
    p.add_argument("--no-packing", dest="packing", action="store_false", help="one document per row, padded")
    p.add_argument("--long-docs", default="split", choices=["split", "truncate"],
                   help="what becomes of a document longer than --seq-len")
    p.add_argument("--seq-len", type=_seq_len, default=512, help="tokens per row")
    p.add_argument("--val-fraction", type=_fraction, default=0.02, help="share of the documents held out")
    p.add_argument("--cache-dir", default=None, help="tokenized corpora (default $PIPEZERO_CACHE or ~/.cache)")
    p.add_argument("--tokenize-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes that tokenize --data")
    p.add_argument("--config", default=None, help="a ds_config.json; the flags below override its keys")
    add_layout_flags(p, stages="2 on an even world, else 1", zero_stage=1)
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps")
    add_batch_flags(p, rows="rows", default_size=1)
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--eval-interval", type=positive_int, default=50, help="steps between held-out losses")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="held-out batches per evaluation")
    p.add_argument("--save-interval", type=positive_int, default=100,
                   help="steps between checkpoints (the last step is always saved)")
    p.add_argument("--seed", type=int, default=0, help="the data order's seed")
    add_output_flags(p, out="runs/finetune")
    p.add_argument("--from-deepspeed", default=None, metavar="DIR",
                   help="start from DeepSpeed's save_checkpoint folder of --model (ZeRO 1-3 or universal: weights, "
                        "optimizer, LR schedule, step) unless --out holds a checkpoint")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template replacing the tokenizer's (saved with the exported tokenizer)")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="processes to launch through torchrun when not started by it (default: one per GPU, "
                        "else 1)")
    add_lora_flags(p)
    return p


def _seq_len(text: str) -> int:
    value = int(text)
    return _checked(value, value >= 2, f"{value}: expected an integer >= 2 (a token and its next one)")


def _fraction(text: str) -> float:
    value = float(text)
    return _checked(value, 0.0 < value < 1.0, f"{text}: expected a share in (0, 1) of the documents to hold out "
                                              f"for evaluation, e.g. 0.02")
