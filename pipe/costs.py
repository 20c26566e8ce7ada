"""Measure what each layer costs, for PipelineModule(partition_method=[costs]).

Counting parameters misjudges a language model: the embedding has as many parameters as the
head but costs almost nothing, while the head with its loss costs more than a block. Timing
is the honest weight. Layers are built one at a time on the device (a 70B model never has
to fit), the sample flows through them so every layer sees its real input shapes, and a
layer of the same class on the same shapes as one already timed reuses that time.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipezero.pipe.spec import LayerSpec, TiedLayerSpec, layer_name
from pipezero.topology import process_device

__all__ = ["measure_layer_costs"]


def measure_layer_costs(layers: Sequence[Any], sample: Any, *, loss_fn: Callable | None = None,
                        targets: Any = None, dtype: torch.dtype | None = None, repeats: int = 3,
                        group: Any = None) -> list[float]:
    """Milliseconds of forward + backward of each layer on `sample` (one micro-batch).

    The last layer's backward starts from loss_fn(output, targets) when loss_fn is given, so
    the head carries its loss; the others start from the sum of their outputs. Built layers
    are cast to `dtype` if given. With torch.distributed initialised the result is the
    maximum over `group` (default: the world), so every rank gets the same partition.
    """
    if repeats < 1:
        raise ValueError(f"measure_layer_costs: repeats={repeats}, expected >= 1")
    device = _device_of(sample)
    timed: dict[tuple, float] = {}
    costs, x = [], sample
    for i, layer in enumerate(layers):
        call = _callable(layer, device, dtype)
        last = loss_fn is not None and i == len(layers) - 1
        key = (layer_name(layer), _shapes(x), last)
        if key not in timed:
            timed[key] = _time_ms(lambda: _forward_backward(call, x, loss_fn if last else None, targets),
                                  device, repeats)
        costs.append(timed[key])
        with torch.no_grad():
            x = call(x)
        del call
    return _agreed(costs, group)


def _callable(layer: Any, device: torch.device, dtype: torch.dtype | None) -> Callable:
    if isinstance(layer, LayerSpec):
        with device:
            module = layer.build()
        module.to(device=device, dtype=dtype)
        fn = layer.forward_fn if isinstance(layer, TiedLayerSpec) else None
        return (lambda x: fn(module, x)) if fn is not None else module
    if isinstance(layer, nn.Module) or callable(layer):
        return layer
    raise TypeError(f"measure_layer_costs: layer {layer!r} is not a LayerSpec, module or callable")


def _forward_backward(call: Callable, x: Any, loss_fn: Callable | None, targets: Any) -> None:
    out = call(_leaves(x))
    if loss_fn is not None:
        loss = loss_fn(out, targets)
    else:
        outs = [t for t in _tensors(out) if t.requires_grad]
        if not outs:
            return
        loss = sum(t.float().sum() for t in outs)
    loss.backward()


def _time_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels chosen, memory allocated
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def _agreed(costs: list[float], group: Any) -> list[float]:
    if not dist.is_initialized():
        return costs
    on = process_device(group)
    t = torch.tensor(costs, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _leaves(x: Any) -> Any:
    """Floating tensors as fresh leaves that want a gradient (as a received activation does)."""
    cut = lambda t: t.detach().requires_grad_(t.is_floating_point())  # noqa: E731
    if isinstance(x, torch.Tensor):
        return cut(x)
    return type(x)(cut(t) if isinstance(t, torch.Tensor) else t for t in x)


def _tensors(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(t for t in x if isinstance(t, torch.Tensor))


def _shapes(x: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(x))


def _device_of(x: Any) -> torch.device:
    tensors = _tensors(x)
    if not tensors:
        raise TypeError(f"measure_layer_costs: sample must be a tensor or a tuple holding tensors, got {type(x)}")
    return tensors[0].device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
