"""ZeRO stage 3 module hooks: gather a submodule's parameters just before it runs, free them after.

Each unit (a block of a ModuleList/Sequential, or a module's own parameters; see
partition.stage3_units) forms buckets. A forward
pre-hook all-gathers them, a forward hook frees them again; a hook on the module's outputs
gathers them once more when backward reaches the module (its gradient w.r.t. the outputs is
being computed, so its own backward is next), and they are freed when all their gradients
have arrived (GradSync's on_backward_done). Buckets of small parameters (below the
persistence threshold) stay whole. A parameter used by several submodules (weight tying)
is gathered by each of them. ZeRO-3: Rajbhandari et al. 2020, section 5.3.

Under a pipeline the caller drives instead (`drive()`): the runner knows from its schedule
which chunk runs next, so it says when a chunk's parameters are needed (gathered, the next
chunk's gathers started early) and when it is done with them (released); the module hooks
are removed and buckets stay whole after their backward. The policy is zero/'s: what is
partitioned, per bucket, and that a bucket is freed only when all its parameters are done.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipezero.comm import Handle, all_gather
from pipezero.zero.offload import upload
from pipezero.zero.partition import Bucket, stage3_units

__all__ = ["ParamGatherer"]


class ParamGatherer:
    """Keeps stage-3 parameters partitioned except while their submodule needs them.

    Prefetch: the order in which units run forward and backward is recorded during the first
    step; from then on, gathering a unit also starts the all-gathers of the units that follow
    it (up to `prefetch_numel` elements), so communication overlaps the unit's compute.
    Offloaded slices (on the host while the compute device is another) are uploaded on a side
    stream first; with a group of one the upload alone makes the bucket whole.
    """

    def __init__(self, module: nn.Module, buckets: list[Bucket], compute_device: torch.device,
                 prefetch_numel: int = 0):
        self.device, self.prefetch_numel = compute_device, prefetch_numel
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
        self._pending: dict[Bucket, Handle] = {}
        self._order: dict[str, list[nn.Module]] = {"forward": [], "backward": []}
        self._frozen = False
        self._where = {id(p): b for b in self.partitioned for p in b.params}
        self._driven = False
        self._upload = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None
        self._full: dict[Bucket, torch.Tensor] = {}   # see _full_buffer
        self._whole = 0  # open gathered_parameters() / paused() blocks: nothing is gathered or freed inside

    # -- gather / release ------------------------------------------------------------
    def _launch(self, buckets: list[Bucket]) -> None:
        """Start the all-gathers of the buckets that are neither whole nor on their way."""
        if self._whole:
            return
        for b in buckets:
            if b.flat is None:
                b.flat = self._full_buffer(b)
                self._pending[b] = self._fetch(b)

    def _full_buffer(self, b: Bucket) -> torch.Tensor:
        """b's full buffer on the compute device, its memory allocated (again).

        One tensor per bucket for the whole run, whose storage is freed between uses rather than
        the tensor dropped: autograd may save a view of a parameter (a Linear saves weight.t()),
        which would keep a dropped buffer alive from forward to backward; gathering for backward
        refills the very storage those views read.
        """
        full = self._full.get(b)
        if full is None:
            full = self._full[b] = torch.empty(b.padded, dtype=b.dtype, device=self.device)
        else:
            full.untyped_storage().resize_(b.padded * full.element_size())
        return full

    def _fetch(self, b: Bucket) -> Handle:
        """Fill b.flat: upload an offloaded slice (the whole bucket in a group of one), all-gather over b's group."""
        if b.local.device == self.device:
            return all_gather(b.flat, b.local, group=b.group, async_op=True)
        if b.parts == 1:
            return upload(b.flat, b.local, self._upload)
        if self._upload is None:
            return all_gather(b.flat, b.local.to(self.device), group=b.group, async_op=True)
        mine = torch.empty(b.shard_numel, dtype=b.dtype, device=self.device)
        upload(mine, b.local, self._upload)
        mine.record_stream(self._upload)
        with torch.cuda.stream(self._upload):  # the gather waits for the upload, not for compute
            return all_gather(b.flat, mine, group=b.group, async_op=True)

    def wait_uploads(self) -> None:
        """Block until no upload reads the host slices any more (the optimizer is about to write them)."""
        if self._upload is not None:
            self._upload.synchronize()

    def resident_numel(self) -> int:
        """Elements of partitioned buckets now whole on the compute device (gathered or on their way)."""
        return sum(b.padded for b in self.partitioned if b.flat is not None)

    def gather(self, buckets: list[Bucket]) -> None:
        """Make the buckets whole: all-gather them (one async collective each) and wait."""
        self._launch(buckets)
        for b in buckets:
            handle = self._pending.pop(b, None)
            if handle is not None:
                handle.wait()
                b.attach()

    def release(self, b: Bucket) -> None:
        if self._whole:  # a forward or a runner's step inside gathered_parameters() / paused() frees nothing
            return
        handle = self._pending.pop(b, None)
        if handle is not None:
            handle.wait()
        if not b.persistent and b.flat is not None:
            full = b.flat
            b.release()
            if full is self._full.get(b):
                full.untyped_storage().resize_(0)

    def backward_done(self, b: Bucket) -> None:
        """All of b's gradients arrived: free b, unless a caller drives gathering (it frees b)."""
        if not self._driven:
            self.release(b)

    def release_all(self) -> None:
        """Partition everything again (at step); the first call freezes the recorded unit order."""
        for b in self.partitioned:
            self.release(b)
        self.wait_uploads()
        if not self._frozen and self._order["forward"]:
            self._order = {k: list(dict.fromkeys(v)) for k, v in self._order.items()}
            self._frozen = True

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole inside the block (to read or save them); partitioned again after."""
        self.gather(self.partitioned)
        self._whole += 1
        try:
            yield
        finally:
            self._whole -= 1
            self.release_all()

    @contextmanager
    def paused(self) -> Iterator[list[tuple[nn.Module, list[Bucket]]]]:
        """The hooks gather nothing inside the block (someone else holds the weights whole);
        yields the units (module, its partitioned buckets) in registration order."""
        needs, self._needs = self._needs, {m: [] for m in self._needs}
        self._whole += 1
        try:
            yield list(needs.items())
        finally:
            self._whole -= 1
            self._needs = needs

    # -- driven by a caller (the pipeline runner) -------------------------------------------
    def drive(self) -> None:
        """From now on the caller gathers and releases (gather_params / release_params); the
        module hooks are removed."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._driven = True

    def gather_params(self, params: Iterable[torch.Tensor], wait: bool = True) -> None:
        """Make the buckets holding these parameters whole; wait=False only starts the all-gathers."""
        buckets = list(dict.fromkeys(self._where[id(p)] for p in params if id(p) in self._where))
        if wait:
            self.gather(buckets)
        else:
            self._launch(buckets)

    def release_driven(self) -> None:
        """The caller's step is over: every partitioned bucket freed (no upload wait, no order freeze)."""
        for b in self.partitioned:
            self.release(b)

    def release_params(self, params: Iterable[torch.Tensor]) -> None:
        """Free the buckets all of whose parameters are listed (a bucket shared with a parameter
        not listed, e.g. a tied weight's module, stays whole)."""
        listed = {id(p) for p in params}
        for b in dict.fromkeys(self._where[i] for i in listed if i in self._where):
            if all(id(p) in listed for p in b.params):
                self.release(b)

    # -- hooks ---------------------------------------------------------------------------
    def _unit_runs(self, phase: str, module: nn.Module) -> None:
        """Gather this unit; record the order (first step) or prefetch the units after it."""
        self.gather(self._needs[module])
        order = self._order[phase]
        if not self._frozen:
            order.append(module)
            return
        if self.prefetch_numel <= 0 or module not in order:
            return
        budget = self.prefetch_numel
        for nxt in order[order.index(module) + 1:]:
            buckets = self._needs[nxt]
            self._launch(buckets)
            budget -= sum(b.numel for b in buckets)
            if budget <= 0:
                break

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._unit_runs("forward", module)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, m=module: self._unit_runs("backward", m))
        for b in self._needs[module]:
            self.release(b)
