"""Zero-bubble's W for Linear layers: the backward keeps each weight GEMM for later, W runs them.

A split schedule's I must produce the input gradient a chunk sends upstream; its W the
weight gradients. Splitting a finished autograd graph into those two parts (torch's
stage_backward_input / stage_backward_weight) walks the graph in Python on every
microbatch and runs one autograd call per parameter group: on a CPU-bound step (a GPU at
micro-batch 1) that doubles the backward. Zero-bubble implementations instead defer the
weight GEMM inside the linear layer itself (Qi et al. 2023, section 5; Megatron-LM keeps the
layer's input and output gradient and computes the weight gradient later). Here:

* PipelineModule(deferred_linear=True), the default, builds its plain `nn.Linear` modules as
  DeferringLinear (the same module, parameters and state_dict: only `forward` differs, and
  only while a WeightSink collects, which the runner does under a schedule that splits backward);
* while a sink collects (the runner's forward of one chunk and microbatch, and its backward,
  where activation checkpointing re-runs the forward), their forward records an autograd
  node whose backward returns the input gradient only and leaves (weight, bias, input,
  output gradient) in the sink;
* `WeightSink.apply()` (W) computes those weight and bias gradients and adds them to
  `.grad`, as autograd would, but without the post-accumulate hooks (the caller tells the
  optimizer: StepListener.collect_grad_sync).

Everything else (LayerNorm, embeddings, tensor-parallel DTensor weights, autocast regions,
frozen weights, a Linear whose input needs no gradient) keeps its gradient in the ordinary
backward; pipe/tensor_linear.py's plain tensor-parallel shards do defer (their all-reduces sit
in hooks around the Linear). Double backward is not supported.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferringLinear", "WeightSink", "collecting", "collecting_into", "current_sink", "defer_linear_weights",
           "has_deferring_linear"]

_collecting: "WeightSink | None" = None  # a process-global, not thread-local: autograd's device
                                         # threads re-run checkpointed forwards and must see it


class WeightSink:
    """The weight GEMMs one (chunk, microbatch) deferred: filled by its backward, run by W."""

    def __init__(self) -> None:
        self.deferring = 0  # forwards that deferred (the I/W split applies when > 0)
        self._pending: list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]] = []

    def __bool__(self) -> bool:
        return self.deferring > 0

    def keep(self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad: torch.Tensor) -> None:
        """A backward's deferred work: weight.grad += grad^T x, bias.grad += sum(grad)."""
        self._pending.append((weight, bias, x, grad))

    @torch.no_grad()
    def apply(self) -> bool:
        """Run the deferred weight GEMMs into .grad; True when any gradient was assigned."""
        ran = bool(self._pending)
        for weight, bias, x, grad in self._pending:
            g = grad.reshape(-1, grad.shape[-1])
            _accumulate(weight, g.t().mm(x.reshape(-1, x.shape[-1])))
            if bias is not None:
                _accumulate(bias, g.sum(0))
        self._pending.clear()
        return ran


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


@contextmanager
def collecting(sink: WeightSink | None) -> Iterator[None]:
    """DeferringLinear layers run inside defer their weight GEMMs into `sink` (None: they don't)."""
    global _collecting
    before, _collecting = _collecting, sink
    try:
        yield
    finally:
        _collecting = before


def current_sink() -> WeightSink | None:
    """The sink collecting now (None: none). With collecting_into, what a relay (pipe/expert/relay.py) keeps per
    side: a DualPipeV pair's forward and backward take turns mid-layer, each collecting into its own sink."""
    return _collecting


def collecting_into(sink: WeightSink | None) -> None:
    """Set the collecting sink (a relay's switch restores a side's own); elsewhere use `collecting`."""
    global _collecting
    _collecting = sink


class _LinearKeepingWeightGrad(torch.autograd.Function):
    """y = x W^T + b whose backward returns dx only and keeps W's and b's gradients in the sink.

    The parameters are not inputs of the node: autograd then has no edge to their gradient
    accumulators, whose post-accumulate hooks (a ZeRO optimizer's) would fire for nothing.
    """

    @staticmethod
    def forward(ctx, x, layer, sink):
        ctx.save_for_backward(x, layer.weight)
        ctx.layer, ctx.sink = layer, sink
        return F.linear(x, layer.weight, layer.bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        bias = ctx.layer.bias
        ctx.sink.keep(ctx.layer.weight, bias if bias is not None and bias.requires_grad else None, x, grad)
        return grad @ weight, None, None


class DeferringLinear(nn.Linear):
    """nn.Linear whose weight gradient is deferred into the collecting WeightSink, if any."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _collecting is None:  # no split backward: a plain Linear, traced into a compiled layer's graph
            return F.linear(x, self.weight, self.bias)
        return self._deferring(x, _collecting)

    @torch.compiler.disable  # a compiled layer (pipe/compile.py) breaks its graph here: W still gets the GEMM
    def _deferring(self, x: torch.Tensor, sink: WeightSink) -> torch.Tensor:
        if (not torch.is_grad_enabled() or not x.requires_grad or not self.weight.requires_grad
                or type(self.weight) is not nn.Parameter or type(x) is not torch.Tensor
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        sink.deferring += 1
        return _LinearKeepingWeightGrad.apply(x, self, sink)


def defer_linear_weights(module: nn.Module) -> int:
    """Make every plain nn.Linear inside `module` a DeferringLinear; returns how many.

    Subclasses of nn.Linear keep their own forward and are left alone.
    """
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = DeferringLinear
            count += 1
    return count


def has_deferring_linear(module: nn.Module) -> bool:
    """Does `module` hold a DeferringLinear (whose weight GEMMs a split schedule defers to W)?"""
    return any(isinstance(m, DeferringLinear) for m in module.modules())
