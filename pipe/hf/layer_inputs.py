"""What a Hugging Face decoder layer is called with besides its hidden states: mask and cos/sin.

A layer's attention kind (config.layer_types: full, sliding-window, chunked) picks its mask
builder among transformers' own mask functions. The mask and the rotary cos/sin depend only on
the micro-batch's position ids and padding mask, so the stage's layers share them
(`PerMicroBatch`), as the model's own forward makes them once for all its layers. They are
built eagerly, outside any compiled graph: traced, transformers' checks (plain causal? packed
sequences?) cannot read the data and always build a dense mask, which takes SDPA off its causal
kernel (on one H200, attention 2.4x slower; bench/RESULTS.md).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

__all__ = ["MASKS", "MIN_TRANSFORMERS", "PerMicroBatch", "check_transformers", "mask_builder", "mask_kind"]

MIN_TRANSFORMERS = (5, 24)  # pyproject's hf extra: the mask builders' keyword `cache=` (5.17 named it otherwise)


MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
         "chunked_attention": "create_chunked_causal_mask"}  # config.layer_types -> transformers.masking_utils


def mask_kind(config: Any, index: int) -> str:
    """Layer `index`'s attention kind (a key of MASKS), as the model picks its mask builder."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return kinds[index]
    return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"


def mask_builder(kind: str) -> Callable:
    """transformers.masking_utils' builder of the masks of `kind` (imported on first use: transformers
    is an optional extra)."""
    import transformers
    from transformers import masking_utils

    check_transformers(transformers.__version__)
    return getattr(masking_utils, MASKS[kind])


def check_transformers(version: str) -> None:
    """An older transformers fails deep inside a layer's first call: name the version and the fix now."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:  # a development build ("5.25.0.dev0" parses; anything stranger is let through)
        return
    if found < MIN_TRANSFORMERS:
        want = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"transformers {version} is older than pipezero's Hugging Face layers need ({want}): "
                          f"pip install -U 'transformers>={want}' (or pip install -U 'pipezero[hf]')")


class PerMicroBatch:
    """What every decoder layer of a stage derives alike from one micro-batch (its attention mask of
    each kind, the rotary cos/sin), made by the first layer that asks and reused by the rest.

    The micro-batch is known by its position ids and padding mask: the very tensors that pass from
    layer to layer (weak references: nothing here keeps them alive). Neither result needs a
    gradient. A new micro-batch (other tensors) clears the rest.
    """

    def __init__(self) -> None:
        self._inputs: tuple = ()
        self._values: dict = {}

    def get(self, positions: torch.Tensor, padding: torch.Tensor | None, key: tuple, make: Callable[[], Any]) -> Any:
        if not self._same(positions, padding):
            self._inputs = (weakref.ref(positions), None if padding is None else weakref.ref(padding))
            self._values = {}
        if key not in self._values:
            self._values[key] = make()
        return self._values[key]

    def _same(self, positions: torch.Tensor, padding: torch.Tensor | None) -> bool:
        if not self._inputs:
            return False
        held_positions, held_padding = self._inputs
        return held_positions() is positions and (padding is None if held_padding is None
                                                  else held_padding() is padding)
