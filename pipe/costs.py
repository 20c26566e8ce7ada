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
    maximum over `group` (default: the world), so every rank gets the same partition. On a GPU
    a time is the larger of the kernels' and the launches' (_time_cuda_ms), as a step pays it.
    """
    if repeats < 1:
        raise ValueError(f"measure_layer_costs: repeats={repeats}, expected >= 1")
    device = _device_of(sample)
    floor = _launch_floor_ms(device, repeats) if device.type == "cuda" else 0.0
    timed: dict[tuple, float] = {}
    costs, x = [], sample
    for i, layer in enumerate(layers):
        call = _callable(layer, device, dtype)
        last = loss_fn is not None and i == len(layers) - 1
        key = (layer_name(layer), _shapes(x), last)
        if key not in timed:
            timed[key] = _time_ms(lambda: _forward_backward(call, x, loss_fn if last else None, targets),
                                  device, repeats, floor)
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


def _time_ms(fn: Callable[[], None], device: torch.device, repeats: int, floor_ms: float = 0.0) -> float:
    if device.type == "cuda":
        return _time_cuda_ms(fn, device, repeats, floor_ms)
    fn()  # warm-up: kernels chosen, memory allocated
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1e3 / repeats


def _time_cuda_ms(fn: Callable[[], None], device: torch.device, repeats: int, floor_ms: float) -> float:
    """Milliseconds per call as a training step pays them: the larger of the GPU's time and the CPU's.

    A step launches kernels ahead of the GPU, so it runs at the slower of the two. Timing one
    layer between synchronisations instead adds the launches' latency, and this harness's own
    launches, to a small layer's kernels (the likely cause of the 1.3B GPT's micro-batch-1
    layers timing 41% over its run). The CPU's part is the launches less `floor_ms`, the
    harness's share (_launch_floor_ms).
    """
    gpu_ms, launch_ms = _cuda_times(fn, device, repeats)
    return max(gpu_ms, launch_ms - floor_ms)


def _cuda_times(fn: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, float]:
    """(GPU, CPU launch) milliseconds per call: the stream is held by a sleep kernel while the
    calls are launched, so the events around them time the GPU alone and the wall clock the
    launches alone. A sleep that ended before the launches did is doubled and tried again."""
    fn()  # warm-up: kernels chosen, memory allocated
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    hold_ms = 2e3 * repeats * (time.perf_counter() - start) + 1.0
    cycles = _cycles_per_ms(device)
    for _ in range(4):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold_ms * cycles))
        begin.record()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        launch_ms = (time.perf_counter() - start) * 1e3 / repeats
        held = not begin.query()  # the sleep outlasted the launches
        end.record()
        end.synchronize()
        if held:
            break
        hold_ms *= 2
    return begin.elapsed_time(end) / repeats, launch_ms


_CYCLES_PER_MS: dict[int, float] = {}


def _cycles_per_ms(device: torch.device) -> float:
    """torch.cuda._sleep's clock cycles per millisecond on `device`, timed once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_MS:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1 << 20)  # warm-up
        begin.record()
        torch.cuda._sleep(1 << 24)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[index] = (1 << 24) / max(begin.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[index]


def _launch_floor_ms(device: torch.device, repeats: int) -> float:
    """CPU milliseconds this harness spends per call around a layer that does nothing (its loss,
    the backward call): what a training step, one backward per micro-batch, does not pay per layer."""
    leaf = torch.ones(8, device=device)
    return _cuda_times(lambda: _forward_backward(lambda t: t.view_as(t), leaf, None, None), device, repeats)[1]


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
