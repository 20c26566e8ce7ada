"""Hugging Face causal LMs as layer specs: embedding, each decoder layer, final norm, LM head.

Users arrive with a Llama, Mistral, Qwen, Gemma, Phi, OLMo, Mixtral or GPT-2 checkpoint, not
with LayerSpecs. Those families share one structure: a module holding a token embedding, a
ModuleList of decoder layers, a final norm (and, per family, learned positions or a rotary
embedding), under a CausalLM with an `lm_head`. `hf_layer_specs` finds that structure on a
copy of the model built on the meta device (no memory) and returns one spec per piece, so
each pipeline stage builds only its own layers, from the config, and copies in only its own
weights, read by name from the checkpoint's safetensors shards. Nothing is written per
family: what a family's forward adds around its layers is read from the config (an
embedding scale: Gemma's sqrt(hidden), Granite's embedding_multiplier; a logit scale:
Cohere, Granite; a logit soft cap: Gemma 2/3), and a model whose structure differs gets an
error naming what was expected.

Between stages travels `(hidden, position_ids)` or `(hidden, position_ids, attention_mask)`
(the 2-D padding mask, 1 = token). The decoder layers compute the rotary cos/sin and build
the causal, sliding-window or chunked mask (config.layer_types) with transformers' own mask
functions, once per micro-batch and stage, so each layer is called exactly as the model's
forward calls it. A MoE trained with config.output_router_logits=True adds one last tensor, the
routers' running sums from which the last stage computes the load-balancing loss (pipe/hf/router.py).
transformers is imported here only: it is an optional extra (`pip install -e ".[hf]"`).
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.comm import is_replica
from pipezero.pipe.fused_loss import HeadLogits, fused_cross_entropy, hf_head_logits
from pipezero.pipe.document_attention import Documents, documents_from_positions
from pipezero.pipe.hf.document_attention import (DOCUMENTS_KWARG, IMPLEMENTATION, documents_config,
                                                 supports_documents)
from pipezero.pipe.hf.match import check_checkpoint, keeps_tie, size_fields
from pipezero.pipe.hf.layer_inputs import MASKS, PerMicroBatch, mask_builder, mask_kind
from pipezero.pipe.hf.router import Routed, RouterTap, as_routed, router_loss, split_stats
from pipezero.pipe.hf.static_cache import StaticKVCache
from pipezero.pipe.hf.weights import CheckpointTensors, ModelTensors
from pipezero.pipe.memory.recompute import in_selective_run
from pipezero.pipe.sequence.comms import gather_sequence, sum_over_sequence
from pipezero.pipe.sequence.hf_attention import (check_hf_sequence, register_ulysses, ulysses_around,
                                                 whole_mask_inputs)
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec
from pipezero.pipe.tensor_tokens import sum_over_tensor, token_share
from pipezero.pipe.tiled_mlp import tile_mlp, tile_norm

__all__ = ["HFDecoderLayer", "HFFinalNorm", "HFHead", "HFHeadBias", "HFPositions", "HFTokenEmbedding", "TIED_KEY",
           "causal_lm_loss", "hf_config", "hf_layer_specs", "hf_parameter_names", "hf_shapes", "hf_state_dict",
           "hf_tensor_plan"]

TIED_KEY = "embed"  # TiedLayerSpec key of a tied embedding and LM head


# -- the structure ---------------------------------------------------------------------------
class _Model:
    """What the specs share: the config, a meta copy of the whole model, the names, the weights."""

    def __init__(self, config: Any, weights: CheckpointTensors | ModelTensors | None, experts: str | None = None):
        from transformers import AutoModelForCausalLM

        chosen = {} if experts is None else {"experts_implementation": experts}  # the layers read the config's
        with torch.device("meta"):  # a copy of the config: sequence parallelism switches its attention
            self.meta = AutoModelForCausalLM.from_config(copy.deepcopy(config), **chosen)
        self.config, self.weights = self.meta.config, weights
        self.names = {id(m): name for name, m in self.meta.named_modules()}
        self.embed, self.head = self.meta.get_input_embeddings(), self.meta.get_output_embeddings()
        self.tied = self.head is not None and self.head.weight is getattr(self.embed, "weight", None)
        parts = _base_parts(self.meta, self.embed, self.config)
        self.layers, self.norm, self.positions, self.rotary, self.drop = parts
        _check_structure(self)
        if isinstance(weights, CheckpointTensors):
            weights.adopt_names(self.meta)
        if self.tied and weights is not None:
            self.tied = keeps_tie(self, weights)
        if isinstance(weights, CheckpointTensors):
            check_checkpoint(self.meta, self.config, weights, self.path(self.layers))
        self.embed_scale = getattr(self.embed, "scalar_embed_scale", None)
        self.embed_multiplier = getattr(self.config, "embedding_multiplier", None)
        self.layer_nones = _layer_nones(self)
        self.head_bias = self.tied and self.head.bias is not None
        self.fused_loss = False  # the head returns HeadLogits (hf_layer_specs(fused_loss=True))
        self.per_micro_batch = PerMicroBatch()  # the decoder layers' mask and cos/sin, made once
        self.sequence: tuple[Any, int] | None = None  # (group, degree) once split (pipe/sequence/)
        self.ulysses: dict[str, str] = {}  # once split: a layer's own kernel -> Ulysses around it
        self.router = router_loss(self.meta, self.config)  # output_router_logits: the balancing loss

    def split_sequence(self, group: Any, degree: int) -> None:
        """Every decoder layer's attention through Ulysses from now on (once per model)."""
        if self.sequence is None:
            register_ulysses(self.meta, group, degree)
            self.sequence = (group, degree)

    def ulysses_around(self, kernel: str) -> str:
        """The name of Ulysses around `kernel` on the split sequence group (registered once per kernel)."""
        if kernel not in self.ulysses:
            self.ulysses[kernel] = ulysses_around(kernel, *self.sequence)
        return self.ulysses[kernel]

    def path(self, module: nn.Module) -> str:
        """The module's name in the whole model, with a trailing dot ('model.layers.3.')."""
        return self.names[id(module)] + "."

    def fill(self, module: nn.Module, prefix: str) -> None:
        """Copy each parameter's checkpoint tensor in by name, or initialise it as the model would."""
        if any(p.device.type == "meta" for p in module.parameters()):
            return
        with torch.no_grad():
            for name, p in _persistent(module):
                full = prefix + name.removeprefix("inner.")
                value = self.weights.get(full) if self.weights is not None else None
                if value is None and self.weights is not None and isinstance(p, nn.Parameter):
                    raise ValueError(f"the checkpoint has no tensor {full!r}; it does not match its config "
                                     f"({type(self.meta).__name__})")
                if value is not None and value.shape != p.shape:  # merged experts: their shapes show once merged
                    sizes = {w for g, w in zip(value.shape, p.shape) if g != w}
                    raise ValueError(f"hf_layer_specs: the checkpoint's {full!r} has shape {tuple(value.shape)}, but "
                                     f"config.json builds {tuple(p.shape)} ({size_fields(self.config, sizes)}): the "
                                     "config does not match the weights")
                if value is not None:
                    p.copy_(value)
            if self.weights is None:
                for sub in module.modules():
                    self.meta._init_weights(sub)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the CausalLM's forward does to the head's output: Cohere's logit_scale, Granite's
        logits_scaling, Gemma's final_logit_softcapping (tanh(x / cap) * cap)."""
        scale = getattr(self.config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        divisor = getattr(self.config, "logits_scaling", None)
        if divisor is not None:
            logits = logits / divisor
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def __repr__(self) -> str:
        return f"<{type(self.meta).__name__}>"


def _persistent(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers (Apertus' activation constants): what a checkpoint holds."""
    yield from module.state_dict(keep_vars=True).items()


def _base_parts(meta: nn.Module, embed: nn.Module, config: Any) -> tuple:
    """(layers, norm, positions, rotary, dropout) among the children of the module holding the embedding."""
    base = next(m for m in meta.modules() if any(child is embed for child in m.children()))
    layers, norms, positions, rotary, drop, other = [], [], None, None, None, []
    for name, child in base.named_children():
        if child is embed:
            continue
        if isinstance(child, nn.ModuleList) and len(child) == config.num_hidden_layers:
            layers.append(child)
        elif isinstance(child, nn.Embedding) and type(child).forward is nn.Embedding.forward:
            positions = child
        elif isinstance(child, nn.Dropout):
            drop = child
        elif "RotaryEmbedding" in type(child).__name__:
            rotary = child
        elif "Norm" in type(child).__name__:  # OLMo's final LayerNorm has no parameters
            norms.append((name, child))
        else:
            other.append(f"{name} ({type(child).__name__})")
    if len(layers) != 1 or len(norms) != 1 or other:
        raise ValueError(
            f"hf_layer_specs: {type(meta).__name__} is not the decoder structure it reads: expected the module "
            f"holding its token embedding ({type(base).__name__}) to hold one ModuleList of num_hidden_layers="
            f"{config.num_hidden_layers} decoder layers, one final norm, optionally learned positions (a plain "
            f"nn.Embedding), dropout and a rotary embedding; found {len(layers)} layer lists, norms "
            f"{[name for name, _ in norms]}"
            + (f" and unrecognised {other}" if other else ""))
    return layers[0], norms[0][1], positions, rotary, drop


def _check_structure(model: _Model) -> None:
    name, embed = type(model.meta).__name__, model.embed
    plain = type(embed).forward is nn.Embedding.forward
    if not isinstance(embed, nn.Embedding) or not (plain or hasattr(embed, "scalar_embed_scale")):
        raise ValueError(f"hf_layer_specs: {name}'s input embedding is {type(embed).__name__}; expected an "
                         "nn.Embedding, plain or scaled by a constant `scalar_embed_scale` as Gemma's (a factorised "
                         "or otherwise computed embedding is not the decoder structure it reads)")
    odd = sorted(set(getattr(model.config, "layer_types", None) or ()) - set(MASKS))
    if odd:
        raise ValueError(f"hf_layer_specs: {name}'s config.layer_types has {odd}; expected attention layers of the "
                         f"kinds {sorted(MASKS)} (a layer of another kind is not the decoder structure it reads)")
    if getattr(model.config, "alibi", False) is True:  # Falcon: no layer argument says so since transformers 5.25
        raise ValueError(f"hf_layer_specs: {name} has config.alibi=True: its ALiBi position bias is made by the "
                         "model's forward (an argument of each decoder layer before transformers 5.25, folded into "
                         "the attention mask since), which this reader does not build; expected rotary or learned "
                         "positions (config.alibi=False)")
    if getattr(model.config, "use_bidirectional_attention", False):
        raise ValueError(f"hf_layer_specs: {name} has use_bidirectional_attention=True; expected a causal LM")
    if model.head is None or type(model.head) is not nn.Linear:
        raise ValueError(f"hf_layer_specs: {name}'s output embedding is {type(model.head).__name__}; expected an "
                         "nn.Linear lm_head (is this a causal LM?)")


def _layer_nones(model: _Model) -> dict[str, None]:
    """Arguments a decoder layer requires beyond those passed here, given as None where the config turns
    their feature off (Falcon's `alibi` when config.alibi is False); any other is a ValueError."""
    given = {"attention_mask", "position_ids", "position_embeddings"}
    nones: dict[str, None] = {}
    for cls in {type(layer) for layer in model.layers}:
        for p in list(inspect.signature(cls.forward).parameters.values())[2:]:  # after self, hidden states
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in given:
                continue
            if getattr(model.config, p.name, True) is not False:
                raise ValueError(f"hf_layer_specs: {cls.__name__}.forward requires {p.name!r}, which the model's "
                                 f"forward computes and this reader does not; expected a decoder layer called with "
                                 f"hidden states, {sorted(given)} (config.{p.name}="
                                 f"{getattr(model.config, p.name, 'absent')})")
            nones[p.name] = None
    return nones


def _source(source: Any) -> tuple[Any, CheckpointTensors | ModelTensors | None]:
    """(config, weights) of a directory, a PreTrainedModel or a config."""
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    if isinstance(source, (str, os.PathLike)):
        directory = Path(source)
        if not (directory / "config.json").exists():
            raise ValueError(f"hf_layer_specs({str(source)!r}): no config.json there; pass a directory written by "
                             "save_pretrained, a PreTrainedModel or a PretrainedConfig")
        try:
            config = AutoConfig.from_pretrained(directory)
        except OSError:
            raise  # transformers' own message names the file
        except Exception as err:  # noqa: BLE001 - transformers' validators raise their own types
            raise ValueError(f"{directory / 'config.json'}: transformers cannot read it: {err}") from err
        return config, CheckpointTensors(directory)
    if isinstance(source, PreTrainedModel):
        return source.config, ModelTensors(source)
    if isinstance(source, PretrainedConfig):
        return source, None
    raise TypeError(f"hf_layer_specs({source!r}): expected a checkpoint directory, a PreTrainedModel or a "
                    "PretrainedConfig")


# -- the layers ----------------------------------------------------------------------------
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
        """make(), once per micro-batch for the stage's layers; while decoding (a cache) or in a selectively
        checkpointed run (its recompute must run the forward's very ops: pipe/memory/recompute.py) every call."""
        if cache is not None or in_selective_run():
            return make()
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


# -- public -------------------------------------------------------------------------------
def hf_layer_specs(source: Any, fused_loss: bool = False, experts: str | None = None) -> list[LayerSpec]:
    """The LayerSpec / TiedLayerSpec list of a Hugging Face causal LM, for PipelineModule.

    source: a directory written by save_pretrained (each stage reads only its layers' tensors
    from the safetensors shards), a PreTrainedModel (weights copied from it by name) or a
    PretrainedConfig (random weights, initialised as the model initialises them; PipelineModule
    seeds each layer, so every grid builds the same values). Layers: token embedding,
    [learned positions], num_hidden_layers decoder layers, final norm, LM head (a TiedLayerSpec
    sharing the embedding when the model ties them) [, the tied head's own bias]. Train with
    loss_fn=causal_lm_loss. fused_loss: the head returns HeadLogits, so that causal_lm_loss never
    makes the logits whole (pipe/fused_loss.py). experts: a MoE's experts implementation, transformers'
    own switch ("grouped_mm": one grouped GEMM over the tokens sorted by expert, transformers'
    default where torch has it, CPU included; "batched_mm"; "eager": a loop over the experts).
    """
    config, weights = _source(source)
    model = _Model(config, weights, experts)
    model.fused_loss = fused_loss
    embed_spec = (TiedLayerSpec(TIED_KEY, HFTokenEmbedding, model) if model.tied
                  else LayerSpec(HFTokenEmbedding, model))
    specs = [embed_spec]
    if model.positions is not None:
        specs.append(LayerSpec(HFPositions, model))
    specs += [LayerSpec(HFDecoderLayer, model, i) for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(HFFinalNorm, model))
    specs.append(TiedLayerSpec(TIED_KEY, HFTokenEmbedding, model, forward_fn=_tied_logits) if model.tied
                 else LayerSpec(HFHead, model))
    if model.head_bias:
        specs.append(LayerSpec(HFHeadBias, model))
    return specs


def causal_lm_loss(logits: torch.Tensor | HeadLogits | Routed, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; targets of -100 (Hugging Face's ignore index) are skipped.
    Takes the logits or hf_layer_specs(fused_loss=True)'s HeadLogits; a model trained with
    config.output_router_logits=True gives them as Routed, and its load-balancing loss, weighed by
    router_aux_loss_coef, is added as transformers adds it (pipe/hf/router.py)."""
    if isinstance(logits, Routed):
        return fused_cross_entropy(logits.value, targets, ignore_index=-100) + logits.aux[0]
    return fused_cross_entropy(logits, targets, ignore_index=-100)


def hf_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters (and persistent buffers) under their Hugging Face names, whole.

    A collective over the tensor group when tensor-parallel (the split weights gathered), and
    over each expert group when the experts are split (pipe/expert/: every expert gathered); a
    tied weight or a tensor-replicated one appears only on its first owner (the copies are
    marked with comm.mark_replica).
    """
    from pipezero.pipe.expert import whole_experts
    from pipezero.pipe.tensor_parallel import is_replicated, whole_tensor

    out, experts = {}, whole_experts(module)
    for layer in module.modules():
        if isinstance(layer, _HFLayer):
            for name, p in layer.hf_parameters():
                if id(p) in experts:
                    out[name] = experts[id(p)]
                elif not is_replicated(p) or not is_replica(p):  # split: every tensor rank takes part
                    out[name] = whole_tensor(p).detach()
            out.update((name, t.detach()) for name, t in layer.hf_buffers())
    return out


def hf_parameter_names(module: nn.Module) -> dict[str, list[str]]:
    """Each of this rank's parameters, by `module`'s name, with its Hugging Face names: its own, then
    those of the weights tied to it in the whole model (an LM head reusing the embedding).

    How another framework's checkpoint of the Hugging Face model (DeepSpeed's) finds its tensors here;
    a ValueError when `module` holds no layer of hf_layer_specs.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, list[str]] = {}
    for layer in module.modules():
        if isinstance(layer, _HFLayer):
            tied: dict[int, list[str]] = {}
            for name, p in layer.model.meta.named_parameters(remove_duplicate=False):
                tied.setdefault(id(p), []).append(name)
            aliases = {name: group for group in tied.values() for name in group}
            for name, p in layer.hf_parameters():
                known = out.setdefault(names[id(p)], [])
                known += [n for n in [name, *aliases.get(name, [])] if n not in known]
    if not out and any(True for _ in module.parameters()):
        raise ValueError(f"{type(module).__name__} holds no layer of hf_layer_specs")
    return out


def hf_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """The whole shape of every tensor of the model under its Hugging Face name, from its config."""
    for layer in module.modules():
        if isinstance(layer, _HFLayer):
            return {name: t.shape for name, t in layer.model.meta.state_dict().items()}
    raise ValueError(f"{type(module).__name__} holds no layer of hf_layer_specs")


def hf_config(source: nn.Module | list[LayerSpec]) -> Any:
    """The Hugging Face config of hf_layer_specs' list, or of a module built from it."""
    if isinstance(source, (list, tuple)):
        models = [a for spec in source for a in spec.args if isinstance(a, _Model)]
        if models:
            return models[0].config
    else:
        for layer in source.modules():
            if isinstance(layer, _HFLayer):
                return layer.model.config
    raise ValueError(f"{type(source).__name__} holds no layer of hf_layer_specs")


from pipezero.pipe.hf.tensor import hf_tensor_plan  # noqa: E402 - it reads HFDecoderLayer above
