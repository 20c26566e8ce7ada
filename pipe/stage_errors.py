"""Errors raised inside a stage, said in the pipeline's terms: which layer, stage and microbatch
failed on what input, instead of torch's bare message on one rank.

torch reports a token id past the vocabulary as "index out of range in self" and a stage whose
output does not fit the next stage as "mat1 and mat2 shapes cannot be multiplied"; both name no
layer, stage or value. Describing the input costs a device sync, so it runs only on the failure
path.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LayerError", "describe_input", "layer_error"]

_WRAPPED = (IndexError, RuntimeError, ValueError, TypeError)


class LayerError(ValueError):
    """A layer, or the loss, failed on its input; the message names where and the input's shapes."""


def describe_input(x: Any) -> str:
    """Shapes and dtypes of a tensor or tuple; integer tensors also show their [min, max] (token ids)."""
    tensors = (x,) if isinstance(x, torch.Tensor) else tuple(x) if isinstance(x, (tuple, list)) else ()
    parts = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            parts.append(type(t).__name__)
            continue
        text = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        if not t.is_floating_point() and not t.is_complex() and t.numel():
            text += f" values in [{int(t.min())}, {int(t.max())}]"
        parts.append(text)
    return ", ".join(parts) or type(x).__name__


def layer_error(err: BaseException, where: str, x: Any, fed_by_previous_stage: bool) -> BaseException:
    """The error to raise for `err` from `where` on input `x` (returned unchanged when not ours to wrap)."""
    if isinstance(err, LayerError) or not isinstance(err, _WRAPPED) or isinstance(err, torch.OutOfMemoryError):
        return err
    hint = ""
    if isinstance(err, IndexError) and "index out of range" in str(err):
        hint = "; an id at or past the embedding's size (the vocabulary) is out of range: check the data's ids"
    elif fed_by_previous_stage:
        hint = "; its input is the previous stage's output: does that stage's output shape fit this layer?"
    return LayerError(f"{where} failed on input {describe_input(x)}: {type(err).__name__}: {err}{hint}")
