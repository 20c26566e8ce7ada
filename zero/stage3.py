"""ZeRO stage 3 module hooks: gather a submodule's parameters just before it runs, free them after.

Each unit (a block of a ModuleList/Sequential, or a module's own parameters; see
partition.stage3_units) forms buckets. A forward
pre-hook all-gathers them, a forward hook frees them again; a hook on the module's outputs
gathers them once more when backward reaches the module (its gradient w.r.t. the outputs is
being computed, so its own backward is next), and they are freed when all their gradients
have arrived (GradSync's on_backward_done). Buckets of small parameters (below the
persistence threshold) stay whole. A parameter used by several submodules (weight tying)
is gathered by each of them. ZeRO-3: Rajbhandari et al. 2020, section 5.3.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipezero.comm import all_gather
from pipezero.zero.partition import Bucket, stage3_units

__all__ = ["ParamGatherer"]


class ParamGatherer:
    """Keeps stage-3 parameters partitioned except while their submodule needs them."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], group, compute_device: torch.device):
        self.group, self.device = group, compute_device
        where = {id(p): b for b in buckets for p in b.params}
        self._needs: dict[nn.Module, list[Bucket]] = {}
        for sub, recurse in stage3_units(module):
            own = [where[id(p)] for p in sub.parameters(recurse=recurse) if id(p) in where]
            own = [b for b in dict.fromkeys(own) if not b.persistent]
            if own:
                self._needs[sub] = own
        self._handles = []
        for sub in self._needs:
            self._handles.append(sub.register_forward_pre_hook(self._before_forward))
            self._handles.append(sub.register_forward_hook(self._after_forward))
        self.partitioned = [b for b in buckets if not b.persistent]

    # -- gather / release ------------------------------------------------------------
    def gather(self, buckets: list[Bucket]) -> None:
        """All-gather the buckets that are not already whole (one async collective each)."""
        todo = [b for b in buckets if b.flat is None]
        handles = []
        for b in todo:
            flat = torch.empty(b.padded, dtype=b.dtype, device=self.device)
            handles.append(all_gather(flat, b.local.to(self.device), group=self.group, async_op=True))
            b.flat = flat
        for b, h in zip(todo, handles):
            h.wait()
            b.attach()

    def release(self, b: Bucket) -> None:
        if not b.persistent and b.flat is not None:
            b.release()

    def release_all(self) -> None:
        for b in self.partitioned:
            self.release(b)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole inside the block (to read or save them); partitioned again after."""
        self.gather(self.partitioned)
        try:
            yield
        finally:
            self.release_all()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ---------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.gather(self._needs[module])

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        buckets = self._needs[module]
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, bs=buckets: self._before_backward(bs))
        for b in buckets:
            self.release(b)

    def _before_backward(self, buckets: list[Bucket]) -> None:
        self.gather(buckets)
