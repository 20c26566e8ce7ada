"""Hugging Face's "auto" placeholders filled from what the launching script knows, before parsing.

A config written for the Hugging Face Trainer leaves keys as "auto" and the Trainer's DeepSpeed
integration fills them from its TrainingArguments before DeepSpeed sees the file: the batch keys
from the per-device batch size and accumulation steps, gradient_clipping from max_grad_norm, the
optimizer's lr/betas/eps/weight_decay, the scheduler's warm-up and total steps, ZeRO's bucket
sizes from the model's hidden size. Here the caller passes the values it knows by DeepSpeed key
path (`auto_values={"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4}`) and they
replace the "auto"s of the file; as in the integration, an "auto" warm-up range of WarmupLR and
WarmupDecayLR runs from 0 to the optimizer's lr. ZeRO's sizes come from `hidden_size` (zero/);
an "auto" batch key counts as not given, so the batch arithmetic fills it. What is still "auto"
afterwards takes DeepSpeed's default inside the fp16/bf16/zero sections (DeepSpeed drops it there)
and is an error elsewhere that names the key and `auto_values`.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from pipezero.config_fields import AUTO

__all__ = ["fill_auto"]


def fill_auto(raw: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the config with each "auto" at a key path of `values` replaced by its value."""
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(f"auto_values={values!r}: expected a dict of DeepSpeed key paths to values, "
                        f'e.g. {{"optimizer.params.lr": 3e-4}}')
    out = copy.deepcopy(dict(raw))
    for path, value in values.items():
        _fill(out, path.split("."), value)
    _fill_warmup_range(out)
    return out


def _fill(node: Any, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(keys[-1]) == AUTO:
        node[keys[-1]] = value


def _fill_warmup_range(cfg: dict[str, Any]) -> None:
    """WarmupLR/WarmupDecayLR with an "auto" range: from 0 to the optimizer's lr (Hugging Face's rule)."""
    params = (cfg.get("scheduler") or {}).get("params")
    if not isinstance(params, dict):
        return
    if params.get("warmup_min_lr") == AUTO:
        params["warmup_min_lr"] = 0
    lr = ((cfg.get("optimizer") or {}).get("params") or {}).get("lr")
    if params.get("warmup_max_lr") == AUTO and lr is not None and lr != AUTO:
        params["warmup_max_lr"] = lr
