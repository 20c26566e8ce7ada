"""Whole weights for a generation phase: the hybrid engine's switch out of the ZeRO-3 layout.

An RLHF actor alternates between generating experience (many small forward passes, one per
new token) and training on it. Under ZeRO-3 every forward of a submodule all-gathers its
shards and frees them again, so a naive generation pays one all-gather per layer per token.
`gathered(opt)` all-gathers every stage-3 shard ONCE, optionally cast to an inference dtype
(bf16), pauses the per-submodule gathering for the whole phase, and on exit frees the
gathered copies, so the parameter memory returns exactly to the ZeRO-3 level. Training state
(fp32 master shards, optimizer state, loss scale, gradients) is never touched: the gathered
weights are copies, not the shards. `layers_at_a_time=k` streams instead: k submodules
whole at a time, for a model whose full weights do not fit next to its training state.
DeepSpeed-Chat's Hybrid Engine (Yao et al. 2023, "DeepSpeed-Chat: Easy, Fast and Affordable
RLHF Training of ChatGPT-like Models at All Scales") does this switch inside its engine; here
it is a context manager over the optimizer that owns the shards.

    with gathered(opt, dtype=torch.bfloat16):       # one gather, whole bf16 weights
        tokens = generate(model.layers, prompts, 64, temperature=0)
    loss = ...; opt.backward(loss); opt.step()      # ZeRO-3 training as before

No backward pass may run inside the block (the gathered copies have no shard to reduce into).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn

from pipezero.comm import all_gather
from pipezero.zero.partition import Bucket

__all__ = ["gathered", "parameter_bytes"]


@contextmanager
def gathered(opt: Any, dtype: torch.dtype | None = None, layers_at_a_time: int | None = None) -> Iterator[None]:
    """Inside the block every parameter of opt's module is whole (in `dtype`, default the model's).

    opt: the ZeroOptimizer that owns the shards (stages 0-2 keep whole parameters already; the
    block then only casts). layers_at_a_time=k: instead of everything at once, the k stage-3
    units (transformer blocks) starting at the one about to run are whole, the others freed.
    """
    buckets, gatherer = _check(opt, dtype, layers_at_a_time)
    saved = {id(p): (p, p.data) for b in buckets for p in b.params}
    partitioned = [b for b in buckets if b.flat is None]
    try:
        with gatherer.paused() if gatherer is not None else nullcontext([]) as units:  # stage-3 hooks off
            _cast([b for b in buckets if b.flat is not None], dtype)
            if layers_at_a_time is None or not partitioned:
                _gather(partitioned, dtype)
                yield
            else:
                with _streaming(units, layers_at_a_time, dtype, saved):
                    yield
    finally:
        for p, data in saved.values():  # the original tensors: shards' empties, persistent views
            p.data = data


def parameter_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages behind the parameters of modules and the buffers of ZeroOptimizers.

    Counts each storage once (views share one), so a whole-then-freed phase that leaks a copy
    shows up as a difference.
    """
    tensors: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            tensors += [p.data for p in obj.parameters()]
        for b in getattr(obj, "buckets", ()):
            tensors += [t for t in (b.flat, b.local, b.master) if t is not None]
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


# -- internals ------------------------------------------------------------------------------
def _check(opt: Any, dtype: Any, layers_at_a_time: Any) -> tuple[list[Bucket], Any]:
    buckets = getattr(opt, "buckets", None)
    if buckets is None or not hasattr(opt, "group"):
        raise TypeError(f"gathered(opt): expected the ZeroOptimizer that owns the shards, got {type(opt).__name__}; "
                        "wrap the optimizer first: ZeroOptimizer(inner, stage=3, module=model)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"gathered(dtype={dtype!r}): expected a floating torch.dtype such as torch.bfloat16")
    if layers_at_a_time is not None and (not isinstance(layers_at_a_time, int) or layers_at_a_time < 1):
        raise ValueError(f"gathered(layers_at_a_time={layers_at_a_time!r}): expected None (all at once) or an "
                         "integer >= 1")
    return list(buckets), opt.gatherer


def _cast(buckets: list[Bucket], dtype: torch.dtype | None) -> None:
    """Whole buckets (persistent, or stages 0-2) in the inference dtype, as copies."""
    if dtype is None:
        return
    for b in buckets:
        if b.dtype != dtype:
            for p in b.params:
                p.data = p.data.to(dtype)


def _gather(buckets: list[Bucket], dtype: torch.dtype | None) -> None:
    """One async all-gather per bucket into a fresh full-size buffer; point the parameters at it.

    The local shard is cast before the gather, so a bf16 phase moves half the bytes of fp32.
    The bucket's own state (flat, local, master) is left as it is.
    """
    pending = []
    for b in buckets:
        dt = dtype or b.dtype
        full = torch.empty(b.padded, dtype=dt, device=b.device)
        pending.append((b, full, all_gather(full, b.local.to(b.device, dt), group=b.group, async_op=True)))
    for b, full, handle in pending:
        handle.wait()
        for i, p in enumerate(b.params):
            p.data = b.slot(full, i)


@contextmanager
def _streaming(units, k: int, dtype, saved) -> Iterator[None]:
    """Forward hooks per unit: when a unit about to run is not whole, the window moves to it.

    The new window is the k units starting at this one, plus every unit still running (an
    outer module whose own parameters are used after its children, as a root that holds the
    embedding and the head); buckets already whole stay, the others are freed.
    """
    index = {m: i for i, (m, _) in enumerate(units)}
    window: list[Bucket] = []
    running: list[nn.Module] = []

    def before(module: nn.Module, args: Any) -> None:
        running.append(module)
        i = index[module]
        if all(b in window for b in units[i][1]):
            return
        ahead = [b for _, bs in units[i:i + k] for b in bs]
        held = [b for m in running for b in units[index[m]][1]]
        new = list(dict.fromkeys(ahead + held))
        for b in window:
            if b not in new:
                for p in b.params:
                    p.data = saved[id(p)][1]
        _gather([b for b in new if b not in window], dtype)
        window[:] = new

    def after(module: nn.Module, args: Any, output: Any) -> None:
        running.reverse()
        running.remove(module)  # the innermost call of this module
        running.reverse()

    handles = [h for m, _ in units for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
