"""A module built from hf_layer_specs, read back under Hugging Face's names.

Its tensors whole (hf_state_dict), each parameter's names (hf_parameter_names), the whole shapes
(hf_shapes) and the config (hf_config): what train/checkpoint/ writes a Hugging Face checkpoint
from, or reads another framework's checkpoint of the same model with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipezero.comm import is_replica
from pipezero.pipe.hf.layers import _HFLayer
from pipezero.pipe.hf.model import _Model
from pipezero.pipe.spec import LayerSpec

__all__ = ["hf_config", "hf_parameter_names", "hf_shapes", "hf_state_dict"]


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
