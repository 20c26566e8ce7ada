"""LoRA adapters out of (and into) the pipeline: a `peft` adapter directory, or a merged Hugging Face model.

A LoRA fine-tune is shipped as its adapters: `adapter_config.json` and
`adapter_model.safetensors`, under peft's names ("base_model.model." + the module's name in
the Hugging Face model + ".lora_A.weight"), which `PeftModel.from_pretrained(base, directory)`
loads onto the base model. The adapters are small, so every rank sends its own to rank 0,
which writes the directory (replicas over the data axis are equal; tensor-parallel adapters
are gathered whole first). A merged export folds scaling * B A into each adapted weight
(pipe/lora.py's `merged`) and writes what train/checkpoint/hf_export.py writes for a full model. Under
ZeRO-3 (a model passed as module=) pass the optimizer (`optimizer=opt` gathers the adapters) or
call these inside `with gathered(opt):`; a partitioned adapter is a ValueError on every rank
(hf_export.py's `whole_weights`), never a 0-element tensor in the file or a merge that leaves
it out. peft itself is not needed to write or read the directory.

    export_peft_adapter(model, "adapter/", config)     # every rank calls it (ZeRO-3: optimizer=opt)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "adapter/")
    export_merged_hf(model, "merged/")                 # AutoModelForCausalLM.from_pretrained("merged/")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.pipe.lora import LoraConfig, LoraLinear, adapter_state_dict, load_adapter_state_dict, merged
from pipezero.train.checkpoint.hf_export import export_hf, whole_weights

__all__ = ["PEFT_PREFIX", "export_merged_hf", "export_peft_adapter", "load_peft_adapter"]

PEFT_PREFIX = "base_model.model."  # peft's names: PeftModel -> LoraModel -> the Hugging Face model
_WEIGHTS, _CONFIG = "adapter_model.safetensors", "adapter_config.json"


def export_peft_adapter(module: nn.Module, directory: str | os.PathLike, config: LoraConfig | Any,
                        base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None,
                        optimizer: Any = None) -> Path:
    """Write `module`'s adapters as a peft adapter directory (every rank calls it; rank 0 writes).
    `optimizer`: the ZeroOptimizer of a ZeRO-3 model, whose adapters are gathered for the write."""
    config = LoraConfig.of(config)
    directory = Path(directory)
    with whole_weights(module, optimizer, "export_peft_adapter"):
        mine = {PEFT_PREFIX + name: _whole(t).to(dtype or t.dtype).cpu().contiguous()
                for name, t in adapter_state_dict(module).items()}
    every = _gather(mine)
    if _rank() == 0:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (_WEIGHTS + ".tmp")
        save_file(dict(sorted(every.items())), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / _WEIGHTS)
        (directory / _CONFIG).write_text(json.dumps(_peft_config(config, base_model_name_or_path), indent=2))
    _barrier()
    return directory


def load_peft_adapter(module: nn.Module, directory: str | os.PathLike) -> list[str]:
    """Copy a peft adapter directory's weights into this rank's adapters (by name); returns those loaded.

    Every rank calls it. Its rank (the shapes), scaling (lora_alpha / r) and targets must be the
    module's, and it must hold adapters only: a ValueError naming what differs (nothing of the
    directory is dropped unsaid), raised on every rank when any rank's stage refuses it (no rank
    goes on to a collective its peers never reach)."""
    try:
        loaded, problem = _load_peft_adapter(module, Path(directory)), None
    except ValueError as err:
        loaded, problem = [], str(err)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        rank, first = failed[0]
        raise ValueError(problem if problem is not None else f"load_peft_adapter: refused on rank(s) "
                         f"{[r for r, _ in failed]} (rank {rank}: {first})")
    return loaded


def _load_peft_adapter(module: nn.Module, directory: Path) -> list[str]:
    from safetensors.torch import load_file

    if not (directory / _WEIGHTS).exists():
        raise ValueError(f"load_peft_adapter({str(directory)!r}): no {_WEIGHTS} there; expected a directory written "
                         "by PeftModel.save_pretrained or export_peft_adapter")
    _check_scaling(module, directory)
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(directory / _WEIGHTS)).items()}
    other = sorted(k for k in state if ".lora_" not in k)
    if other:
        raise ValueError(f"load_peft_adapter({str(directory)!r}): {len(other)} tensors are not LoRA adapters, e.g. "
                         f"{other[:2]} (peft's modules_to_save or trainable tokens), which the pipeline's LoRA "
                         "does not load; expected a plain LoRA adapter directory")
    return load_adapter_state_dict(module, state)


def export_merged_hf(module: nn.Module, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                     optimizer: Any = None) -> Path:
    """Write `module` with its adapters merged into the base weights, as a Hugging Face checkpoint.
    `optimizer`: the ZeroOptimizer of a ZeRO-3 model, whose adapters are gathered for the merge."""
    with whole_weights(module, optimizer, "export_merged_hf"), merged(module):
        return export_hf(module, directory, dtype)


def _check_scaling(module: nn.Module, directory: Path) -> None:
    if not (directory / _CONFIG).exists():
        return
    saved = json.loads((directory / _CONFIG).read_text())
    patterns = {k: saved[k] for k in ("rank_pattern", "alpha_pattern") if saved.get(k)}
    if patterns:
        raise ValueError(f"load_peft_adapter({str(directory)!r}): its config scales some modules apart ({patterns}); "
                         "the pipeline's LoRA has one r and lora_alpha for every module: retrain without "
                         "rank_pattern / alpha_pattern")
    r, alpha = saved.get("r"), saved.get("lora_alpha")
    if not isinstance(r, int) or not isinstance(alpha, (int, float)):
        return
    scaling = alpha / (r ** 0.5 if saved.get("use_rslora") else r)
    here = {m.scaling for m in module.modules() if isinstance(m, LoraLinear)}
    if here and any(abs(s - scaling) > 1e-12 * max(1.0, abs(s)) for s in here):
        raise ValueError(f"load_peft_adapter({str(directory)!r}): its r={r}, lora_alpha={alpha} scale the update by "
                         f"{scaling:g}, this model's adapters by {sorted(here)}; build the model with that directory's "
                         "LoraConfig (LoraConfig.of(peft.LoraConfig.from_pretrained(directory)))")


def _peft_config(config: LoraConfig, base: str | None) -> dict[str, Any]:
    """adapter_config.json: peft's LoraConfig fields for plain LoRA on nn.Linear targets."""
    targets = config.target_modules
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": config.r, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets),
            "use_rslora": config.use_rslora, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # tensor-parallel: a collective


def _gather(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    return {k: v for part in (every or []) for k, v in part.items()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
