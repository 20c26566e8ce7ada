"""Activation checkpointing of a model's layers: full or selective, with the kept inputs on the host.

Full (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): each run of `interval`
layers keeps only its inputs and runs its forward again in backward. Selective (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"): the recompute skips the
expensive ops, whose outputs are kept (the matmuls and the attention kernels), and re-runs the cheap
ones (norms, activations, rotary, softmax, dropout), which hold most of the bytes. Both are torch's own
`torch.utils.checkpoint` (non-reentrant, so a split backward can take the input gradient first and
the weights' later); selective passes a policy through `create_selective_checkpoint_contexts`.
`offload=True` moves each run's kept inputs to pinned host memory (pipe/memory/offload.py).

    PipelineModule(specs, grid, recompute=RecomputeConfig(mode="selective", offload=True))
    checkpoint_blocks(model_blocks(model), RecomputeConfig(mode="full"))   # a whole model, no pipeline
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

try:  # torch's selective-checkpoint dispatch modes (private; without them the policy alone decides)
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    _SAC_MODES: tuple = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:  # pragma: no cover - a torch that renamed them
    _SAC_MODES = ()

from pipezero.pipe.memory.offload import HostOffload

__all__ = ["MODES", "SAVED_OPS", "RecomputeConfig", "checkpoint_blocks", "checkpointed", "checkpointed_runs",
           "compiles_checkpointed", "in_selective_run", "recomputed_matmuls"]

MODES = ("none", "full", "selective")
_selective = threading.local()  # set while a selectively checkpointed run's forward (or its recompute) runs


def _ops(*names: str) -> frozenset:
    """The aten overload packets of these names that this torch has (the attention kernels vary)."""
    found = set()
    for name in names:
        try:
            found.add(getattr(torch.ops.aten, name))
        except AttributeError:
            continue
    return frozenset(found)


# What selective recomputation keeps: the matmuls' outputs and the attention kernels' (all the FLOPs;
# the kernels' own saved statistics come with them), not the elementwise ops between them.
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                 "_efficient_attention_forward")


@dataclass(kw_only=True, slots=True, frozen=True)
class RecomputeConfig:
    """Which layers recompute their forward in backward, how much of it, and where their inputs wait."""

    mode: str = "none"      # "none", "full" (recompute everything) or "selective" (keep matmul outputs)
    interval: int = 1       # layers per checkpointed run (DeepSpeed's activation_checkpoint_interval)
    offload: bool = False   # each run's kept inputs in pinned host memory (DeepSpeed's cpu_checkpointing)
    offload_layers: int | None = None  # with offload: only the runs among a forward's first N layers
                                       # (None: all), the rest keep their inputs on the device
    checkpoint_layers: int | None = None  # only the runs among a forward's first N layers are checkpointed
                                          # (None: all), the rest keep every activation

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"RecomputeConfig(mode={self.mode!r}): expected one of {MODES}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"RecomputeConfig(interval={self.interval!r}): expected a positive integer "
                             "(layers per checkpointed run)")
        if not isinstance(self.offload, bool):
            raise TypeError(f"RecomputeConfig(offload={self.offload!r}): expected True or False")
        if self.offload and self.mode == "none":
            raise ValueError("RecomputeConfig(mode='none', offload=True): offload moves the inputs that "
                             "checkpointed layers keep, and mode='none' checkpoints none; use mode='full' "
                             "or 'selective'")
        self._check_layer_counts()

    def _check_layer_counts(self) -> None:
        for name, what in (("offload_layers", "keep their inputs on the host"),
                           ("checkpoint_layers", "are checkpointed")):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"RecomputeConfig({name}={n!r}): expected a positive integer (how many of a "
                                 f"forward's first layers {what}) or None (all)")
        n, k = self.offload_layers, self.checkpoint_layers
        if n is not None and not self.offload:
            raise ValueError(f"RecomputeConfig(offload_layers={n}, offload=False): offload_layers says how many "
                             "layers offload their inputs; set offload=True with it, or drop it")
        if k is not None and self.mode == "none":
            raise ValueError(f"RecomputeConfig(checkpoint_layers={k}, mode='none'): checkpoint_layers says how many "
                             "layers are checkpointed; set mode='full' or 'selective' with it, or drop it")
        if n is not None and k is not None and n > k:
            raise ValueError(f"RecomputeConfig(offload_layers={n}, checkpoint_layers={k}): only checkpointed layers "
                             f"keep inputs to offload; set offload_layers <= {k}")

    def checkpoints(self, layer: int) -> bool:
        """Is the run starting at a forward's `layer`-th layer (from 0) checkpointed?"""
        return self.enabled and (self.checkpoint_layers is None or layer < self.checkpoint_layers)

    def on_host(self, layer: int) -> bool:
        """Does the run starting at a forward's `layer`-th layer (from 0) offload its inputs?"""
        return self.checkpoints(layer) and (self.offload_layers is None or layer < self.offload_layers)

    @property
    def enabled(self) -> bool:
        """Does any layer recompute?"""
        return self.mode != "none"

    def describe(self) -> str:
        """One line for the log, e.g. "selective recompute of every layer, its inputs on the host"."""
        if not self.enabled:
            return "no activation checkpointing"
        runs = "every layer" if self.interval == 1 else f"every run of {self.interval} layers"
        if self.checkpoint_layers is not None:
            runs = f"a forward's first {self.checkpoint_layers} layers" + ("" if self.interval == 1 else
                                                                           f" in runs of {self.interval}")
        eager = ", the layers eager (not compiled)" if self.mode == "selective" else ""
        host = ", its inputs in pinned host memory" if self.offload else ""
        if self.offload and self.offload_layers is not None:
            host = f", the inputs of a forward's first {self.offload_layers} layers in pinned host memory"
        return f"{self.mode} recompute of {runs}{eager}{host}"

    @classmethod
    def of(cls, value: "RecomputeConfig | str | bool | None") -> "RecomputeConfig":
        """A config from a RecomputeConfig, a mode name, True (full) or False / None (none)."""
        if isinstance(value, RecomputeConfig):
            return value
        if value is None or value is False:
            return cls()
        if value is True:
            return cls(mode="full")
        if isinstance(value, str):
            return cls(mode=value)
        raise TypeError(f"recompute={value!r}: expected a RecomputeConfig, one of {MODES}, True or False")


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    keep = packet in SAVED_OPS and not getattr(_selective, "recomputed", False)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def recomputed_matmuls():
    """Within it, a selective run keeps no matmul output: code that recomputes its own pieces (the row
    tiles of pipe/tiled_mlp.py) would otherwise have every tile's [rows, intermediate] outputs kept by
    the enclosing selective checkpoint, the whole [T, intermediate] the tiles exist to avoid.

    Where it can (eager, the checkpoint's dispatch mode innermost), it steps out of that mode: torch
    then neither records nor replays the ops inside, which it would only have recomputed, and they skip
    its per-op Python dispatch (many small ops for tiles). Yields whether it stepped out: inside, code
    may then run other ops in the recompute than in the forward (a cache hit and a miss), which torch
    otherwise refuses; elsewhere the policy keeps nothing inside and the ops must match."""
    before, _selective.recomputed = getattr(_selective, "recomputed", False), True
    try:
        if _SAC_MODES and not torch.compiler.is_compiling() and isinstance(_get_current_dispatch_mode(),
                                                                            _SAC_MODES):
            with _pop_mode_temporarily():
                yield True
        else:
            yield False
    finally:
        _selective.recomputed = before


def compiles_checkpointed(config: RecomputeConfig) -> bool:
    """May the checkpointed layers be compiled? Not under selective: torch's selective checkpoint runs
    the layer's ops through a Python dispatch mode that caches the kept outputs, and a compiled layer's
    kernels write into buffers they reuse (`mm(..., out=)`), which that mode refuses ("Tensor cached
    during selective activation checkpoint has been mutated", torch 2.11 to 2.13). Those layers run
    eager; full recomputation reruns a compiled layer whole and keeps it compiled."""
    return config.mode != "selective"


def _context_fn(mode: str) -> Callable | None:
    if mode == "selective":
        return functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    return None


def in_selective_run() -> bool:
    """Is a selectively checkpointed run's forward, or its recompute, running on this thread?

    torch checks that the recompute runs the forward's ops, one by one, so what layers share per
    microbatch from a cache (a Hugging Face stage's mask and rotary cos/sin, pipe/hf/layers.py) is taken
    from it only outside torch's view (recomputed_matmuls), as a cache hit in the forward and a miss in
    the recompute (another microbatch ran between them) run different ops; elsewhere each layer makes it.
    """
    return getattr(_selective, "on", False)


def _marked_selective(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    before, _selective.on = in_selective_run(), True
    try:
        return fn(*args, **kwargs)
    finally:
        _selective.on = before


def checkpointed(fn: Callable[..., Any], args: tuple, config: RecomputeConfig,
                 offload: HostOffload | None = None, on_host: bool = True, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) checkpointed as `config` says (offload: where the kept inputs wait; on_host
    False: this run keeps them on the device, and its backward still starts the copy of the run before).

    Only positional tensors are the run's kept inputs (torch keeps keyword arguments as they are);
    a pipeline layer's tuple of tensors is passed spread, so each is one.
    """
    context = _context_fn(config.mode)
    extra = {"context_fn": context} if context is not None else {}
    if context is not None:
        fn = functools.partial(_marked_selective, fn)
    with offload.run(on_host) if offload is not None else nullcontext():
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


def checkpointed_runs(run: Callable[[int, int, Any], Any], lo: int, hi: int, x: Any,
                      config: RecomputeConfig, offload: HostOffload | None = None) -> Any:
    """Layers [lo, hi) as runs of config.interval, each checkpointed: `run(start, end, x)` runs them."""
    if offload is not None:
        offload.begin()
    for start in range(lo, hi, config.interval):
        end = min(hi, start + config.interval)
        if not config.checkpoints(start - lo):  # past checkpoint_layers: every activation kept
            x = run(start, end, x)
            continue
        spread = isinstance(x, tuple)
        x = checkpointed(functools.partial(_call_run, run, start, end, spread), x if spread else (x,),
                         config, offload, on_host=config.on_host(start - lo))
    return x


def _call_run(run: Callable[[int, int, Any], Any], start: int, end: int, spread: bool, *inputs: Any) -> Any:
    return run(start, end, tuple(inputs) if spread else inputs[0])


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers' names for a layer's KV cache


def checkpoint_blocks(blocks: Iterable[nn.Module], config: RecomputeConfig,
                      offload: HostOffload | None = None) -> int:
    """Checkpoint each block's forward in place (a whole model's layers: pipe/compile.py's model_blocks);
    returns how many. Without gradients (eval, generation) a block runs as it is."""
    count = 0
    if not config.enabled:
        return count
    for block in blocks:
        if not config.checkpoints(count):
            break
        block.forward = functools.partial(_checkpointed_forward, block.forward, config, offload,
                                          config.on_host(count))
        count += 1
    return count


def _checkpointed_forward(forward: Callable[..., Any], config: RecomputeConfig, offload: HostOffload | None,
                          on_host: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):  # a KV cache, filled by the forward
        raise ValueError("a checkpointed block was given a KV cache (cache=) while training: its recompute "
                         "would append the keys and values a second time; call the model with use_cache=False "
                         "(as transformers' own gradient checkpointing does), or turn activation checkpointing off")
    return checkpointed(forward, args, config, offload, on_host, **kwargs)
