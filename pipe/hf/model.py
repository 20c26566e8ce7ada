"""The shared structure of a Hugging Face causal LM, read from a copy of it on the meta device.

Users arrive with a Llama, Mistral, Qwen, Gemma, Phi, OLMo, Mixtral or GPT-2 checkpoint, not
with LayerSpecs. Those families share one structure: a module holding a token embedding, a
ModuleList of decoder layers, a final norm (and, per family, learned positions or a rotary
embedding), under a CausalLM with an `lm_head`. `_Model` finds that structure on a copy of the
model built on the meta device (no memory) and holds what every layer of hf_layer_specs shares:
the config, the names, and the weights, read by name from the checkpoint's safetensors shards
(`fill`). Nothing is written per family: what a family's forward adds around its layers is read
from the config (an embedding scale: Gemma's sqrt(hidden), Granite's embedding_multiplier; a logit
scale: Cohere, Granite; a logit soft cap: Gemma 2/3), and a model whose structure differs gets an
error naming what was expected. `_source` reads hf_layer_specs' argument (a directory, a model or
a config). transformers is imported inside the functions: it is an optional extra.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from pipezero.pipe.hf.layer_inputs import MASKS, PerMicroBatch
from pipezero.pipe.hf.match import check_checkpoint, keeps_tie, size_fields
from pipezero.pipe.hf.router import router_loss
from pipezero.pipe.hf.weights import CheckpointTensors, ModelTensors
from pipezero.pipe.sequence.hf_attention import register_ulysses, ulysses_around

__all__: list[str] = []  # the adapter's own machinery: hf_layer_specs (specs.py) is the public door


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
