"""The pipeline layers of a Hugging Face causal LM: embedding, [positions,] decoder layers, final norm, head.

Each holds its piece of the model (built from the config, filled with its own weights by
_Model.fill: pipe/hf/model.py) and calls it as the model's forward does. Between stages travels
`(hidden, position_ids)` or `(hidden, position_ids, attention_mask)` (the 2-D padding mask,
1 = token). The decoder layers compute the rotary cos/sin and build the causal, sliding-window or
chunked mask (config.layer_types) with transformers' own mask functions, once per micro-batch and
stage, so each layer is called exactly as the model's forward calls it. A MoE trained with
config.output_router_logits=True adds one last tensor, the routers' running sums from which the
last stage computes the load-balancing loss (pipe/hf/router.py).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.pipe.document_attention import Documents, documents_from_positions
from pipezero.pipe.fused_loss import HeadLogits, hf_head_logits
from pipezero.pipe.hf.document_attention import (DOCUMENTS_KWARG, IMPLEMENTATION, documents_config,
                                                 supports_documents)
from pipezero.pipe.hf.layer_inputs import mask_builder, mask_kind
from pipezero.pipe.hf.model import _Model, _persistent
from pipezero.pipe.hf.router import Routed, RouterTap, as_routed, split_stats
from pipezero.pipe.hf.static_cache import StaticKVCache
from pipezero.pipe.memory.recompute import in_selective_run, recomputed_matmuls
from pipezero.pipe.sequence.comms import gather_sequence, sum_over_sequence
from pipezero.pipe.sequence.hf_attention import check_hf_sequence, whole_mask_inputs
from pipezero.pipe.tensor_tokens import sum_over_tensor, token_share
from pipezero.pipe.tiled_mlp import tile_mlp, tile_norm

__all__ = ["HFDecoderLayer", "HFFinalNorm", "HFHead", "HFHeadBias", "HFPositions", "HFTokenEmbedding"]


class _HFLayer(nn.Module):
    """A piece of the model whose parameters are `prefix + name` in the Hugging Face layout."""

    prefix: str
    model: _Model

    def hf_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(Hugging Face name, parameter) of each parameter."""
        for name, p in self.named_parameters():
            yield self.prefix + name.removeprefix("inner."), p

    def hf_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, buffer) of each buffer the checkpoint holds (persistent ones)."""
        params = {id(p) for p in self.parameters()}
        for name, t in _persistent(self):
            if id(t) not in params:
                yield self.prefix + name.removeprefix("inner."), t


class HFTokenEmbedding(_HFLayer):
    """input_ids, or (input_ids, attention_mask[, position_ids]) -> (hidden, position_ids[, mask]).

    Holds the token embedding as its own `weight`, so a tied LM head can share it
    (TiedLayerSpec); positions default to 0..T-1, as the model's forward does. The hidden
    states are scaled as the model scales them: by the embedding's constant (Gemma's
    sqrt(hidden), rounded to the weight's dtype as Gemma rounds it), then by
    config.embedding_multiplier (Granite).
    """

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.prefix = model, model.path(model.embed)
        self.padding_idx = model.embed.padding_idx
        self.weight = nn.Parameter(torch.empty_like(model.embed.weight, device=torch.get_default_device()))
        if self.weight.device.type != "meta":
            if model.weights is None:
                with torch.no_grad():
                    self.weight.copy_(_init_embedding(model, self.weight))
            else:
                model.fill(self, self.prefix)

    def forward(self, x: Any) -> tuple:
        ids, *rest = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        mask = rest[0] if rest else None
        if len(rest) > 1:
            positions = rest[1]
        else:
            positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape).contiguous()
        hidden = F.embedding(ids, self.weight, self.padding_idx)
        if self.model.embed_scale is not None:
            hidden = hidden * torch.tensor(self.model.embed_scale, device=hidden.device).to(hidden.dtype)
        if self.model.embed_multiplier is not None:
            hidden = hidden * self.model.embed_multiplier
        out = (hidden, positions) if mask is None else (hidden, positions, mask, *rest[2:])  # [2:]: a decode cache
        if self.model.router is not None and all(isinstance(t, torch.Tensor) for t in rest[2:]):
            out += (self.model.router.zeros(hidden.device),)  # the routers' running sums (pipe/hf/router.py)
        return out


def _init_embedding(model: _Model, weight: nn.Parameter) -> torch.Tensor:
    embed = nn.Embedding(*weight.shape, padding_idx=model.embed.padding_idx, device=weight.device)
    model.meta._init_weights(embed)
    return embed.weight


class HFPositions(_HFLayer):
    """Learned positions (GPT-2's wpe) added to the hidden states, then the embedding dropout."""

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.prefix = model, model.path(model.positions)
        self.inner = _materialise(model.positions)
        self.drop = copy.deepcopy(model.drop) if model.drop is not None else nn.Identity()
        model.fill(self, self.prefix)

    def forward(self, x: tuple) -> tuple:
        hidden, positions, *rest = x
        return (self.drop(hidden + self.inner(positions)), positions, *rest)


class HFDecoderLayer(_HFLayer):
    """Decoder layer `index`, called as the model's forward calls it (mask, position ids, rotary cos/sin).

    A rotary embedding whose forward takes a `layer_type` (Gemma 3, OLMo 3: other frequencies
    for sliding-window layers) gets config.layer_types[index], as the model passes it.

    The mask and cos/sin are made eagerly, once per micro-batch for the stage's layers
    (pipe/hf/layer_inputs.py); compiling compiles the transformers layer alone (`compiled_part`).
    """

    compiled_part = "inner"  # pipe/compile.py compiles self.inner; the mask and rotary stay eager

    def __init__(self, model: _Model, index: int):
        super().__init__()
        self.model, self.index = model, index
        self.prefix = model.path(model.layers[index])
        self.attention_kind = mask_kind(model.config, index)
        self.documents = supports_documents(model.config, self.attention_kind)  # packed rows without a mask
        self.layer_config = documents_config(model.config) if self.documents else model.config
        self.inner = type(model.layers[index])(self.layer_config, layer_idx=index)
        mlp = getattr(self.inner, "mlp", None)
        if isinstance(mlp, nn.Module) and type(mlp).__name__.endswith("MLP"):  # dense, per token (not MoE)
            tile_mlp(mlp)
        _tile_norms(self.inner)
        self.rotary = type(model.rotary)(config=model.config) if model.rotary is not None else None
        self.make_mask = mask_builder(self.attention_kind)
        sliding = self.attention_kind == "sliding_attention"
        self.window = getattr(model.config, "sliding_window", None) if sliding else None  # the static cache's mask
        self.tap = RouterTap(self.inner, model.router.router_class) if model.router is not None else None
        takes_kind = self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.rotary_args = (model.config.layer_types[index],) if takes_kind else ()
        model.fill(self, self.prefix)

    @classmethod
    def check_sequence(cls, model: _Model, index: int, degree: int, tensor: int = 1) -> None:
        """Refuse a sequence degree this layer's heads (each tensor rank's: hf_tensor_plan splits them
        first) cannot be split by (SplitsSequence; every rank)."""
        check_hf_sequence(model.meta, degree, f"hf_layer_specs: {type(model.meta).__name__}", tensor)

    def split_sequence(self, group: Any, degree: int) -> None:
        """Attention through Ulysses on this rank's slice of the sequence (pipe/sequence/); a mask-free
        layer's own config (documents_config) to Ulysses around the documents function, which then
        attends each document of the whole sequence (_documents: from the gathered position ids)."""
        self.model.split_sequence(group, degree)
        if self.documents:
            self.layer_config._attn_implementation = self.model.ulysses_around(IMPLEMENTATION)

    def forward(self, x: tuple) -> tuple:
        hidden, positions, *rest = x
        rest, stats = split_stats(self.model.router, rest)
        cache = rest[1] if len(rest) > 1 else None  # a transformers Cache: pipe/hf/generate.py's decode path
        padding = rest[0] if rest else None
        extra = dict(self.model.layer_nones, **({} if cache is None else {"cache": cache, "use_cache": True}))
        if self.rotary is not None:
            extra["position_embeddings"] = self._shared(
                ("rotary", self.rotary_args, hidden.dtype, hidden.device), positions, padding, cache,
                lambda: self.rotary(hidden, positions, *self.rotary_args))
        docs = self._documents(positions, padding, cache)
        if docs is not None:  # packed rows: each document attended alone, no mask (pipe/hf/document_attention.py)
            mask, extra[DOCUMENTS_KWARG] = None, docs
        elif isinstance(cache, StaticKVCache):  # pipe/hf/generate.py's static decode step
            mask = cache.attention_mask(self.window, hidden.dtype)
        else:
            mask = self._shared(("mask", self.attention_kind, hidden.dtype), positions, padding, cache,
                                lambda: self._mask(hidden, positions, padding, cache))
        if stats is None:
            out = self.inner(hidden, attention_mask=mask, position_ids=positions, **extra)
            return (out[0] if isinstance(out, tuple) else out, positions, *rest)
        with self.tap.catching() as caught:
            out = self.inner(hidden, attention_mask=mask, position_ids=positions, **extra)
        return (out[0] if isinstance(out, tuple) else out, positions, *rest,
                self._add_routers(stats, caught, padding, hidden.shape[:-1].numel()))

    def _add_routers(self, stats: torch.Tensor, caught: list[torch.Tensor], padding: torch.Tensor | None,
                     rows: int) -> torch.Tensor:
        """stats + this layer's routers' sums. A MoE block on this tensor rank's share of the rows (hf_tensor_plan,
        pipe/tensor_tokens.py) routed those only: their sums, padded rows left out, added over the tensor group."""
        share = next((s for s in map(token_share, self.inner.children()) if s is not None), None)
        if share is None:
            for logits in caught:
                stats = self.model.router.add_layer(stats, logits, padding)
            return stats
        mine = self.model.router.zeros(stats.device)
        for logits in caught:
            mine = self.model.router.add_layer(mine, logits, share.row_weights(padding, rows, logits.device))
        return stats + sum_over_tensor(mine, share)

    def _documents(self, positions: torch.Tensor, padding: torch.Tensor | None, cache: Any) -> Documents | None:
        """The micro-batch's documents where the mask-free path serves this layer; None: transformers' mask
        (one document per row, where it is no mask; padding; decoding; a document longer than the window).
        A slice of the sequence (pipe/sequence/): the whole sequence's documents, the same on every rank of
        the sequence group (attention runs on whole sequences after Ulysses' exchange)."""
        dropout = self.training and getattr(self.model.config, "attention_dropout", 0.0)
        if not self.documents or padding is not None or cache is not None or dropout:
            return None
        docs = self._shared(("documents",), positions, None, None, lambda: documents_from_positions(
            positions if self.model.sequence is None else gather_sequence(positions, *self.model.sequence)))
        if docs.single or (self.window is not None and docs.longest > self.window):
            return None
        return docs

    def _shared(self, key: tuple, positions: torch.Tensor, padding: torch.Tensor | None, cache: Any,
                make: Callable[[], Any]) -> Any:
        """make(), once per micro-batch for the stage's layers; while decoding (a cache) every call. In a
        selectively checkpointed run, shared only where torch's checkpoint does not see the ops (a hit in
        the forward and a miss in the recompute, another micro-batch between them, would differ), else
        made by every layer (pipe/memory/recompute.py's in_selective_run)."""
        if cache is not None:
            return make()
        if in_selective_run():
            with recomputed_matmuls() as unseen:
                return self.model.per_micro_batch.get(positions, padding, key, make) if unseen else make()
        return self.model.per_micro_batch.get(positions, padding, key, make)

    def _mask(self, hidden: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor | None, cache: Any) -> Any:
        """transformers' mask for this layer's attention kind (None where SDPA's causal kernel does)."""
        sized = {} if cache is None else {"layer_idx": self.index}
        if self.model.sequence is not None and cache is None:  # a slice: the mask of the whole sequence
            hidden, positions, padding = whole_mask_inputs(hidden, positions, padding, *self.model.sequence)
        return self.make_mask(config=self.model.config, inputs_embeds=hidden, attention_mask=padding, cache=cache,
                              position_ids=positions, **sized)


def _is_norm(module: nn.Module) -> bool:
    """A norm over the last dim (each token alone), by the class names transformers gives them."""
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _tile_norms(layer: nn.Module) -> None:
    """The decoder layer's own norms (not those inside its attention) in row tiles (pipe/tiled_mlp.py)."""
    for child in layer.children():
        if _is_norm(child):
            tile_norm(child)


class HFFinalNorm(_HFLayer):
    """(hidden, ...) -> the final norm of hidden: what the LM head reads."""

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.prefix = model, model.path(model.norm)
        self.inner = tile_norm(_materialise(model.norm)) if _is_norm(model.norm) else _materialise(model.norm)
        self.sequence_group: Any = None  # once split: the routers' sums are added over it
        model.fill(self, self.prefix)

    @classmethod
    def check_sequence(cls, model: _Model, degree: int, tensor: int = 1) -> None:
        """Any degree: the norm is per token, the routers' sums add up over the slices."""

    def split_sequence(self, group: Any, degree: int) -> None:
        """A routed model's load-balancing loss reads the whole rows' sums: each slice's, added over the
        sequence group (SplitsSequence; pipe/hf/router.py)."""
        self.sequence_group = group

    def forward(self, x: tuple) -> torch.Tensor | Routed:
        rest, stats = split_stats(self.model.router, x[2:])
        hidden = self.inner(x[0] if len(rest) < 2 else x[0][:, -1:])  # decoding (a cache follows): the last position
        if stats is None:
            return hidden
        if self.sequence_group is not None:
            stats = sum_over_sequence(stats, self.sequence_group)
        return Routed(hidden, torch.stack([self.model.router.coef * self.model.router.balance(stats)]))  # no view


class HFHead(_HFLayer):
    """An untied LM head: hidden -> logits (scaled or capped as the model's forward does)."""

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.prefix = model, model.path(model.head)
        self.inner = _materialise(model.head)
        model.fill(self, self.prefix)

    def forward(self, hidden: torch.Tensor | Routed) -> torch.Tensor | HeadLogits | Routed:
        hidden = as_routed(self.model.router, hidden)
        if isinstance(hidden, Routed):
            return hidden.map(self)
        if self.model.fused_loss:
            return hf_head_logits(self.model.config, hidden, self.inner.weight, self.inner.bias)
        return self.model.finish_logits(self.inner(hidden))


class HFHeadBias(_HFLayer):
    """The bias of an LM head whose weight is tied to the embedding (Phi, GPT-J tied): logits + bias.

    The tied head's weight lives in the embedding's module (TiedLayerSpec), its bias here,
    so this layer follows the tied head and finishes the logits as the model's forward does.
    """

    def __init__(self, model: _Model):
        super().__init__()
        self.model, self.prefix = model, model.path(model.head)
        head = _materialise(model.head)
        if model.weights is None and head.bias.device.type != "meta":
            model.meta._init_weights(head)
        self.bias = head.bias
        model.fill(self, self.prefix)

    def forward(self, logits: torch.Tensor | HeadLogits | Routed) -> torch.Tensor | HeadLogits | Routed:
        logits = as_routed(self.model.router, logits)
        if isinstance(logits, Routed):
            return logits.map(self)
        if isinstance(logits, HeadLogits):
            return logits.with_bias(self.bias)
        return self.model.finish_logits(logits + self.bias)


def _tied_logits(embedding: HFTokenEmbedding, hidden: torch.Tensor | Routed) -> torch.Tensor | Routed:
    """The tied LM head: logits from the embedding's weight (finished here unless a bias layer follows)."""
    hidden = as_routed(embedding.model.router, hidden)
    if isinstance(hidden, Routed):
        return hidden.map(lambda h: _tied_logits(embedding, h))
    if embedding.model.fused_loss:
        return hf_head_logits(embedding.model.config, hidden, embedding.weight)
    logits = F.linear(hidden, embedding.weight)
    return logits if embedding.model.head_bias else embedding.model.finish_logits(logits)


def _materialise(meta: nn.Module) -> nn.Module:
    """A copy of a meta submodule with real (uninitialised) storage on the default device."""
    return copy.deepcopy(meta).to_empty(device=torch.get_default_device())
