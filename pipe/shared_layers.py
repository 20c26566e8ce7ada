"""One module object placed on two pipeline ranks would silently become two diverging copies.

A layer list may hold nn.Module objects as they are. Each pipeline rank builds only its own
stages, so a module (or a parameter) that appears in the stages of two ranks is trained as one
copy per rank, and the copies drift apart from the first step. Every rank sees the whole list
and the same partition, so the check below raises the same ValueError on every rank before any
collective. Sharing on one rank (a block repeated inside a stage, or in two chunks of the same
rank) is real sharing and allowed; between ranks, TiedLayerSpec is the shared layer.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

__all__ = ["check_shared_layers"]


def check_shared_layers(layers: Sequence[Any], bounds: Sequence[int], ranks: Sequence[int]) -> None:
    """Refuse a module or parameter found in layers that live on different pipeline ranks.

    bounds: the partition ([first layer of each virtual stage..., len(layers)]); ranks: the
    pipeline rank of each virtual stage.
    """
    seen: dict[int, tuple[int, int, str]] = {}  # id of a module or parameter -> (layer, rank, what)
    for stage, rank in enumerate(ranks):
        for index in range(bounds[stage], bounds[stage + 1]):
            layer = layers[index]
            if not isinstance(layer, nn.Module):
                continue
            things = [(id(layer), type(layer).__name__)]
            things += [(id(p), f"parameter {name!r} of {type(layer).__name__}")
                       for name, p in layer.named_parameters()]
            for key, what in things:
                first = seen.setdefault(key, (index, rank, what))
                if first[1] != rank:
                    _refuse(first, (index, rank, what))


def _refuse(first: tuple[int, int, str], second: tuple[int, int, str]) -> None:
    (i, a, what_i), (j, b, what_j) = first, second
    same = "are the same module object"
    if "parameter" in what_i:  # one tensor under each layer's own name ('0.weight' and '1.weight')
        name_i, name_j = what_i.split(" of ")[0], what_j.split(" of ")[0].split(" ", 1)[1]
        same = f"share {name_i}" + (f" (layers[{j}]'s {name_j})" if name_i.split(" ", 1)[1] != name_j else "")
    raise ValueError(f"layers[{i}] ({what_i.split(' of ')[-1]}) and layers[{j}] ({what_j.split(' of ')[-1]}) "
                     f"{same}, placed on pipeline ranks {a} and {b}: each rank would train its own copy and "
                     f"the copies would diverge. To share a layer between stages, give both places "
                     f"TiedLayerSpec(key, ...) (the stages holding it all-reduce its gradients); otherwise pass "
                     f"separate modules")
