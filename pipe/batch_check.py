"""The step-start batch check of PipelineRunner: one small MAX all-reduce answers, on every rank
alike and before any transfer, whether the batch fits the step.

Each rank contributes flags (inputs or targets missing, ragged) and [max, -min] pairs (batch
sizes of the first stage's inputs and the last stage's targets, the schedule's microbatch
count, the step), so sizes are compared, not added, across ranks: data ranks with different
batch sizes, inputs and targets of different lengths, or stages built with different
microbatch counts are refused with the values, instead of a stall until the pipeline timeout.

The step is where the rank is in its sequence of train_step / eval_step calls (`step_word`):
ranks that have called them a different number of times (a data rank with more batches than
the others) meet here in different steps, and every rank raises, naming the ranks ahead and
their steps (a second small gather, only then), instead of pairing the steps' collectives
wrongly; a rank whose peer already exited hears which step it was in.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipezero.comm import is_peer_lost, peer_lost

__all__ = ["BatchView", "check_batch", "split_batch", "step_word"]

_ABSENT = object()  # this rank holds no first (or last) stage: it reports nothing about that batch
_NONE = -(1 << 62)  # a [max, -min] pair's value from ranks that report nothing


@dataclass
class BatchView:
    """One rank's view of the step; the MAX of each field over the world answers every check."""

    no_inputs: int = 0          # the first stage got inputs=None
    inputs_ragged: int = 0      # its tensors differ in dim 0
    targets_missing: int = 0    # the last stage got targets=None where the step needs them
    targets_ragged: int = 0
    no_targets: int = 0         # the last stage got no targets (eval_step then returns outputs)
    signature: int = 0          # of the inputs' shapes (pipe/runner.py starts new streams when it changes)
    listed: int = 0             # the inputs came as a list of microbatches (their shapes may differ)
    inputs_max: int = _NONE     # [max, -min] pairs: batch sizes and microbatch counts
    inputs_neg_min: int = _NONE
    targets_max: int = _NONE
    targets_neg_min: int = _NONE
    microbatches_max: int = 0
    microbatches_neg_min: int = 0
    step_max: int = 0           # step_word of this call
    step_neg_min: int = 0

    def sizes(self, name: str) -> tuple[int, int]:
        """(min, max) of `name` ("inputs", "targets", "microbatches") over the ranks combined."""
        return -getattr(self, f"{name}_neg_min"), getattr(self, f"{name}_max")


def step_word(train_steps: int, train: bool) -> int:
    """Where a rank is in its calls: training step k (1-based) is 2k, an evaluation after k training steps 2k + 1."""
    return 2 * train_steps + (0 if train else 1)


def check_batch(inputs: Any, targets: Any, m: int, need_targets: bool, *, first: bool, last: bool,
                group: Any, step: int = 0) -> BatchView:
    """Combine every rank's view over `group` (on the CPU: no wait for the GPU's queued work)
    and raise, on every rank alike, the first problem it shows; return the combined view.

    `first` / `last`: whether this rank holds the first / the last virtual stage (only those
    report on the inputs / the targets). `step`: this call's step_word.
    """
    wants_targets = last and (need_targets or targets is not None)
    mine = _view(inputs if first else _ABSENT, targets if wants_targets else _ABSENT, m)
    mine.no_targets = int(last and targets is None)
    mine.step_max, mine.step_neg_min = step, -step
    words = torch.tensor(astuple(mine), dtype=torch.int64)
    start = time.monotonic()
    try:
        dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        if is_peer_lost(e):
            raise peer_lost(e, f"the step-start batch check of {_describe_step(step)}", start) from e
        raise
    combined = BatchView(*words.tolist())
    if combined.sizes("step")[0] != combined.sizes("step")[1]:
        _raise_uneven_steps(step, group)
    _raise_errors(combined, mine, m, need_targets)
    return combined


def _raise_uneven_steps(step: int, group: Any) -> None:
    """Every rank saw steps differ: gather them (every rank is here) and name who is where."""
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64), group=group)
    ranks_at: dict[int, list[int]] = {}
    for rank, word in enumerate(int(t) for t in steps):
        ranks_at.setdefault(word, []).append(dist.get_global_rank(group, rank) if group is not None else rank)
    where = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} at {_describe_step(w)}"
                      for w, r in sorted(ranks_at.items(), reverse=True))
    raise ValueError(f"the ranks called train_step / eval_step a different number of times ({where}; ahead "
                     f"first): every rank must run the same steps in the same order; give every data rank "
                     f"the same number of batches (an uneven shard runs ahead: drop its remainder)")


def _describe_step(word: int) -> str:
    return f"training step {word // 2}" if word % 2 == 0 else f"an evaluation after training step {word // 2}"


def split_batch(batch: Any, m: int, device: torch.device) -> list:
    """`batch` (a tensor or a tuple) as m microbatches along dim 0; non-tensors are repeated.
    A list holds the m microbatches themselves (shapes may differ between them)."""
    if isinstance(batch, list):
        return [split_batch(mb, 1, device)[0] for mb in batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.to(device).chunk(m))
    parts = [t.to(device).chunk(m) if isinstance(t, torch.Tensor) else [t] * m for t in batch]
    return [tuple(p[i] for p in parts) for i in range(m)]


def _view(inputs: Any, targets: Any, m: int) -> BatchView:
    """This rank's view; _ABSENT: a batch this rank does not report on."""
    view = BatchView(microbatches_max=m, microbatches_neg_min=-m)
    for name, batch in (("inputs", inputs), ("targets", targets)):
        if batch is _ABSENT:
            continue
        if batch is None:
            setattr(view, "no_inputs" if name == "inputs" else "targets_missing", 1)
            continue
        parts = batch if isinstance(batch, list) else [batch]  # a list: one entry per microbatch
        sizes = [{t.shape[0] for t in _tensors(p)} for p in parts]
        if any(len(s) != 1 for s in sizes) or len(parts) not in (1, m):
            setattr(view, f"{name}_ragged", 1)
            continue
        size = sum(s.pop() for s in sizes)
        view.listed = max(view.listed, int(isinstance(batch, list)))
        setattr(view, f"{name}_max", size)
        setattr(view, f"{name}_neg_min", -size)
    if inputs is not _ABSENT and not (view.no_inputs or view.inputs_ragged):
        view.signature = _signature(inputs)
    return view


def _raise_errors(w: BatchView, mine: BatchView, m: int, need_targets: bool) -> None:
    """Raise the first problem the combined view `w` shows."""
    low, top = w.sizes("microbatches")
    if low != top:
        raise ValueError(f"the pipeline ranks run schedules of different microbatch counts ({low} to "
                         f"{top}; this rank {m}): build every rank's schedule with the same num_microbatches")
    if w.no_inputs:
        raise ValueError("train_step/eval_step: the first pipeline stage got inputs=None; pass the batch there")
    if w.targets_missing and need_targets:
        raise ValueError("train_step: the last pipeline stage got targets=None; pass the targets there")
    for name in ("inputs", "targets"):
        if getattr(w, f"{name}_ragged"):
            raise ValueError(f"the {name}' tensors differ in their batch dimension (dim 0) on some rank, or a list "
                             f"of microbatches is not num_microbatches={m} long; every tensor of one batch (or "
                             f"microbatch) needs the same number of samples")
        (low, top), here = w.sizes(name), getattr(mine, f"{name}_max")
        if top == _NONE:
            continue
        if low != top:
            raise ValueError(f"the {name}' batch sizes differ between ranks ({low} to {top}"
                             f"{f'; this rank {here}' if here != _NONE else ''}): every data rank must pass "
                             f"the same batch size, or the replicas' gradients are weighted wrongly")
        if top % m:
            raise ValueError(f"the {name}' batch dimension ({top}) does not split into num_microbatches={m} "
                             f"equal microbatches; use a batch that is a multiple of {m}")
    if w.targets_max != _NONE and w.inputs_max != _NONE and w.targets_max != w.inputs_max:
        raise ValueError(f"the inputs hold {w.inputs_max} samples but the targets {w.targets_max}: pass the "
                         f"targets of the same samples to the last stage")


def _tensors(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(t for t in x if isinstance(t, torch.Tensor))


def _signature(batch: Any) -> int:
    """A number that changes when the microbatch shapes change (then metadata is sent afresh)."""
    shapes = tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(batch))
    return zlib.crc32(repr(shapes).encode())
