"""Which layers split the sequence, and the one call that splits a PipelineModule's.

A layer that mixes tokens (attention; a routed MoE's final norm, whose load-balancing loss reads
the routers' sums over every token) and can run on a slice of the sequence implements
`SplitsSequence`: `check_sequence` (a classmethod on the spec's arguments, so every rank refuses
a bad degree before any collective, whether or not it builds the layer; `tensor` is the tensor
degree a tensor plan splits its heads by first, 1 without a plan) and `split_sequence`
(from now on, exchange with the sequence group). Per-token layers (embeddings, norms, MLPs, the
head) need nothing: they run on the slice as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from torch import nn

from pipezero.pipe.sequence.loss import shard_loss

__all__ = ["SplitsSequence", "split_sequence"]


@runtime_checkable
class SplitsSequence(Protocol):
    """A layer that mixes tokens and runs on a slice of the sequence once split."""

    @classmethod
    def check_sequence(cls, *args: Any, degree: int, tensor: int = 1, **kwargs: Any) -> None: ...

    def split_sequence(self, group: Any, degree: int) -> None: ...


def split_sequence(specs: Sequence[Any], layers: nn.Module, loss_fn: Callable | None, grid: Any,
                   tensor_split: bool = False) -> Callable | None:
    """Check every spec's layer against the sequence degree (on every rank), split the built ones,
    and return the loss function each shard computes (pipe/sequence/loss.py).

    tensor_split: a tensor plan splits the layers' heads over the grid's tensor axis, so each
    tensor rank exchanges its own heads / tensor within its sequence group (checked so)."""
    degree = grid.sequence_size
    splitting = [spec for spec in specs if issubclass(spec.cls, SplitsSequence)]
    if not splitting:
        raise ValueError(f"sequence parallelism of degree {degree} on {grid!r}: none of the {len(specs)} layers "
                         "mixes tokens through a split attention (SplitsSequence: hf_layer_specs' decoder layers, "
                         "the GPT's blocks), so each rank would attend within its slice only; use those layers "
                         "or sequence=1")
    tensor = grid.tensor_size if tensor_split else 1
    for spec in splitting:
        spec.cls.check_sequence(*spec.args, degree=degree, tensor=tensor, **spec.kwargs)
    for layer in layers.modules():
        if isinstance(layer, SplitsSequence):
            layer.split_sequence(grid.sequence_group, degree)
    if loss_fn is None:
        return None
    return shard_loss(loss_fn, grid.sequence_group, degree)
