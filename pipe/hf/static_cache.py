"""A preallocated KV cache for hf_layer_specs' decoder layers: every decode step has the same shapes.

transformers' DynamicCache grows by one position per token, so every decode step has new
shapes and builds its mask again from Python: a 1B model's step is then launch-bound. Here
each layer's keys and values live in buffers [batch, kv_heads, capacity, head_dim] made at
the prefill; a step writes its positions at the cache columns held in a device tensor
(`index`), attention runs over all `capacity` columns, and the mask comes from two device
tensors, the columns written so far that are not left padding (`valid`) and `index`. After
the prefill the step's inputs (token, position, index, valid) are updated in place, so the
step can be captured once as a CUDA graph and replayed for each token (pipe/hf/generate.py).

The mask is the one transformers builds for its own generate: causal over cache columns (a
column counts left padding, as transformers' cache positions do), padding keys hidden, and
for sliding-window layers only the last `window` columns, (q - window, q]. A padding query
sees itself, so its softmax row is never empty (no NaN); its output is never read. sdpa
takes it as booleans (True: attend), eager attention as an additive float mask.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["STATIC_ATTENTION", "StaticKVCache"]

STATIC_ATTENTION = ("sdpa", "eager")  # config._attn_implementation values whose mask format this cache builds


class StaticKVCache:
    """Keys and values of every decoder layer of one microbatch, at fixed addresses for the whole call.

    The decoder layers' attention calls `update(keys, values, layer_idx)` as it calls a
    transformers Cache; HFDecoderLayer asks `attention_mask(window, dtype)` instead of
    building a mask from the cache's length.
    """

    def __init__(self, prompt_mask: torch.Tensor, capacity: int, attention: str):
        if attention not in STATIC_ATTENTION:
            raise ValueError(f"StaticKVCache(attention={attention!r}): expected one of {STATIC_ATTENTION}, the "
                             "attention implementations whose mask format it builds")
        batch, prompt = prompt_mask.shape
        if capacity < prompt:
            raise ValueError(f"StaticKVCache(capacity={capacity}): the prompt has {prompt} columns")
        self.capacity, self.attention = capacity, attention
        device = prompt_mask.device
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # keys written, not padding
        self.valid[:, :prompt] = prompt_mask.bool()
        self.index = torch.arange(prompt, device=device)  # the columns the next step writes
        self.columns = torch.arange(capacity, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = {}

    # -- what the layers call --------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [b, kv_heads, T, d] at `index`; return all capacity columns."""
        if layer_idx not in self.keys:  # the prefill: the dtype and device the layer computes in
            shape = (*key_states.shape[:2], self.capacity)
            self.keys[layer_idx] = key_states.new_zeros(*shape, key_states.size(-1))
            self.values[layer_idx] = value_states.new_zeros(*shape, value_states.size(-1))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.index, key_states)
        values.index_copy_(2, self.index, value_states)
        return keys, values

    def attention_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[b, 1, T, capacity]: the keys each of this step's queries sees (made once per fresh_masks and window)."""
        key = (window, dtype)
        if key not in self._masks:
            queries = self.index[:, None]
            seen = self.valid[:, None, :] & (self.columns <= queries)
            if window is not None:
                seen = seen & (self.columns > queries - window)
            seen = (seen | (self.columns == queries))[:, None]
            if self.attention == "eager":
                seen = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(
                    ~seen, torch.finfo(dtype).min)
            self._masks[key] = seen
        return self._masks[key]

    # -- what the decode loop calls ----------------------------------------------------------
    def fresh_masks(self) -> None:
        """Masks are made again from `valid` and `index` by the layers that follow. Called at the start
        of every step's forward, inside what a CUDA graph captures: a mask made outside (by the
        warm-up) would be a tensor the graph reads but nothing updates."""
        self._masks.clear()

    def start_decoding(self, prompt: int) -> None:
        """After the prefill: `index` becomes the fixed one-column tensor every decode step reads."""
        self.index = torch.full((1,), prompt, dtype=torch.long, device=self.valid.device)
        self.valid[:, prompt] = True

    def advance(self) -> None:
        """The next column, in place (the addresses a graph replays stay put)."""
        self.index.add_(1)
        self.valid.index_fill_(1, self.index, True)

    def free(self) -> None:
        self.keys.clear()
        self.values.clear()
        self._masks.clear()
