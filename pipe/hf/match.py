"""Whether a Hugging Face checkpoint fits its config, decided before any layer is built.

Every rank reads the same config.json and shard headers, so each check below raises the same
ValueError on every rank before a collective could hang: a tensor the model needs is absent, a
tensor's shape is not the one config.json implies (naming the file, the tensor and the config
fields behind the size), and the tie of the LM head to the embedding is decided as transformers 5
decides it on load (config.tie_word_embeddings, unless the checkpoint holds its own, different
lm_head.weight: then the head stays untied, with a warning). Tensors the model does not use are
reported, as from_pretrained reports its "unexpected" keys.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

from torch import nn

from pipezero.config_fields import warn_once

__all__ = ["check_checkpoint", "keeps_tie", "size_fields"]

_log = logging.getLogger("pipezero.hf")


def check_checkpoint(meta: nn.Module, config: Any, shards: Any, layers_prefix: str) -> None:
    """Names, then shapes, then the unused tensors of `shards` (a CheckpointTensors) against `meta`."""
    _check_names(meta, config, shards, layers_prefix)
    _check_shapes(meta, config, shards)
    _report_unused(meta, config, shards, layers_prefix)


def keeps_tie(model: Any, weights: Any) -> bool:
    """Whether the tied LM head stays tied to the embedding (transformers 5's rule on load).

    A checkpoint holding only one of the two ties to it; one holding both with equal values ties;
    one holding both with different values (a trained head) does not tie: the head is its own layer
    and model.config becomes a copy saying tie_word_embeddings=False (what the export writes).
    A model in memory ties as it is built (its head's weight is its embedding's or not).
    """
    embed, head = model.path(model.embed) + "weight", model.path(model.head) + "weight"
    if weights.tied(embed, head):
        return True
    warn_once("hf_layer_specs: config.json says tie_word_embeddings=True, but the checkpoint holds its own %s, "
              "different from %s; the head is NOT tied to the embedding (as transformers 5 loads it). Set "
              "tie_word_embeddings=false in config.json to silence this warning", head, embed, logger=_log)
    model.config = copy.deepcopy(model.config)
    model.config.tie_word_embeddings = False
    return False


def _layer_indices(names: set[str], prefix: str) -> list[int]:
    return sorted({int(n[len(prefix):].split(".")[0]) for n in names
                   if n.startswith(prefix) and n[len(prefix):].split(".")[0].isdigit()})


def _layers_note(config: Any, held: set[str], prefix: str) -> str:
    found = _layer_indices(held, prefix)
    if found and len(found) != config.num_hidden_layers:
        return (f"; config.json says num_hidden_layers={config.num_hidden_layers}, the checkpoint holds "
                f"{len(found)} layers ({prefix}{found[0]}..{found[-1]})")
    return ""


def _check_names(meta: nn.Module, config: Any, shards: Any, layers_prefix: str) -> None:
    """Every parameter's name is in the checkpoint."""
    held = shards.names()
    missing = [name for name, _ in meta.named_parameters() if name not in held]
    if missing:
        extra = sorted(held - set(meta.state_dict()))
        raise ValueError(f"hf_layer_specs: the checkpoint {shards.where} lacks {len(missing)} tensors of "
                         f"{type(meta).__name__}, e.g. {missing[:2]}, and holds others, e.g. {extra[:2]}, that "
                         f"transformers' renaming rules for the model do not map onto them"
                         f"{_layers_note(config, held, layers_prefix)}; expected a directory written by "
                         "save_pretrained for this config (or pass the model loaded with from_pretrained)")


def _check_shapes(meta: nn.Module, config: Any, shards: Any) -> None:
    """Every tensor's stored shape is the one the config builds (merged expert tensors are checked on read)."""
    for name, want in meta.state_dict().items():
        got = shards.shape(name)
        if got is None or tuple(got) == tuple(want.shape):
            continue
        differ = {w for g, w in zip(got, want.shape) if g != w} if len(got) == len(want.shape) else set(want.shape)
        raise ValueError(f"hf_layer_specs: tensor {shards.stored[name]!r} in {shards.file_of(name)} has shape "
                         f"{tuple(got)}, but config.json builds {tuple(want.shape)} for {name!r} "
                         f"({size_fields(config, differ)}); the config does not match the weights: use the config.json "
                         "saved with them")


def size_fields(config: Any, sizes: set[int]) -> str:
    """The config fields that set these sizes: one whose value is the size ('config.hidden_size=64',
    GPT-2's 'config.n_inner=64' and 'config.n_positions=32'), or two whose product is
    ('config.num_key_value_heads=4 x config.head_dim=8')."""
    values = {k: v for k, v in config.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)
              and re.search(r"(size|heads|dim|embd|experts|inner|positions|embeddings)$", k)}
    hits = [f"config.{k}={v}" for k, v in values.items() if v in sizes]
    hits += [f"config.{a}={values[a]} x config.{b}={values[b]}" for a in values for b in values
             if a < b and values[a] * values[b] in sizes]
    return ", ".join(hits) or f"no size field of config.json is {sorted(sizes)}"


def _report_unused(meta: nn.Module, config: Any, shards: Any, layers_prefix: str) -> None:
    """Warn about checkpoint tensors the model does not use, as from_pretrained warns (its ignore rules kept)."""
    patterns = set(getattr(meta, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in meta.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    ignore = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    held = shards.names()
    unused = sorted(n for n in held - set(meta.state_dict()) if ignore is None or not ignore.search(n))
    if unused:
        warn_once("hf_layer_specs: the checkpoint %s holds %d tensors that %s does not use (not loaded, as "
                  "from_pretrained leaves its unexpected keys): %s%s", shards.where, len(unused), type(meta).__name__,
                  str(unused[:8] + (["..."] if len(unused) > 8 else [])), _layers_note(config, held, layers_prefix),
                  logger=_log)
