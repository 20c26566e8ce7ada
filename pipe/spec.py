"""Layer specs: a recipe for a layer, built only on the pipeline stage that owns it.

A model of many billions of parameters cannot be built whole on every rank and then cut;
a spec (class + arguments) lets each stage build only its own layers. A TiedLayerSpec marks
one weight shared by several stages (an embedding and the LM head that reuses it, as in
Press & Wolf 2017, "Using the Output Embedding to Improve Language Models").
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec", "layer_name", "count_parameters"]


class LayerSpec:
    """`cls(*args, **kwargs)`, deferred until the owning stage builds it."""

    def __init__(self, cls: type[nn.Module], *args: Any, **kwargs: Any):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"LayerSpec({cls!r}): the first argument must be an nn.Module subclass; "
                            "pass plain modules or callables directly in the layer list instead")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self) -> nn.Module:
        """Allocate the layer (on the current default device)."""
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        parts = [self.cls.__name__, *map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"{type(self).__name__}({', '.join(parts)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameter(s) are shared by every spec with the same `key`.

    On one rank all specs of a key use one module; across ranks the owners start from the
    same values (broadcast from the first owner) and sum their gradients before the step.
    `forward_fn(module, x)` replaces `module(x)`, e.g. `lambda emb, h: h @ emb.weight.t()`
    for an LM head that reuses the embedding.
    """

    def __init__(self, key: str, cls: type[nn.Module], *args: Any,
                 tied_weight_attr: str | tuple[str, ...] = "weight",
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None, **kwargs: Any):
        super().__init__(cls, *args, **kwargs)
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"TiedLayerSpec(key={key!r}): the key must be a Python identifier, e.g. 'embed'")
        self.key = key
        self.tied_weight_attrs = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        self.forward_fn = forward_fn

    def tied_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The shared parameters of a built module, checked to exist."""
        out = []
        for attr in self.tied_weight_attrs:
            param = getattr(module, attr, None)
            if not isinstance(param, nn.Parameter):
                raise ValueError(f"TiedLayerSpec(key={self.key!r}): {self.cls.__name__} has no parameter "
                                 f"{attr!r}; set tied_weight_attr to one of "
                                 f"{[n for n, _ in module.named_parameters(recurse=False)]}")
            out.append(param)
        return out

    def __repr__(self) -> str:
        return f"TiedLayerSpec(key={self.key!r}, {super().__repr__()[len('TiedLayerSpec('):]}"


def layer_name(layer: Any) -> str:
    """The class name a partition regex matches and the table shows."""
    if isinstance(layer, LayerSpec):
        return layer.cls.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_parameters(layer: Any) -> int:
    """Parameters a layer will hold, without allocating them (specs are built on the meta device)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            module = layer.build()
        return sum(p.numel() for p in module.parameters())
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    if callable(layer):
        return 0
    raise TypeError(f"layer {layer!r} is neither a LayerSpec, an nn.Module nor a callable")
