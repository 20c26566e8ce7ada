"""The dtypes gradients are summed and reduced in, from ds_config, with DeepSpeed 0.19.8's meaning.

DeepSpeed sums each micro-batch's gradient in data_types.grad_accum_dtype, by default the model's
dtype: "fp32" under bf16 gives fp32 gradient buffers (its BF16_Optimizer at stage 1, its ZeRO
optimizer's partitions at stages 1-3; engine.get_data_types). It reduces them over the data group
in the top-level communication_data_type, by default the model's dtype too, so an fp32 sum is
rounded to bf16 for the collective unless that says "fp32". ZeroOptimizer does the same through
ZeroConfig.grad_accum_dtype and reduce_dtype, at stage 0 too (where DeepSpeed 0.19.8 refuses
bf16 with fp32 sums as "unsupported mix"). `param_dtype` must name the enabled precision, as
DeepSpeed asserts. Buffers keep the dtype they were made in (precision/cast.py), DeepSpeed's
default; its `buffer_dtype`, which casts them, is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from pipezero.config_fields import ConfigError, Ignored, Section, Unsupported

__all__ = ["read_grad_dtypes"]

# DeepSpeed's DtypeEnum spellings of the three floating dtypes (int8 is refused below)
_DTYPES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), torch.float32),
           **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), torch.bfloat16),
           **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), torch.float16)}
_KEYS = ("grad_accum_dtype", "param_dtype")
_RULES = {"keep_in_fp32_modules": Ignored("buffers keep the dtype they were made in (precision/cast.py)",
                                          noop=lambda v: v in ("auto", [])),
          "buffer_dtype": Unsupported("casting the model's buffers, which otherwise keep the dtype they were "
                                      "made in (DeepSpeed's default too)", "set it to null", noop=None)}


def read_grad_dtypes(ds_config: Mapping[str, Any],
                     model_dtype: torch.dtype) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(grad_accum_dtype, reduce_dtype) for ZeroConfig; None: the model's own dtype."""
    reduce = _dtype(Section(ds_config), "communication_data_type")
    return _grad_accum_dtype(ds_config, model_dtype), None if reduce == model_dtype else reduce


def _grad_accum_dtype(ds_config: Mapping[str, Any], model_dtype: torch.dtype) -> torch.dtype | None:
    sec = Section(ds_config.get("data_types"), ("data_types",))
    sec.check(_KEYS, _RULES, strict=False)
    named = _dtype(sec, "param_dtype")
    if named is not None and named != model_dtype:
        raise ConfigError(f"{sec.where('param_dtype')} = {sec.data['param_dtype']!r} differs from the enabled "
                          f"precision ({_name(model_dtype)}): set the matching fp16/bf16 \"enabled\" flag or remove it")
    accum = _dtype(sec, "grad_accum_dtype")
    if accum is None or accum == model_dtype:
        return None
    if accum != torch.float32:
        raise ConfigError(f"{sec.where('grad_accum_dtype')} = {sec.data['grad_accum_dtype']!r} is narrower than, "
                          f"or not comparable with, the model's {_name(model_dtype)}: every gradient would be "
                          'rounded; use "fp32" or remove it (gradients are then summed in the model\'s dtype)')
    return accum


def _dtype(sec: Section, key: str) -> torch.dtype | None:
    value = sec.raw(key, None)
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DTYPES:
        raise ConfigError(f'{sec.where(key)} = {value!r}: expected "fp32", "bf16" or "fp16" (or DeepSpeed\'s other '
                          'spellings: "float32", "bfloat16", "float16", "half")')
    return _DTYPES[value.lower()]


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
