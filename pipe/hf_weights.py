"""Where hf_layer_specs' weights come from: a checkpoint directory read by the model's names, or a model in memory.

A pipeline stage reads only its own layers' tensors, so the checkpoint is read one tensor at
a time. Its names are not always the model's: transformers 5 renames some on load (GPT-NeoX's
embed_out is its lm_head, old norms' gamma/beta) and merges others (a MoE checkpoint holds
one gate/up/down matrix per expert where the model holds one stacked tensor). Both follow
transformers' own rules for the model (its conversion mapping), applied here per tensor,
so a directory written by save_pretrained or published on the Hub loads as from_pretrained
loads it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

__all__ = ["CheckpointTensors", "ModelTensors"]


class CheckpointTensors:
    """Tensors of a checkpoint directory (model.safetensors or its index), by the model's names."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / f for name, f in files.items()}
        elif (directory / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(str(directory / "model.safetensors"), "pt") as f:
                self.files = {name: directory / "model.safetensors" for name in f.keys()}
        else:
            raise ValueError(f"{directory} holds no model.safetensors nor model.safetensors.index.json; "
                             "save the model with save_pretrained(dir) (safetensors is its default)")
        self.stored: dict[str, str] = {name: name for name in self.files}  # the model's name -> the checkpoint's
        self.merged: dict[str, tuple] = {}  # the model's name -> (converter, {source pattern: checkpoint names})

    def adopt_names(self, meta: nn.Module) -> None:
        """Key the tensors by `meta`'s names, renamed and merged by transformers' rules for that model
        (transformers 5; an older one, without those rules, loads the names as stored)."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                         rename_source_key)
        except ImportError:
            return

        rules = get_model_conversion_mapping(meta)
        renamings = [t for t in rules if isinstance(t, WeightRenaming)]
        converters = [t for t in rules if isinstance(t, WeightConverter)]
        names = dict.fromkeys(meta.state_dict(), True)  # what rename_source_key looks names up in
        stored, merged = {}, {}
        for name in sorted(self.files, key=dot_natural_key):  # experts in index order
            target, pattern = rename_source_key(name, renamings, converters, meta.base_model_prefix, names)
            if pattern is None:
                stored[target] = name
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            merged.setdefault(target, (converter, defaultdict(list)))[1][pattern].append(name)
        self.stored, self.merged = stored, merged

    def names(self) -> set[str]:
        """The model's names of the tensors this checkpoint holds."""
        return set(self.stored) | set(self.merged)

    def get(self, name: str) -> torch.Tensor | None:
        if name in self.merged:
            converter, sources = self.merged[name]
            tensors: dict = {pattern: [self._read(n) for n in names] for pattern, names in sources.items()}
            for op in converter.operations:
                tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                                     target_patterns=converter.target_patterns, full_layer_name=name)
            (value,) = tensors.values()
            return value
        return self._read(self.stored[name]) if name in self.stored else None

    def _read(self, stored: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[stored]), "pt") as f:
            return f.get_tensor(stored)


class ModelTensors:
    """Tensors of a model already in memory, by name."""

    def __init__(self, model: nn.Module):
        self.state = model.state_dict()

    def get(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)
