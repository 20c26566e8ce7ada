"""Ulysses around a Hugging Face model's own attention, through transformers' attention interface.

The model stays unmodified: its attention modules look their kernel up by name
(config._attn_implementation) in transformers' AttentionInterface. `register_ulysses` registers
a function under a new name that exchanges queries, keys and values all-to-all, calls the kernel
the model had (sdpa, flash, flex, or eager: the eager_attention_forward its own modeling file
defines, which keeps a family's rules such as Gemma 2's soft-capped logits) on whole sequences of
its heads, and exchanges the output back (pipe/sequence/attention.py); the mask builders get the
kernel's own mask function under the same name, and the model is switched to that name with its
public set_attn_implementation.
The mask itself is built for the whole sequence (the decoder layer gathers the position ids and
padding of the slices: pipe/hf/layers.py), so packed documents and sliding windows hold across
shard boundaries. `ulysses_around` wraps any registered function the same way: the decoder
layers of packed rows wrap pipe/hf/document_attention.py's, which attends each document of the
whole sequence (found from the gathered position ids) with no mask. transformers is imported on
first use (an optional extra).
"""

from __future__ import annotations

import importlib
import itertools
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from pipezero.pipe.sequence.attention import Ulysses, check_heads
from pipezero.pipe.sequence.comms import gather_sequence

__all__ = ["check_hf_sequence", "register_ulysses", "ulysses_around", "whole_mask_inputs"]

_NAMES = itertools.count()
_INNER: dict[str, str] = {}  # a registered name -> the kernel it wraps


def check_hf_sequence(model: Any, degree: int, where: str, tensor: int = 1) -> None:
    """Refuse what Ulysses cannot split (pure: every rank raises): heads the degree does not divide
    (each tensor rank's when a tensor plan splits them over `tensor`), an eager kernel whose model
    defines no eager function of its own to call."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    check_heads(heads, kv_heads, degree, where, tensor)
    _kernel_function(model, _kernel(config), where)


def register_ulysses(model: Any, group: Any, degree: int) -> str:
    """Switch a PreTrainedModel (and the layers built from its config) to Ulysses around its kernel;
    returns the registered name. The model's config is changed: give it a copy it owns."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    kernel = _kernel(model.config)
    name = ulysses_around(kernel, group, degree, _kernel_function(model, kernel, type(model).__name__))
    if kernel in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    model.set_attn_implementation(name)
    return name


def ulysses_around(kernel: str, group: Any, degree: int, function: Any = None) -> str:
    """Register Ulysses around the attention function registered as `kernel` (or around `function`,
    the kernel's own: a model's eager one); returns the new name (for a config's
    _attn_implementation; no mask function: the caller's mask builders keep theirs)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"pipezero_ulysses_{next(_NAMES)}"
    attend = ALL_ATTENTION_FUNCTIONS[kernel] if function is None else function
    AttentionInterface.register(name, _ulysses_function(attend, kernel, group, degree))
    _INNER[name] = kernel
    return name


def _kernel(config: Any) -> str:
    """The kernel a config attends with, under any Ulysses registered around it (unset: eager, as
    transformers' lookup falls back to the model's own function)."""
    current = config._attn_implementation
    return _INNER.get(current, current) or "eager"


def _kernel_function(model: Any, kernel: str, where: str) -> Any:
    """The function Ulysses calls on whole sequences: the kernel registered in transformers' attention
    interface, or for eager (never registered: each model passes its own as the lookup's default) the
    one the model's modeling file defines, transformers' `eager_attention_forward` (Gemma 2's soft-caps
    its logits there). Its [s, s] weights per rank's heads are what the other kernels avoid."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kernel != "eager":
        return ALL_ATTENTION_FUNCTIONS[kernel]
    modeling = importlib.import_module(type(model).__module__)
    function = vars(modeling).get("eager_attention_forward")
    if not callable(function):
        raise ValueError(f"{where}: sequence parallelism runs the model's attention on whole sequences of its "
                         f"heads; attn_implementation={kernel!r}, but {modeling.__name__} defines no "
                         "eager_attention_forward to call: load the model with attn_implementation='sdpa' "
                         "(or a flash / flex kernel)")
    return function


def _ulysses_function(attend: Any, kernel: str, group: Any, degree: int) -> Any:
    ulysses = Ulysses(group, degree)
    gathers_positions = "flash" in kernel  # varlen flash finds documents in the position ids

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if gathers_positions and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = gather_sequence(kwargs["position_ids"], group, degree)

        def kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Any]:
            with _kv_groups(module, q.shape[1] // k.shape[1]):
                return attend(module, q, k, v, attention_mask, *args, **kwargs)

        return ulysses(kernel_call, query, key, value)

    return attention


@contextmanager
def _kv_groups(module: torch.nn.Module, groups: int) -> Iterator[None]:
    """The query heads per key/value head the kernel repeats by, while key/value heads are replicated
    (fewer than the degree: one per rank, so fewer groups than the model's)."""
    saved = module.num_key_value_groups
    if saved == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = saved


def whole_mask_inputs(hidden: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor | None, group: Any,
                      degree: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What transformers' mask builders read, for the whole sequence instead of this slice: a stand-in
    for the hidden states of the whole length (a view: only its shape, dtype and device are read), the
    gathered position ids (documents that restart in them, across slice boundaries) and padding."""
    b, s_local, d = hidden.shape
    stand_in = hidden[:, :1].detach().expand(b, s_local * degree, d)
    whole_padding = None if padding is None else gather_sequence(padding, group, degree)
    return stand_in, gather_sequence(positions, group, degree), whole_padding
