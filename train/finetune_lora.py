"""`pipezero finetune`'s LoRA: the flags (or a peft adapter_config.json), and what LoRA changes in the job.

With LoRA on (--lora-r R or --lora-config PATH) the base model is frozen and only the adapters
of pipe/lora.py train. A checkpoint then holds the adapters and their optimizer state, not the
base (train/checkpoint/lora_state.py; the base is rebuilt from --model on resume), and the job
exports two things: the peft adapter (<out>/adapter, for PeftModel.from_pretrained on the base)
and the merged model (<out>/model, for AutoModelForCausalLM.from_pretrained). With LoRA off the
same three steps are the full-model ones (train/checkpoint/state.py, hf_export.py).

    lora = lora_config(args)                                  # None: LoRA off; bad flags fail here
    meta = resume(parts, point, identity, lora)               # the latest or --resume-from's checkpoint
    save(parts, ckpt_dir, step, data_state, identity, lora)   # every --save-interval steps
    export(parts, out, lora, base=args.model)                 # at the end
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

from pipezero.pipe.lora import ALL_LINEAR, LoraConfig
from pipezero.pipe.lora_tensor import lora_tensor_plan
from pipezero.train.checkpoint.hf_export import export_hf
from pipezero.train.checkpoint.lora_export import export_merged_hf, export_peft_adapter
from pipezero.train.checkpoint.lora_state import load_adapters, save_adapters
from pipezero.train.checkpoint.resume import ResumePoint, resume_from_point
from pipezero.train.checkpoint.state import save_state

__all__ = ["describe", "export", "identity", "lora_config", "read_peft_config", "resume", "save",
           "tensor_plan"]

_DEFAULT = LoraConfig()  # the library's (and peft's) defaults (train/flags.py shows them in --help)


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The LoRA of the flags or of --lora-config; None when LoRA is off. A ValueError names the bad flag."""
    flags = {f"--lora-{k}": v for k, v in (("r", args.lora_r), ("alpha", args.lora_alpha),
                                            ("dropout", args.lora_dropout), ("targets", args.lora_targets))
             if v is not None}
    if args.lora_config is not None:
        if flags:
            raise ValueError(f"--lora-config {args.lora_config} and {', '.join(flags)}: the file sets r, lora_alpha, "
                             f"lora_dropout and target_modules; pass either the file or the flags")
        return read_peft_config(args.lora_config)
    if args.lora_r is None:
        if flags:
            raise ValueError(f"{', '.join(flags)} without --lora-r: pass --lora-r R (e.g. 8) to turn LoRA on, "
                             f"or --lora-config PATH")
        return None
    targets = args.lora_targets or _DEFAULT.target_modules
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--lora-targets {' '.join(targets)}: {ALL_LINEAR} stands alone (it names every Linear "
                         f"but the output layer); pass it alone or module names")
    try:
        return LoraConfig(r=args.lora_r, lora_alpha=_DEFAULT.lora_alpha if args.lora_alpha is None else args.lora_alpha,
                          lora_dropout=args.lora_dropout or 0.0,
                          target_modules=ALL_LINEAR if list(targets) == [ALL_LINEAR] else tuple(targets))
    except ValueError as err:
        raise ValueError(f"{' '.join(f'{k} {v}' for k, v in flags.items())}: {err}") from None


def read_peft_config(path: str) -> LoraConfig:
    """A peft adapter_config.json (the file, or the folder holding it) as the pipeline's LoraConfig; the
    options pipe/lora.py does not implement are refused as LoraConfig.of refuses them."""
    file = Path(path) / "adapter_config.json" if Path(path).is_dir() else Path(path)
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--lora-config {path}: cannot read {file} as JSON ({err}); pass a peft "
                         f"adapter_config.json (LoraConfig(...).save_pretrained(DIR) writes one)") from None
    if not isinstance(fields, dict) or fields.get("peft_type", "LORA") != "LORA":
        kind = fields.get("peft_type") if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(f"--lora-config {path}: a {kind} config; expected a peft LoRA adapter_config.json "
                         f'("peft_type": "LORA")')
    return LoraConfig.from_peft_fields(fields, f"--lora-config {path}")


def describe(lora: LoraConfig | None) -> str:
    """The log's words for it: 'off', or its settings."""
    if lora is None:
        return "off (every weight trains)"
    targets = lora.target_modules if isinstance(lora.target_modules, str) else " ".join(sorted(lora.target_modules))
    return f"r={lora.r} alpha={lora.lora_alpha:g} dropout={lora.lora_dropout:g} targets {targets}"


def identity(lora: LoraConfig | None) -> dict[str, str]:
    """What a checkpoint records of it (a resume with other adapters is refused); nothing when off."""
    return {} if lora is None else {"--lora": describe(lora) + (" rslora" if lora.use_rslora else "")}


def tensor_plan(plan: Any, lora: LoraConfig | None) -> Any:
    """The tensor-parallel plan for the layers as built: adapter-aware with LoRA (pipe/lora_tensor.py)."""
    return plan if lora is None else lora_tensor_plan(plan)


def save(parts: Any, ckpt_dir: Path, step: int, data_state: Mapping[str, Any], identity: Mapping[str, Any],
         lora: LoraConfig | None) -> Path:
    """Checkpoint `step` (every rank): the adapters and their training state, or the whole model's."""
    if lora is None:
        return save_state(parts, ckpt_dir, step, data_state, model_config=identity)
    return save_adapters(parts, ckpt_dir, step, data_state, model_config=identity)


def resume(parts: Any, point: ResumePoint | None, identity: Mapping[str, Any],
           lora: LoraConfig | None) -> dict[str, Any] | None:
    """Load the chosen checkpoint (every rank); its meta, or None to start fresh."""
    if lora is None or point is None:
        return resume_from_point(parts, point, identity)
    return load_adapters(parts, point.root, point.step, model_config=identity)


def export(parts: Any, out: Path, lora: LoraConfig | None, base: str | None) -> list[Path]:
    """The model for from_pretrained at <out>/model (merged with LoRA), and the peft adapter at
    <out>/adapter (`base`: its base_model_name_or_path); every rank calls it, ZeRO-3 gathered."""
    if lora is None:
        return [export_hf(parts.module, out / "model", optimizer=parts.optimizer)]
    base = str(Path(base).resolve()) if base is not None else None
    adapter = export_peft_adapter(parts.module, out / "adapter", lora, base_model_name_or_path=base,
                                  optimizer=parts.optimizer)
    return [export_merged_hf(parts.module, out / "model", optimizer=parts.optimizer), adapter]
