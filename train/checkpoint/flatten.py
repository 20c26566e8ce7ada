"""Any nested state_dict -> (flat name -> tensor dict, JSON skeleton), and back, with no pickle.

An optimizer chain's state_dict() (Adam's per-parameter moments under integer keys, a loss
scaler's numbers, ZeRO's shards) is a tree of dicts, lists, tuples, tensors and scalars.
safetensors stores only named tensors and JSON stores only the rest, so the tree is split:
every tensor leaf goes into the tensor dict under its path ("optim/state/3/exp_avg"), and the
skeleton records the tree's shape with a reference in the tensor's place. Integer dict keys,
tuples and non-finite floats survive the round trip (JSON alone would turn them into strings,
lists and invalid tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["flatten_state", "unflatten_state"]

_SCALARS = (bool, int, str, type(None))


def flatten_state(state: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by path under prefix, a JSON-ready skeleton) for a nested state."""
    tensors: dict[str, torch.Tensor] = {}
    return tensors, _flatten(state, prefix, tensors)


def _flatten(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors[path] = node
        return {"__tensor__": path}
    if isinstance(node, float):
        return node if math.isfinite(node) else {"__float__": repr(node)}
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]
        return items if isinstance(node, list) else {"__tuple__": items}
    if isinstance(node, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in node):
            return {k: _flatten(v, f"{path}/{k}", tensors) for k, v in node.items()}
        for key in node:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{path}: dict key {key!r} of type {type(key).__name__}; "
                                f"a checkpointed state may only use str and int keys")
        return {"__items__": [[k, _flatten(v, f"{path}/{k}", tensors)] for k, v in node.items()]}
    raise TypeError(f"{path}: a {type(node).__name__} cannot go into a checkpoint without pickle; "
                    f"store tensors, numbers, strings, lists, tuples and dicts only")


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """The nested state flatten_state split, rebuilt from its tensors and skeleton."""
    if isinstance(skeleton, list):
        return [unflatten_state(tensors, v) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        path = skeleton["__tensor__"]
        if path not in tensors:
            raise KeyError(f"checkpoint state refers to tensor {path!r}, which was not loaded")
        return tensors[path]
    if "__float__" in skeleton:
        return float(skeleton["__float__"])
    if "__tuple__" in skeleton:
        return tuple(unflatten_state(tensors, v) for v in skeleton["__tuple__"])
    if "__items__" in skeleton:
        return {k: unflatten_state(tensors, v) for k, v in skeleton["__items__"]}
    return {k: unflatten_state(tensors, v) for k, v in skeleton.items()}
