"""Hugging Face causal LMs as layer specs: embedding, each decoder layer, final norm, LM head.

`hf_layer_specs` reads a checkpoint directory, a model or a config, finds the decoder structure on
a copy of the model built on the meta device (pipe/hf/model.py) and returns one spec per piece
(pipe/hf/layers.py), so each pipeline stage builds only its own layers, from the config, and
copies in only its own weights; `causal_lm_loss` is the loss to train them with. A module built
from the specs is read back under Hugging Face's names by pipe/hf/export.py, split over a tensor
group by pipe/hf/tensor.py: this module re-exports both, as `pipezero.pipe.hf` does.
transformers is an optional extra (`pip install -e ".[hf]"`).
"""

from __future__ import annotations

from typing import Any

import torch

from pipezero.pipe.fused_loss import HeadLogits, fused_cross_entropy
from pipezero.pipe.hf.export import hf_config, hf_parameter_names, hf_shapes, hf_state_dict  # noqa: F401
from pipezero.pipe.hf.layers import (HFDecoderLayer, HFFinalNorm, HFHead, HFHeadBias,  # noqa: F401
                                     HFPositions, HFTokenEmbedding, _tied_logits)
from pipezero.pipe.hf.layers import _HFLayer  # noqa: F401 - its old home: tests imported it from specs
from pipezero.pipe.hf.model import _Model, _source
from pipezero.pipe.hf.router import Routed
from pipezero.pipe.hf.tensor import hf_tensor_plan  # noqa: F401
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec

__all__ = ["HFDecoderLayer", "HFFinalNorm", "HFHead", "HFHeadBias", "HFPositions", "HFTokenEmbedding",
           "TIED_KEY", "causal_lm_loss", "hf_config", "hf_layer_specs", "hf_parameter_names", "hf_shapes",
           "hf_state_dict", "hf_tensor_plan"]

TIED_KEY = "embed"  # TiedLayerSpec key of a tied embedding and LM head


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
