"""Zero-bubble's split backward: I (the input gradient) now, W (the weight gradients) later.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split B into I
and W. Two ways, picked per (chunk, microbatch):

* deferred (pipe/deferred_linear.py), when the chunk's forward ran Linear layers that kept
  their weight GEMMs for later: I is the ordinary backward without those GEMMs (every other
  gradient, with its hooks, lands in I; on the first stage too), W runs them. It costs what B
  costs, plus the GEMMs' bookkeeping.
* graph split, for chunks without such layers (tensor-parallel DTensor weights, custom
  layers): I uses torch's pipelining helper stage_backward_input, which keeps the gradients at
  the weight-using nodes; W then computes only the weight gradients from them
  (stage_backward_weight). Exact for any layer, but it walks the graph in Python and makes an
  autograd call per parameter group every microbatch (twice B's time when the host is the
  bottleneck). Without those helpers (a private torch module) W re-runs the retained graph's
  backward: exact, at one more backward-input. On the first stage (its inputs need no
  gradient) I is empty and W is the whole backward.

A chunk with checkpointed layers (pipe/memory/recompute.py) does not take the graph split: torch's
split makes several backward calls over the chunk and each recomputes the checkpointed forward (a
fully checkpointed chunk ran its forward four times, not twice), and a selective checkpoint's kept
matmul outputs serve one backward call only (torch frees them as it reads them). Such a chunk, when
it has no deferred GEMMs, runs its whole backward in I (`whole=True`) and W has nothing left to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipezero.pipe.deferred_linear import WeightSink, collecting

__all__ = ["WeightGrad", "backward_input"]

try:  # torch's split backward (private, present in torch 2.11-2.13); else W re-runs the backward
    from torch.distributed.pipelining._backward import stage_backward_input as _stage_backward_input
    from torch.distributed.pipelining._backward import stage_backward_weight as _stage_backward_weight
except ImportError:  # pragma: no cover
    _stage_backward_input = _stage_backward_weight = None


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _custom_nodes_held_weakly() -> bool:
    """Does this torch free a custom autograd.Function's node once nothing in the graph refers to it, though
    Python still holds the node (torch 2.11 does, 2.13 keeps it)? stage_backward_input keeps the nodes W
    starts from in Python and cuts the outputs' graph, so there they went before W ("Attribute
    '_input_metadata' is invalid for this instance of _C._FunctionBase")."""
    node = _Probe.apply(torch.zeros(1, requires_grad=True)).grad_fn
    try:
        node._input_metadata
    except RuntimeError:
        return True
    return False


_WEAK_NODES = _custom_nodes_held_weakly()


@dataclass(frozen=True)
class WeightGrad:
    """What W needs, kept by I: torch's parameter groups (`groups`), a backward still to run
    (`backward`: outputs and their gradients), or the deferred Linear GEMMs (`sink`). `anchors`: aliases
    of the outputs that hold their graph until W, where torch holds a custom Function's node weakly."""

    groups: tuple | None = None     # (weights, intermediate gradient groups) for stage_backward_weight
    backward: tuple | None = None   # (outputs, their gradients)
    sink: WeightSink | None = None
    anchors: tuple = ()

    def run(self) -> bool:
        """Compute the weight gradients; True when some .grad was assigned without autograd hooks
        (the caller then tells the optimizer: StepListener.collect_grad_sync)."""
        if self.groups is not None:
            weights, groups = self.groups
            _stage_backward_weight(iter(weights), groups)
        if self.backward is not None:
            torch.autograd.backward(*self.backward)
        deferred = self.sink.apply() if self.sink is not None else False
        return self.groups is not None or deferred


def backward_input(outs: list, grads: list, leaves: list, weights: list,
                   sink: WeightSink | None = None, whole: bool = False) -> tuple[Sequence, WeightGrad]:
    """I: the gradients of `leaves` (the chunk's inputs) now, and what W needs later.

    `weights` are the chunk's parameters that need gradients; `grads` is [None] for a loss;
    `sink` collected the chunk's deferring Linear layers during its forward (or None); `whole`: no graph
    split, the whole backward now unless I has nothing to compute (checkpointed layers: one recompute).
    """
    if sink:  # Linear weight GEMMs wait in the sink; everything else runs now, hooks included
        with collecting(sink):  # a checkpointed layer's forward re-runs as it first ran
            torch.autograd.backward(outs, grads)
        return tuple(t.grad for t in leaves), WeightGrad(sink=sink)
    if not leaves:
        return (), WeightGrad(backward=(outs, grads))
    if whole:
        torch.autograd.backward(outs, grads)
        return tuple(t.grad for t in leaves), WeightGrad()
    if _stage_backward_input is not None:
        anchors = tuple(t.view_as(t) for t in outs if t.requires_grad) if _WEAK_NODES else ()
        in_grads, groups = _stage_backward_input(outs, None if grads == [None] else grads, leaves, iter(weights))
        return in_grads, WeightGrad(groups=(weights, groups), anchors=anchors)
    in_grads = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    return in_grads, WeightGrad(backward=(outs, grads))
