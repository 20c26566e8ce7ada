"""Gradient reduction: post-accumulate-grad hooks, buckets in flight, the readiness protocol.

A parameter's gradient is "pushed" into its bucket's flat gradient buffer when it becomes
ready (a post-accumulate-grad hook), unless reduction is held for it (`hold_grad_sync`, the
pipeline runner's readiness protocol) or suspended (`no_sync`, gradient accumulation); a
bucket whose parameters are all pushed is reduced asynchronously while backward goes on.
`finish()` (called by step) pushes and reduces whatever is left, so correctness never
depends on the hooks, only overlap does.

Per stage (ZeRO, Rajbhandari et al. 2020), reduced values stay in the model dtype until
step() hands them to the fp32 masters (so between backward and step the model state takes the
paper's 2+2+12 bytes per parameter, split as the stage says):
  0: all-reduce (average) in place in a persistent full buffer; .grad are views of it (DDP);
  1: persistent full buffer, reduce-scatter; the owned region keeps the reduced values;
  2, 3: the full buffer lives only from a bucket's first push until its reduce-scatter is
     done; parameters keep no gradient, a shard-sized buffer keeps the reduced values.
     Inside no_sync / hold, whole .grad accumulate until the final micro-batch, unless
     `every_microbatch`: then every backward's gradients are pushed and reduce-scattered
     into the shard (accumulating there, model dtype) as if nothing were held, as DeepSpeed's
     ZeRO-2 does. Gradients whose hooks never fire during the backward (the pipeline runner's
     tied weights, summed over their tie group first) are still reduced when released.
"""

from __future__ import annotations

import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipezero.comm import Handle, all_reduce, group_size, reduce_scatter
from pipezero.zero.partition import Bucket, local_tensor

__all__ = ["GradSink", "GradSync"]

_MAX_IN_FLIGHT = 2  # stage 2/3: buckets whose full buffer may be alive while reducing


@dataclass(eq=False)
class _Pending:
    """Per-bucket progress in the current step window."""

    grad: torch.Tensor | None = None     # full flat gradient buffer (model dtype)
    pushed: set[int] | None = None       # parameter indices already in `grad` this round
    seen: set[int] | None = None         # parameter indices whose grad arrived this backward
    handle: Handle | None = None
    out: torch.Tensor | None = None      # where the reduction writes the owned values
    shard: torch.Tensor | None = None    # stage 2/3: the reduced owned values so far
    reduced: bool = False                # reduced at least once since the last step
    rescale: bool = False                # stage 1: the owned region holds an average, not a sum
    dirty: bool = False                  # stage 1: local gradients added since the last launch
    fresh: bool = False                  # stage 2/3: `grad` is uninitialised where nothing was pushed yet

    def __post_init__(self) -> None:
        self.pushed, self.seen = set(), set()


class GradSink(Protocol):
    """Where reduced gradients go when the masters live elsewhere (CPU offload, see offload.py)."""

    def reduced(self, b: Bucket, values: torch.Tensor, accumulate: bool) -> None:
        """b's owned reduced gradient: `values` adds to what this step brought (stages 2-3, which
        then drop their device copy) or replaces it (stages 0-1, whose buffer keeps the sum)."""

    def hand_over(self, b: Bucket) -> torch.Tensor | None:
        """At step: the gradient for b's master (None if nothing was reduced this step)."""

    def discard(self) -> None:
        """zero_grad: forget this step's gradients."""


def _weak(method: Callable) -> Callable:
    """A function calling `method` while its object lives (a no-op after)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class GradSync:
    """Reduces the gradients of bucketed parameters over `group` as they become ready."""

    def __init__(self, buckets: list[Bucket], stage: int, group,
                 on_backward_done: Callable[[Bucket], None] | None = None, overlap: bool = True,
                 every_microbatch: bool = False, sink: GradSink | None = None):
        self.buckets, self.stage, self.group, self.overlap, self.sink = buckets, stage, group, overlap, sink
        self.replicated = stage == 0 or group_size(group) == 1   # all-reduce or nothing at all
        self.keep_grads = stage <= 1      # a persistent full gradient buffer per bucket
        self.views = stage == 0           # parameters' .grad are views of that buffer
        self.every_microbatch = every_microbatch and not self.keep_grads
        self.on_backward_done = on_backward_done
        self._state = {b: _Pending() for b in buckets}
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._held: set[int] = set()
        self._suspended = 0
        self._in_flight: deque[Bucket] = deque()
        if self.keep_grads:
            for b in buckets:
                self._state[b].grad = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                if self.views:
                    self._point_grads(b)
        # hooks hold the GradSync weakly: parameters must not keep a dropped optimizer alive
        on_grad = _weak(self._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for b in buckets for p in b.params]
        if self.views:  # autograd is about to add into a view that may still be under all-reduce
            settle = _weak(self._settle)
            self._hooks += [p.register_hook(lambda grad, b=b: settle(b)) for b in buckets for p in b.params]

    # -- the readiness protocol ----------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate .grad locally; no reduction."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def hold(self, params: Iterable[torch.Tensor]) -> None:
        """Do not reduce these parameters' gradients until released."""
        self._held.update(id(p) for p in params if id(p) in self._where)

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """From now on reduce these parameters' gradients as they become ready."""
        self._held.difference_update(id(p) for p in params)

    def flush(self, params: Iterable[torch.Tensor]) -> None:
        """Their backward is done: push them all; launch buckets that are now complete."""
        touched = []
        for p in params:
            if id(p) in self._where and id(p) not in self._held and not self._suspended:
                b, i = self._where[id(p)]
                st = self._state[b]
                if st.handle is None and i not in st.pushed and not self._nothing_new(b):
                    self._push(b, i)
                touched.append(b)
        for b in dict.fromkeys(touched):
            st = self._state[b]
            if st.handle is None and len(st.pushed) == len(b.params):
                self._launch(b)

    def collect(self, params: Iterable[torch.Tensor]) -> None:
        """Gradients of these params were set without hooks (a split weight backward assigns
        .grad): with every_microbatch, push them now as their hooks would have."""
        if not self.every_microbatch:
            return
        for p in params:
            if id(p) in self._where and p.grad is not None:
                self._on_grad(p)

    # -- step -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce everything not yet reduced and wait: every master shard has its .grad."""
        for b in self.buckets:
            st = self._state[b]
            late = not self.views and any(p.grad is not None for p in b.params)
            if st.handle is None and (not st.reduced or late or st.pushed or st.dirty):
                for i in range(len(b.params)):
                    if i not in st.pushed:
                        self._push(b, i)
                self._launch(b)
        self.wait()
        for b in self.buckets:
            self._hand_over(b)

    def wait(self) -> None:
        """Complete the reductions under way; launch nothing new."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def end_step(self) -> None:
        """The optimizer consumed the gradients: a new step window starts."""
        for st in self._state.values():
            st.reduced = False

    def zero_grad(self) -> None:
        """Forget all gradients (the masters' are cleared by the inner optimizer)."""
        while self._in_flight:
            b = self._in_flight.popleft()
            self._state[b].handle.wait()
            self._state[b].handle = None
        if self.sink is not None:
            self.sink.discard()
        for b in self.buckets:
            st = self._state[b]
            st.pushed.clear()
            st.seen.clear()
            st.reduced, st.rescale, st.dirty, st.out, st.shard = False, False, False, None, None
            if self.keep_grads:
                st.grad.zero_()
            else:
                st.grad = None
            if self.views:
                self._point_grads(b)
            else:
                for p in b.params:
                    p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- internals ------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        st = self._state[b]
        if self.every_microbatch or (self.overlap and not self._suspended and id(p) not in self._held):
            self._settle(b)                # a second synced backward before step: fold in
            self._push(b, i)
            if len(st.pushed) == len(b.params):
                self._launch(b)
        elif self.keep_grads and not self.views:   # stage 1: accumulate locally in the buffer
            self._settle(b)
            self._add_local(b, i)
        st.seen.add(i)
        if len(st.seen) == len(b.params):
            st.seen.clear()
            if self.on_backward_done is not None:
                self.on_backward_done(b)

    def _nothing_new(self, b: Bucket) -> bool:
        """Stage 2/3: b was reduced and no gradient arrived since (pushing would reduce zeros)."""
        st = self._state[b]
        return not self.keep_grads and st.reduced and not st.pushed and all(p.grad is None for p in b.params)

    def _settle(self, b: Bucket) -> None:
        """Complete bucket b's reduction if it is still under way."""
        if self._state[b].handle is not None:
            self._in_flight.remove(b)
            self._complete(b)

    def _point_grads(self, b: Bucket) -> None:
        grad = self._state[b].grad
        for i, p in enumerate(b.params):
            _set_grad(p, b.slot(grad, i))

    def _push(self, b: Bucket, i: int) -> None:
        """Move parameter i's local gradient into the bucket's flat buffer."""
        st, p = self._state[b], b.params[i]
        if st.grad is None:  # stage 2/3: a fresh buffer per round; each slot is written before launch
            st.grad = torch.empty(b.padded, dtype=b.dtype, device=b.device)
            st.grad[b.numel:].zero_()
            st.fresh = True
        view = b.slot(st.grad, i)
        if st.fresh and i not in st.pushed:  # first write of this slot: a copy, not zeros plus an add
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(p.grad))
            p.grad = None
            st.pushed.add(i)
            return
        if self.views:
            if p.grad is None:
                view.zero_()
            elif local_tensor(p.grad).data_ptr() != view.data_ptr():
                view.copy_(local_tensor(p.grad))
            _set_grad(p, view)
        else:
            self._add_local(b, i)
        st.pushed.add(i)

    def _add_local(self, b: Bucket, i: int) -> None:
        """Add parameter i's .grad into the bucket buffer (not yet reduced) and drop it."""
        st, p = self._state[b], b.params[i]
        if st.rescale:        # a new round on top of reduced values: make them a sum again
            b.owned(st.grad).mul_(b.parts)
            st.rescale = False
        if p.grad is not None:
            b.slot(st.grad, i).add_(local_tensor(p.grad))
            p.grad = None
            st.dirty = True

    def _launch(self, b: Bucket) -> None:
        st = self._state[b]
        if self.replicated:
            st.out = st.grad
            st.handle = all_reduce(st.grad, group=self.group, average=True, async_op=True)
        else:
            st.out = torch.empty(b.shard_numel, dtype=b.dtype, device=b.device)
            st.handle = reduce_scatter(st.out, st.grad, group=self.group, average=True, async_op=True)
        self._in_flight.append(b)
        # stage 2/3 free the full buffer; with a sink, stage 0/1 too start the copy to the host
        while (not self.keep_grads or self.sink is not None) and len(self._in_flight) > _MAX_IN_FLIGHT:
            self._complete(self._in_flight.popleft())

    def _complete(self, b: Bucket) -> None:
        """Wait for bucket b's reduction and keep the owned reduced values (model dtype)."""
        st = self._state[b]
        st.handle.wait()
        if self.keep_grads and not self.replicated:          # stage 1: owned region = average, rest 0
            owned = b.owned(st.grad)
            owned.copy_(st.out)
            st.grad[:b.part * b.shard_numel].zero_()
            st.grad[(b.part + 1) * b.shard_numel:].zero_()
            st.rescale = True
        elif not self.keep_grads:                             # stage 2/3: accumulate the shard
            if self.sink is not None:                          # on the host (CPU offload)
                self.sink.reduced(b, st.out, accumulate=True)
            else:
                st.shard = st.out if st.shard is None else st.shard.add_(st.out)
            st.grad, st.fresh = None, False
        if self.keep_grads and self.sink is not None:
            self.sink.reduced(b, b.owned(st.grad), accumulate=False)
        st.handle, st.out, st.reduced, st.dirty = None, None, True, False
        st.pushed.clear()

    def _hand_over(self, b: Bucket) -> None:
        """Give the reduced owned values to the master as its .grad (fp32, on its device)."""
        st, master = self._state[b], b.master
        if self.sink is not None:
            g = self.sink.hand_over(b)
            if g is not None:
                master.grad = g
            return
        g = b.owned(st.grad) if self.keep_grads else st.shard
        if g is None:
            return
        master.grad = g if g.dtype == master.dtype and g.device == master.device \
            else g.to(master.device, master.dtype)


def _set_grad(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` p's gradient (wrapped like p when p is a DTensor, still sharing view's storage)."""
    if isinstance(p, DTensor):
        view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    p.grad = view
