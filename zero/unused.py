"""Parameters that got no gradient this step stay as they are, as torch's optimizers leave them.

torch skips a parameter whose `.grad` is None: no weight decay, no momentum, no step count.
ZeRO steps flat buckets, whose reduced gradient is zero (not None) where a parameter got none,
so AdamW would decay it and Adam move it on old momentum. `UnusedParams` records which bucket
parameters received a gradient since the last step (their post-accumulate-grad hooks, plus
gradients that arrive without hooks, which the pipeline announces through flush/collect), agrees
over each bucket's reduction group (a parameter used on any rank has a real, averaged gradient, as
in DDP), and then: a bucket none of whose parameters got a gradient gives its master no `.grad` (the inner
optimizer skips it, exactly as torch would); a bucket only partly used keeps the unused
parameters' owned elements and their optimizer state from before the step (the bucket's one
step counter still advances: the flat layout has no per-parameter counter).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist

from pipezero.topology import process_device
from pipezero.zero.partition import Bucket

__all__ = ["UnusedParams"]


class UnusedParams:
    """Which parameters of the buckets got a gradient this step, and the step that leaves the others alone."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self._used: set[int] = set()
        self._unused: list[tuple[Bucket, int]] = []
        # one bitmap per reduction group (a param group's own, reduction.py), agreed over that group
        self._groups: dict[int, list[Bucket]] = {}
        for b in buckets:
            self._groups.setdefault(id(b.group), []).append(b)
        self._flags: list[tuple[list[Bucket], torch.Tensor]] = []
        self._works: list[Any] = []
        ref = weakref.ref(self)

        def mark(p: torch.Tensor) -> None:
            me = ref()
            if me is not None:
                me._used.add(id(p))
        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(mark)

    def mark(self, params: Iterable[torch.Tensor], always: bool = False) -> None:
        """These params' gradients arrived without hooks (pipeline tied weights, a split weight backward)."""
        self._used.update(id(p) for p in params if always or p.grad is not None)

    def find(self, late_grads: bool) -> None:
        """Before the reduction: agree over the group which parameters got no gradient this step.

        `late_grads`: a parameter's non-None `.grad` means an unreduced gradient (stages 1-3; at
        stage 0 `.grad` always views the buffer).
        """
        self._flags, self._works = [], []
        for buckets in self._groups.values():
            flags = torch.tensor([id(p) in self._used or (late_grads and p.grad is not None)
                                  for b in buckets for p in b.params], dtype=torch.uint8)
            r = buckets[0].reduction
            if r.size > 1:  # a bitmap, as DDP's find_unused_parameters sends; not in TRAFFIC
                flags = flags.to(process_device(r.group))
                self._works.append(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=r.group, async_op=True))
            self._flags.append((buckets, flags))

    def drop_grads(self) -> None:
        """After the reduction: a bucket with no used parameter gives its master no gradient."""
        for work in self._works:
            work.wait()
        self._works = []  # a finished Work is not kept alive (gloo's threads may own it at exit)
        self._unused = []
        for buckets, flags in self._flags:
            where = [(b, i) for b in buckets for i in range(len(b.params))]
            self._unused += [slot for slot, used in zip(where, flags.cpu().tolist()) if not used]
        counts: dict[Bucket, int] = {}
        for b, _ in self._unused:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if n == len(b.params):
                b.master.grad = None

    def keep(self, core: Any) -> list[tuple[Bucket, int, int, torch.Tensor, dict, bool]]:
        """Before the inner step: the owned elements (and optimizer state) of unused params in partly used buckets."""
        kept = []
        for b, i in self._unused:
            span = b.owned_span(i)
            if b.master.grad is None or span is None:
                continue
            lo, hi = span
            state = core.state.get(b.master, {})
            shard = {k: v[lo:hi].clone() for k, v in state.items() if _is_shard(v, b)}
            kept.append((b, lo, hi, b.master.detach()[lo:hi].clone(), shard, bool(state)))
        return kept

    def restore(self, core: Any, kept: list) -> list[Bucket]:
        """After the inner step: put the kept elements back (new state starts at zero there); the buckets touched."""
        touched = []
        with torch.no_grad():
            for b, lo, hi, value, shard, had_state in kept:
                b.master[lo:hi].copy_(value)
                for key, v in core.state.get(b.master, {}).items():
                    if key in shard:
                        v[lo:hi].copy_(shard[key])
                    elif not had_state and _is_shard(v, b):
                        v[lo:hi].zero_()
                touched.append(b)
        return list(dict.fromkeys(touched))

    def clear(self) -> None:
        """A new step window: nothing used yet."""
        self._used.clear()
        self._unused = []


def _is_shard(v: Any, b: Bucket) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.shard_numel
