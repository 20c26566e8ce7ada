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
    """Tensors of a checkpoint directory (model.safetensors or its index), by the model's names.

    Every shard's header is read at once (names, shapes; no tensor data), so a missing, truncated
    or damaged shard, or an index naming a shard that does not hold the tensor, is a ValueError
    naming the file and the tensor on every rank, before any layer is built.
    """

    def __init__(self, directory: Path):
        index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
        if single.exists():  # what from_pretrained reads first
            self.where, self.shapes = str(single), _header(single)
            self.files = {name: single for name in self.shapes}
        elif index.exists():
            self.where = str(index)
            self.files = {name: directory / f for name, f in _weight_map(index).items()}
            self.shapes = _check_index(index, self.files)
        else:
            raise ValueError(f"{directory} holds no model.safetensors nor model.safetensors.index.json; "
                             "save the model with save_pretrained(dir) (safetensors is its default)")
        self.stored: dict[str, str] = {name: name for name in self.files}  # the model's name -> the checkpoint's
        self.merged: dict[str, tuple] = {}  # the model's name -> (converter, {source pattern: checkpoint names})

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of the model's tensor `name` (None when absent or merged from several)."""
        stored = self.stored.get(name)
        return self.shapes.get(stored) if stored is not None else None

    def file_of(self, name: str) -> str:
        """The shard holding the model's tensor `name`."""
        return str(self.files[self.stored[name]])

    def tied(self, embed: str, head: str) -> bool:
        """Whether a head tied to the embedding stays tied: only one of them stored (it becomes the
        other's too, as transformers 5 swaps them), or both with equal values."""
        if embed not in self.stored or head not in self.stored:
            if embed not in self.stored and head in self.stored:
                self.stored[embed] = self.stored[head]
            return True
        if self.stored[embed] == self.stored[head]:
            return True
        a, b = self.get(embed), self.get(head)
        return a.shape == b.shape and bool(torch.equal(a, b))

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

        try:
            with safe_open(str(self.files[stored]), "pt") as f:
                return f.get_tensor(stored)
        except Exception as err:  # noqa: BLE001 - safetensors' own error type names neither file nor tensor
            raise ValueError(f"{self.files[stored]}: cannot read tensor {stored!r} ({err}); the file is damaged "
                             "or was changed while training: save or download it again") from err


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in one safetensors file (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: one message naming the file
        raise ValueError(f"{path}: not a readable safetensors file ({err}); it is truncated or damaged "
                         f"({path.stat().st_size if path.exists() else 'no'} bytes): save or download it again"
                         ) from err


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index}: not a shard index ({type(err).__name__}: {err}); expected JSON with a "
                         "'weight_map' of tensor name -> shard file, as save_pretrained writes it") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map each tensor name to a shard file name")
    return weight_map


def _check_index(index: Path, files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every shard the index names exists and holds the tensors mapped to it; name -> shape."""
    headers: dict[Path, dict[str, tuple[int, ...]]] = {}
    for name, path in files.items():
        if path not in headers:
            if not path.is_file():
                count = sum(1 for f in files.values() if f == path)
                raise ValueError(f"{index} maps {count} tensors (e.g. {name!r}) to {path.name}, which is not in "
                                 f"{path.parent}; the download is incomplete: fetch every shard the index names")
            headers[path] = _header(path)
    for name, path in files.items():
        if name not in headers[path]:
            others = [p.name for p, h in headers.items() if name in h]
            raise ValueError(f"{index} maps tensor {name!r} to {path.name}, which does not hold it"
                             + (f" (it is in {others[0]})" if others else "")
                             + "; the index does not match its shards: save or download them together again")
    return {name: headers[path][name] for name, path in files.items()}


class ModelTensors:
    """Tensors of a model already in memory, by name."""

    def __init__(self, model: nn.Module):
        self.state = model.state_dict()

    def get(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)

    def tied(self, embed: str, head: str) -> bool:
        """Whether the model in memory shares one tensor between its embedding and its head."""
        a, b = self.state.get(embed), self.state.get(head)
        return a is None or b is None or a.data_ptr() == b.data_ptr()
