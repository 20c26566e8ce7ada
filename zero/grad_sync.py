"""Gradient reduction: post-accumulate-grad hooks, buckets in flight, the readiness protocol.

A parameter's gradient is "pushed" into its bucket's flat gradient buffer when it becomes
ready (a post-accumulate-grad hook), unless reduction is held for it (`hold`, the pipeline
runner's readiness protocol) or suspended (`no_sync`, gradient accumulation); a bucket whose
parameters are all pushed is reduced asynchronously while backward goes on. `finish()`
(called by step) pushes and reduces whatever is left, so correctness never depends on the
hooks, only overlap does.

GradSync is that shared machinery. What a bucket's buffer is, how a gradient enters it and
where the reduced values stay until step() hands them to the fp32 masters is one strategy
per ZeRO stage (Rajbhandari et al. 2020), in grad_strategies.py: replicated (stage 0),
persistent shards (stage 1), transient shards (stages 2-3). `make_grad_sync` picks it.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import torch

from pipezero.comm import Handle, all_reduce, reduce_scatter
from pipezero.zero.partition import Bucket, local_tensor

__all__ = ["GradSink", "GradSync"]

_MAX_IN_FLIGHT = 2  # bounded strategies: buckets whose reduction may be under way at once


@dataclass(eq=False)
class _Pending:
    """Per-bucket progress in the current step window."""

    grad: torch.Tensor | None = None     # full flat gradient buffer (the bucket's grad_dtype)
    pushed: set[int] | None = None       # parameter indices already in `grad` this round
    seen: set[int] | None = None         # parameter indices whose grad arrived this backward
    handle: Handle | None = None
    out: torch.Tensor | None = None      # where the reduction writes the owned values
    sent: torch.Tensor | None = None     # what the reduction reads: `grad`, or its copy in reduce_dtype
    reduced: bool = False                # reduced at least once since the last step
    dirty: bool = False                  # local gradients added into `grad` since the last launch
    shard: torch.Tensor | None = None    # transient shards: the reduced owned values so far
    rescale: bool = False                # persistent shards: the owned region holds an average, not a sum

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
    """A function calling `method` while its object lives (a no-op after): a hook holding it
    never keeps a dropped optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class GradSync(ABC):
    """Reduces the gradients of bucketed parameters over their buckets' groups as they become ready.

    A subclass (a strategy, grad_strategies.py) says what the buffer holds: `_push` moves a
    gradient in, `_keep` keeps a finished reduction, `_reduced` is what the master gets, `_reset`
    forgets; the other underscored methods have defaults it may refine. `on_backward_done(b)`
    is called when all of b's gradients arrived in a backward (stage 3 frees b's parameters);
    `sink` receives the reduced values instead of the masters' .grad (CPU offload). The hooks
    are never removed: they hold the GradSync weakly, so a dropped optimizer leaves no-ops.
    """

    # at most _MAX_IN_FLIGHT reductions under way (completing one frees its full buffer); with a
    # sink always (completing one starts its copy to the host)
    bounded = False

    def __init__(self, buckets: list[Bucket], on_backward_done: Callable[[Bucket], None] | None = None,
                 overlap: bool = True, sink: GradSink | None = None):
        self.buckets, self.overlap, self.sink = buckets, overlap, sink
        self.on_backward_done = on_backward_done
        self._state = {b: _Pending() for b in buckets}
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._held: set[int] = set()
        self._intact: set[int] = set()   # held, and their .grad left exactly as autograd accumulates it
        self._wide: dict[int, torch.Tensor] = {}  # intact ones' backward gradients summed in a wider grad_dtype
        self._suspended = 0
        self._in_flight: deque[Bucket] = deque()
        on_grad = _weak(self._on_grad)
        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(on_grad)

    # -- the readiness protocol ----------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; no reduction."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def hold(self, params: Iterable[torch.Tensor], intact: Iterable[torch.Tensor] = ()) -> None:
        """Do not reduce these parameters' gradients until released. `intact` (held too): their
        .grad stays exactly as autograd accumulates it, at every stage and even when reducing
        every micro-batch, because the caller adds to it before releasing (the pipeline's
        tie-group sum of shared weights).

        Reductions of an earlier round (a previous train_step before the same optimizer step) still
        under way are completed first: a gradient this round brings without a hook (an intact tied
        weight, a split backward's W assigning .grad) would otherwise land beside a bucket in flight,
        which flush does not push into and finish does not launch again: it would be lost."""
        self.wait()
        self._held.update(id(p) for p in params if id(p) in self._where)
        self._wide.clear()  # a failed step's partial sums (a completed one's were pushed)
        intact = {id(p) for p in intact if id(p) in self._where}
        self._held.update(intact)
        self._intact.update(intact)

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """From now on reduce these parameters' gradients as they become ready."""
        ids = {id(p) for p in params}
        self._held.difference_update(ids)
        self._intact.difference_update(ids)

    def tied_sums(self, params: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The intact parameters' gradients summed in their bucket's wider grad_dtype, by id (zeros
        where none arrived); pushed in place of their .grad when flushed."""
        for p in params:
            if id(p) in self._intact and self._widens(p):
                self._fold(p)
                if id(p) not in self._wide:
                    b, _ = self._where[id(p)]
                    self._wide[id(p)] = torch.zeros(local_tensor(p).shape, dtype=b.grad_dtype, device=b.device)
        return {i: self._wide[i] for i in (id(p) for p in params) if i in self._wide}

    def _widens(self, p: torch.Tensor) -> bool:
        b, _ = self._where[id(p)]
        return b.grad_dtype != b.dtype

    def _fold(self, p: torch.Tensor) -> None:
        """Add an intact parameter's .grad (one backward's) into its wide sum and drop it."""
        if p.grad is None:
            return
        grad = local_tensor(p.grad)
        if id(p) in self._wide:
            self._wide[id(p)].add_(grad)
        else:
            self._wide[id(p)] = grad.to(self._where[id(p)][0].grad_dtype)
        p.grad = None

    def _local_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """What is pushed for p: its wide sum (taken) if it has one, else its .grad (local part)."""
        wide = self._wide.pop(id(p), None)
        if wide is not None:
            return wide
        return None if p.grad is None else local_tensor(p.grad)

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
        .grad): a strategy that reduces every micro-batch pushes them now, one with a persistent
        buffer (stages 0-1) adds them into it as a hook would; else a no-op."""

    # -- step -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce everything not yet reduced and wait: every master shard has its .grad."""
        for b in self.buckets:
            st = self._state[b]
            if st.handle is None and (not st.reduced or self._late(b) or st.pushed or st.dirty):
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
        self._wide.clear()
        for b in self.buckets:
            st = self._state[b]
            st.pushed.clear()
            st.seen.clear()
            st.reduced, st.rescale, st.dirty, st.out, st.sent, st.shard = False, False, False, None, None, None
            self._reset(b)

    # -- what each strategy says ---------------------------------------------------------------
    @abstractmethod
    def _push(self, b: Bucket, i: int) -> None:
        """Move parameter i's local gradient into the bucket's flat buffer (marks i pushed)."""

    @abstractmethod
    def _keep(self, b: Bucket) -> None:
        """b's reduction finished (into `out`): keep the owned reduced values, or give them to the sink."""

    @abstractmethod
    def _reduced(self, b: Bucket) -> torch.Tensor | None:
        """The reduced owned values for b's master (grad_dtype), None if nothing was reduced."""

    @abstractmethod
    def _reset(self, b: Bucket) -> None:
        """zero_grad: forget b's buffer and its parameters' .grad."""

    def _reduces_now(self, p: torch.Tensor) -> bool:
        """A hook fired for p: push it now (with overlap, unless suspended or held)."""
        return self.overlap and not self._suspended and id(p) not in self._held

    def _keep_local(self, b: Bucket, i: int) -> None:
        """A gradient not pushed yet waits in its parameter's .grad."""

    def _late(self, b: Bucket) -> bool:
        """Some parameter of b holds a gradient that was never pushed (its hook did not fire)."""
        return any(p.grad is not None or id(p) in self._wide for p in b.params)

    def _nothing_new(self, b: Bucket) -> bool:
        """flush: pushing b would only reduce what was reduced already."""
        return False

    # -- internals ------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        st = self._state[b]
        if id(p) in self._intact and self._widens(p):
            self._fold(p)
        if self._reduces_now(p):
            self._settle(b)                # a second synced backward before step: fold in
            self._push(b, i)
            if len(st.pushed) == len(b.params):
                self._launch(b)
        else:
            self._keep_local(b, i)
        st.seen.add(i)
        if len(st.seen) == len(b.params):
            st.seen.clear()
            if self.on_backward_done is not None:
                self.on_backward_done(b)

    def _settle(self, b: Bucket) -> None:
        """Complete bucket b's reduction if it is still under way."""
        if self._state[b].handle is not None:
            self._in_flight.remove(b)
            self._complete(b)

    def _add_local(self, b: Bucket, i: int) -> None:
        """Add parameter i's .grad into the bucket buffer (not yet reduced) and drop it."""
        st, p = self._state[b], b.params[i]
        grad = self._local_grad(p)
        if grad is not None:
            b.slot(st.grad, i).add_(grad)
            p.grad = None
            st.dirty = True

    def _launch(self, b: Bucket) -> None:
        """Start b's reduction over its group in its reduce_dtype: average in place when b is replicated
        (stage 0 or a group of one), else reduce-scatter into a new shard-sized `out`. A bucket whose
        sum is divided by another count than its group's size (zero_mean_over) sums here and divides
        when the reduction completes."""
        st = self._state[b]
        st.sent = st.grad.to(b.reduce_dtype)  # the buffer itself when it already is in that dtype
        mean = b.reduction.is_mean
        if b.parts == 1:
            st.out = st.sent
            st.handle = all_reduce(st.sent, group=b.group, average=mean, async_op=True)
        else:
            st.out = torch.empty(b.shard_numel, dtype=st.sent.dtype, device=b.device)
            st.handle = reduce_scatter(st.out, st.sent, group=b.group, average=mean, async_op=True)
        self._in_flight.append(b)
        while (self.bounded or self.sink is not None) and len(self._in_flight) > _MAX_IN_FLIGHT:
            self._complete(self._in_flight.popleft())

    def _complete(self, b: Bucket) -> None:
        """Wait for bucket b's reduction and keep the owned reduced values (grad_dtype)."""
        st = self._state[b]
        st.handle.wait()
        if not b.reduction.is_mean:
            st.out.div_(b.reduction.mean_over)
        self._keep(b)
        st.handle, st.out, st.sent, st.reduced, st.dirty = None, None, None, True, False
        st.pushed.clear()

    def _hand_over(self, b: Bucket) -> None:
        """Give the reduced owned values to the master as its .grad (fp32, on its device)."""
        master = b.master
        if self.sink is not None:
            g = self.sink.hand_over(b)
            if g is not None:
                master.grad = g
            return
        g = self._reduced(b)
        if g is None:
            return
        master.grad = g if g.dtype == master.dtype and g.device == master.device \
            else g.to(master.device, master.dtype)
