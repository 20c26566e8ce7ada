"""Flat buffers and the shard layout: which slice of which parameter each rank owns.

Parameters are packed into flat buckets, one (param group, dtype) per bucket, so that one
collective moves a whole bucket. Each bucket is padded with zeros to a multiple of its
group's size and split into equal contiguous slices; group rank r owns slice r of every
bucket (the layout FSDP uses per unit). The group is the bucket's param group's
(reduction.py: the optimizer's, or one the param group names, as expert parameters do). Padding is never dropped and never read back.

The model parameters become views into their bucket's flat buffer, so an fp32 model needs
no separate fp32 master copy: the shard the inner optimizer steps is a view of the slice.
A bf16/fp16 model gets an fp32 master shard (ZeRO, Rajbhandari et al. 2020, section 5).

A tensor-parallel parameter (a DTensor) is packed by its LOCAL tensor: ZeRO shards this tensor
rank's slice over the data group, and the DTensor keeps wrapping the same local tensor object,
whose storage becomes the view into the flat buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipezero.zero.reduction import Reduction, counted_elsewhere

__all__ = ["Bucket", "local_tensor", "plan_groups", "stage3_units"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a DTensor wraps on this rank (the tensor itself when it is plain).

    The wrapped object itself, not to_local()'s alias: setting its `.data` must move the
    DTensor's storage into the flat buffer.
    """
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(eq=False)
class Bucket:
    """One flat buffer of parameters of one param group and dtype, split over `parts` ranks."""

    params: list[nn.Parameter]
    group_index: int
    parts: int                       # how many ranks share the bucket (1: replicated)
    part: int                        # which slice this rank owns
    persistent: bool = True          # stage 3: False means the full buffer is freed between uses
    reduction: Reduction = Reduction(None, 1, 0, 1)  # the group it reduces and is split over
    offsets: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0
    padded: int = 0
    flat: torch.Tensor | None = None     # full parameters (model dtype); None while released
    local: torch.Tensor | None = None    # the owned slice (model dtype)
    master: nn.Parameter | None = None   # the owned slice as the inner optimizer sees it
    grad_dtype: torch.dtype | None = None    # gradients are summed in it (None: the model dtype)
    reduce_dtype: torch.dtype | None = None  # and reduced in it (None: the model dtype)

    def __post_init__(self) -> None:
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            self.shapes.append(local_tensor(p).shape)
            offset += local_tensor(p).numel()
        self.numel = offset
        self.padded = -(-offset // self.parts) * self.parts
        self.grad_dtype = self.grad_dtype or self.dtype
        self.reduce_dtype = self.reduce_dtype or self.dtype

    @property
    def group(self) -> Any:
        """The process group its gradients are reduced over and its slices gathered from."""
        return self.reduction.group

    @property
    def shard_numel(self) -> int:
        return self.padded // self.parts

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The region of parameter i in a full-size flat tensor, shaped like the parameter."""
        shape = self.shapes[i]
        return flat[self.offsets[i]:self.offsets[i] + shape.numel()].view(shape)

    def owned(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size flat tensor."""
        s = self.shard_numel
        return flat[self.part * s:(self.part + 1) * s]

    def owned_span(self, i: int) -> tuple[int, int] | None:
        """Where parameter i's elements lie in this rank's slice, as (start, end); None if it owns none."""
        s = self.shard_numel
        lo = max(self.offsets[i], self.part * s)
        hi = min(self.offsets[i] + self.shapes[i].numel(), (self.part + 1) * s)
        return (lo - self.part * s, hi - self.part * s) if lo < hi else None

    # -- building -------------------------------------------------------------------
    def build(self, master_device: torch.device | None, keep_full: bool) -> None:
        """Pack the parameters into the flat buffer and create the owned slice and master.

        master_device None: the master aliases the owned slice when the model is fp32.
        keep_full False (stage 3): the owned slice gets its own storage, the full buffer is freed.
        """
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.slot(flat, i).copy_(local_tensor(p).detach())
        self.flat = flat
        self.attach()
        self.local = self.owned(flat) if keep_full else self.owned(flat).clone()
        alias = master_device is None and self.dtype == torch.float32
        data = self.local if alias else self.local.detach().to(master_device or self.device, torch.float32,
                                                               copy=True)
        if master_device is not None and master_device.type == "cpu" and self.device.type == "cuda":
            data = data.pin_memory()  # offload: host<->device copies can run asynchronously
        self.master = nn.Parameter(data)
        if not keep_full:
            self.release()

    def attach(self) -> None:
        """Point every parameter's data at its region of the full flat buffer."""
        assert self.flat is not None
        for i, p in enumerate(self.params):
            local_tensor(p).data = self.slot(self.flat, i)

    def release(self) -> None:
        """Free the full buffer; parameters become empty until gathered again (stage 3)."""
        self.flat = None
        for p in self.params:
            local_tensor(p).data = torch.empty(0, dtype=self.dtype, device=self.device)

    def publish_master(self) -> None:
        """Copy the stepped master into the owned slice when they are separate tensors."""
        assert self.local is not None and self.master is not None
        if self.master.data_ptr() != self.local.data_ptr():
            with torch.no_grad():
                self.local.copy_(self.master.detach(), non_blocking=True)


def plan_groups(param_groups: list[dict], bucket_numel: int, reductions: list[Reduction], split: bool,
                module: nn.Module | None, thresholds: list[float]) -> list[Bucket]:
    """Split every trainable parameter of the param groups into buckets.

    Group g's buckets reduce over reductions[g] and, when `split` (stages 1-3), are split over its
    ranks; at stage 3 its parameters of fewer than thresholds[g] elements stay whole (persistent).

    Without `module`: per (group, dtype, duplicate flag), in reverse order (the order
    gradients usually become ready), buckets of at most `bucket_numel` elements (a larger
    parameter gets a bucket of its own). With `module` (stage 3): per submodule, its direct
    parameters, split into persistent (numel < threshold) and partitioned ones.
    """
    where = {}
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {g} holds a {type(p).__name__}, expected tensors")
            if id(p) in where:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears twice in the param groups; "
                                 "list each parameter once")
            where[id(p)] = g
    trainable = [p for group in param_groups for p in group["params"] if p.requires_grad]
    if module is None:
        runs = [list(reversed(trainable))]
        limit = bucket_numel
    else:
        seen: set[int] = set()
        runs = []
        for sub, recurse in stage3_units(module):
            own = [p for p in sub.parameters(recurse=recurse) if id(p) in where and p.requires_grad
                   and id(p) not in seen]
            seen.update(id(p) for p in own)
            runs.append(own)
        missing = [tuple(p.shape) for p in trainable if id(p) not in seen]
        if missing:
            raise ValueError(f"stage 3: parameters of shapes {missing} are in the optimizer but not in "
                             "module=; pass the module that owns every optimized parameter")
        limit = None
    buckets = []
    for run in runs:
        buckets += _split_run(run, where, limit, reductions, split, module is not None, thresholds)
    return buckets


def stage3_units(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The submodules that gather their parameters as one unit in stage 3, with `recurse`.

    An element of an nn.ModuleList / nn.Sequential (a transformer block, a pipeline layer) is
    one unit with all its parameters, so a block costs one all-gather, as FSDP2 wrapping each
    block does; any other module with parameters of its own is a unit of those.
    """
    blocks = {id(c) for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
              for c in m.children() if next(c.parameters(), None) is not None}
    units: list[tuple[nn.Module, bool]] = []

    def walk(m: nn.Module) -> None:
        if id(m) in blocks:
            units.append((m, True))
            return
        if next(m.parameters(recurse=False), None) is not None:
            units.append((m, False))
        for child in m.children():
            walk(child)
    walk(module)
    return units


def _split_run(run, where, limit, reductions, split, stage3, thresholds) -> list[Bucket]:
    """Cut one ordered run of parameters into homogeneous buckets."""
    open_: dict[tuple, list] = {}
    out: list[Bucket] = []

    def bucket(members: list, key: tuple) -> Bucket:
        r = reductions[key[0]]
        parts = r.size if split else 1
        return Bucket(members, key[0], parts, r.rank if parts > 1 else 0, key[4], r)

    for p in run:
        g = where[id(p)]
        persistent = (not stage3) or p.numel() < thresholds[g]
        key = (g, p.dtype, p.device, counted_elsewhere(p, reductions[g]), persistent)
        members = open_.setdefault(key, [])
        if limit is not None and members and sum(local_tensor(q).numel() for q in members) + \
                local_tensor(p).numel() > limit:
            out.append(bucket(members, key))
            members = open_[key] = []
        members.append(p)
    out += [bucket(m, key) for key, m in open_.items() if m]
    return out
