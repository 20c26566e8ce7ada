"""Packed documents through a Hugging Face model's own attention module, with no [T, T] mask.

transformers builds a dense block-diagonal mask from packed position ids (quadratic memory,
and SDPA off its causal kernel). Here the decoder layers of a family that attends through
`sdpa` are built with an attention implementation of ours, registered in transformers'
attention interface (the model's attention module is unchanged: it computes q, k, v, the
rotary embedding and the output projection, and calls the registered function where it
would call sdpa). Called with the micro-batch's documents (`DOCUMENTS_KWARG`, found once per
micro-batch from the position ids), the function attends each document causally through
pipe/document_attention.py; called without (one document per row, padding, decoding), it is
transformers' own sdpa function, unchanged.

What the mask-free path does not do falls back to transformers' masks (HFDecoderLayer picks):
a family that attends through another implementation (Gemma 2's eager, for its attention
logit soft cap), attention logit soft caps, chunked attention, attention dropout in training,
and a sliding-window layer whose longest document is longer than the window (at most the
window, the window changes nothing).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from pipezero.pipe.document_attention import Documents, document_attention

__all__ = ["DOCUMENTS_KWARG", "IMPLEMENTATION", "documents_config", "supports_documents"]

IMPLEMENTATION = "pipezero_documents"  # the name registered in transformers' AttentionInterface
DOCUMENTS_KWARG = "pipezero_documents"  # the decoder layer's keyword carrying the Documents
_FEATURES = ("softcap", "s_aux", "sinks", "position_bias")  # attention arguments the mask-free path lacks


def supports_documents(config: Any, kind: str) -> bool:
    """Whether a layer of attention `kind` of this config can take the mask-free path."""
    return (config._attn_implementation == "sdpa" and kind in ("full_attention", "sliding_attention")
            and getattr(config, "attn_logit_softcapping", None) is None)


def documents_config(config: Any) -> Any:
    """A copy of config whose layers attend through the registered function (the original is untouched:
    the mask builders and the export read it)."""
    _register()
    layer_config = copy.deepcopy(config)  # deep: the setter also sets any sub-config
    layer_config._attn_implementation = IMPLEMENTATION
    return layer_config


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [B, H, T, D], k and v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    docs: Documents | None = kwargs.pop(DOCUMENTS_KWARG, None)
    if docs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    used = [name for name in _FEATURES if kwargs.get(name) is not None]
    if used or dropout or attention_mask is not None:
        raise ValueError(f"document attention got {used or ('dropout' if dropout else 'a mask')}, which it does "
                         "not compute; HFDecoderLayer should have taken transformers' masks for this layer")
    out = document_attention(query, key, value, docs, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(IMPLEMENTATION, _attention)
        _registered = True
