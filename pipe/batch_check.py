"""The step-start batch check of PipelineRunner: one small MAX all-reduce answers, on every rank
alike and before any transfer, whether the batch fits the step.

Each rank contributes flags (inputs or targets missing, ragged) and [max, -min] pairs (batch
sizes of the first stage's inputs and the last stage's targets, the schedule's microbatch
count), so sizes are compared, not added, across ranks: data ranks with different batch sizes,
inputs and targets of different lengths, or stages built with different microbatch counts
are refused with the values, instead of a stall until the pipeline timeout.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

__all__ = ["ABSENT", "NO_TARGETS", "SIGNATURE", "batch_words", "raise_batch_errors"]


def _tensors(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(t for t in x if isinstance(t, torch.Tensor))


ABSENT = object()  # this rank holds no first (or last) stage: it reports nothing about that batch
_NONE = -(1 << 62)  # a [max, -min] pair's value from ranks that report nothing
(_W_NO_INPUTS, _W_INPUTS_RAGGED, _W_NO_TARGETS_NEEDED, _W_TARGETS_RAGGED, SIGNATURE, NO_TARGETS,
 _W_IN_MAX, _W_IN_NEG_MIN, _W_TGT_MAX, _W_TGT_NEG_MIN, _W_M_MAX, _W_M_NEG_MIN) = range(12)


def batch_words(inputs: Any, targets: Any, m: int) -> list[int]:
    """This rank's view of the step, as words whose MAX over the world answers every check."""
    words = [0] * 12
    words[_W_IN_MAX:_W_TGT_NEG_MIN + 1] = [_NONE] * 4
    words[_W_M_MAX], words[_W_M_NEG_MIN] = m, -m
    for batch, (missing, ragged, high) in ((inputs, (_W_NO_INPUTS, _W_INPUTS_RAGGED, _W_IN_MAX)),
                                           (targets, (_W_NO_TARGETS_NEEDED, _W_TARGETS_RAGGED, _W_TGT_MAX))):
        if batch is ABSENT:
            continue
        if batch is None:
            words[missing] = 1
            continue
        sizes = {t.shape[0] for t in _tensors(batch)}
        if len(sizes) != 1:
            words[ragged] = 1
            continue
        size = sizes.pop()
        words[high], words[high + 1] = size, -size
    if inputs is not ABSENT and not any(words[:2]):
        words[SIGNATURE] = _signature(inputs)
    return words


def raise_batch_errors(w: list[int], mine: list[int], m: int, need_targets: bool) -> None:
    """Raise, on every rank alike, the first problem the combined words show."""
    if -w[_W_M_NEG_MIN] != w[_W_M_MAX]:
        raise ValueError(f"the pipeline ranks run schedules of different microbatch counts ({-w[_W_M_NEG_MIN]} to "
                         f"{w[_W_M_MAX]}; this rank {m}): build every rank's schedule with the same "
                         f"num_microbatches")
    if w[_W_NO_INPUTS]:
        raise ValueError("train_step/eval_step: the first pipeline stage got inputs=None; pass the batch there")
    if w[_W_NO_TARGETS_NEEDED] and need_targets:
        raise ValueError("train_step: the last pipeline stage got targets=None; pass the targets there")
    for name, ragged, high in (("inputs", _W_INPUTS_RAGGED, _W_IN_MAX), ("targets", _W_TARGETS_RAGGED, _W_TGT_MAX)):
        if w[ragged]:
            raise ValueError(f"the {name}' tensors differ in their batch dimension (dim 0) on some rank; "
                             f"every tensor of one batch needs the same number of samples")
        low, top, here = -w[high + 1], w[high], mine[high]
        if top == _NONE:
            continue
        if low != top:
            raise ValueError(f"the {name}' batch sizes differ between ranks ({low} to {top}"
                             f"{f'; this rank {here}' if here != _NONE else ''}): every data rank must pass "
                             f"the same batch size, or the replicas' gradients are weighted wrongly")
        if top % m:
            raise ValueError(f"the {name}' batch dimension ({top}) does not split into num_microbatches={m} "
                             f"equal microbatches; use a batch that is a multiple of {m}")
    if w[_W_TGT_MAX] != _NONE and w[_W_IN_MAX] != _NONE and w[_W_TGT_MAX] != w[_W_IN_MAX]:
        raise ValueError(f"the inputs hold {w[_W_IN_MAX]} samples but the targets {w[_W_TGT_MAX]}: pass the "
                         f"targets of the same samples to the last stage")


def _signature(batch: Any) -> int:
    """A number that changes when the microbatch shapes change (then metadata is sent afresh)."""
    shapes = tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(batch))
    return zlib.crc32(repr(shapes).encode())
