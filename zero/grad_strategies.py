"""One GradSync strategy per ZeRO stage: what a bucket's gradient buffer holds, and for how long.

Gradients are summed and reduced in the bucket's grad_dtype (the model dtype unless ZeroConfig's
grad_accum_dtype widens it) until step() hands them to the fp32 masters, so between backward and
step the model state takes the paper's 2+2+12 bytes per parameter (2+4+12 when bf16 gradients
are summed in fp32), split as the stage says (ZeRO, Rajbhandari et al. 2020, section 5):

  0  ReplicatedSync       all-reduce (average) in place in a persistent full buffer;
                          .grad are views of it (as DDP's gradient buckets);
  1  PersistentShardSync  persistent full buffer, reduce-scatter; the owned region keeps
                          the reduced values across accumulation;
  2, 3 TransientShardSync the full buffer lives only from a bucket's first push until its
                          reduce-scatter is done; a shard-sized buffer keeps the reduced values.

`make_grad_sync` chooses one when the ZeroOptimizer is built; the shared machinery (hooks,
readiness protocol, buckets in flight) is GradSync in grad_sync.py.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from pipezero.zero.grad_sync import GradSink, GradSync, _weak
from pipezero.zero.partition import Bucket, local_tensor

__all__ = ["PersistentShardSync", "ReplicatedSync", "TransientShardSync", "make_grad_sync"]


def make_grad_sync(buckets: list[Bucket], stage: int,
                   on_backward_done: Callable[[Bucket], None] | None = None, overlap: bool = True,
                   every_microbatch: bool = False, sink: GradSink | None = None) -> GradSync:
    """The GradSync of a ZeRO stage (every_microbatch: stages 2-3 only, see TransientShardSync).

    Stage 0 summing or reducing in another dtype than its parameters' cannot make .grad a view of
    its buffer: it adds each gradient in, as stage 1 does (its buckets have one part, so the
    reduction is the same all-reduce); so does one whose sum is not a plain mean over its group
    (reduction.py's zero_mean_over: a buffer holding such a result cannot take the next round's sums)."""
    if stage == 0 and all(b.grad_dtype == b.reduce_dtype == b.dtype and b.reduction.is_mean for b in buckets):
        return ReplicatedSync(buckets, on_backward_done, overlap, sink)
    if stage <= 1:
        return PersistentShardSync(buckets, on_backward_done, overlap, sink)
    return TransientShardSync(buckets, on_backward_done, overlap, sink, every_microbatch)


class ReplicatedSync(GradSync):
    """Stage 0: every rank keeps the whole averaged gradient; parameters' .grad view the buffer.

    Autograd accumulates straight into the buffer, so accumulation needs no copy; a hook on
    each gradient first completes an all-reduce still writing the buffer it is about to add to.
    """

    def __init__(self, buckets: list[Bucket], on_backward_done: Callable[[Bucket], None] | None = None,
                 overlap: bool = True, sink: GradSink | None = None):
        super().__init__(buckets, on_backward_done, overlap, sink)
        for b in buckets:
            self._state[b].grad = torch.zeros(b.padded, dtype=b.grad_dtype, device=b.device)
            self._point_grads(b)
        settle = _weak(self._settle)
        for b in buckets:
            for p in b.params:
                p.register_hook(lambda grad, b=b: settle(b))

    def _push(self, b: Bucket, i: int) -> None:
        st, p = self._state[b], b.params[i]
        view = b.slot(st.grad, i)
        if p.grad is None:
            view.zero_()
        elif local_tensor(p.grad).data_ptr() != view.data_ptr():
            view.copy_(local_tensor(p.grad))
        _set_grad(p, view)
        st.pushed.add(i)

    def _late(self, b: Bucket) -> bool:
        """Never: .grad are views of the buffer, pushed or not."""
        return False

    def _keep(self, b: Bucket) -> None:
        if self.sink is not None:
            self.sink.reduced(b, b.owned(self._state[b].grad), accumulate=False)

    def _reduced(self, b: Bucket) -> torch.Tensor:
        return b.owned(self._state[b].grad)

    def _reset(self, b: Bucket) -> None:
        self._state[b].grad.zero_()
        self._point_grads(b)

    def _point_grads(self, b: Bucket) -> None:
        grad = self._state[b].grad
        for i, p in enumerate(b.params):
            _set_grad(p, b.slot(grad, i))


class PersistentShardSync(GradSync):
    """Stage 1: a full buffer per bucket for the whole step; after a reduce-scatter only the
    owned region is kept (the average), the rest is zeroed.

    Gradients not reduced yet (no_sync, hold) are added into the buffer at once and dropped
    from .grad, so accumulation never holds a second whole copy; those held intact stay in
    .grad until released. A new round on top of
    reduced values first turns the owned average back into a sum.
    """

    def __init__(self, buckets: list[Bucket], on_backward_done: Callable[[Bucket], None] | None = None,
                 overlap: bool = True, sink: GradSink | None = None):
        super().__init__(buckets, on_backward_done, overlap, sink)
        for b in buckets:
            self._state[b].grad = torch.zeros(b.padded, dtype=b.grad_dtype, device=b.device)

    def collect(self, params: Iterable[torch.Tensor]) -> None:
        """Gradients assigned without hooks (a split backward's W) go where a hook puts them: added
        into the buffer, in its grad_dtype, micro-batch by micro-batch (summed in .grad they would
        sum in the model's dtype)."""
        for p in params:
            if id(p) in self._where and id(p) not in self._intact and p.grad is not None:
                self._on_grad(p)

    def _push(self, b: Bucket, i: int) -> None:
        self._add_local(b, i)
        self._state[b].pushed.add(i)

    def _keep_local(self, b: Bucket, i: int) -> None:
        if id(b.params[i]) in self._intact:
            return
        self._settle(b)
        self._add_local(b, i)

    def _add_local(self, b: Bucket, i: int) -> None:
        st = self._state[b]
        if st.rescale:        # a new round on top of reduced values: make them a sum again
            b.owned(st.grad).mul_(_resum(b))
            st.rescale = False
        super()._add_local(b, i)

    def _keep(self, b: Bucket) -> None:
        st = self._state[b]
        if b.parts > 1:
            b.owned(st.grad).copy_(st.out)
            st.grad[:b.part * b.shard_numel].zero_()
            st.grad[(b.part + 1) * b.shard_numel:].zero_()
            st.rescale = True
        else:
            if st.out is not st.grad:  # reduced in place, in reduce_dtype: back into the sum's dtype
                st.grad.copy_(st.out)
            st.rescale = not b.reduction.is_mean  # every rank holds sum / mean_over, not the mean
        if self.sink is not None:
            self.sink.reduced(b, b.owned(st.grad), accumulate=False)

    def _reduced(self, b: Bucket) -> torch.Tensor:
        return b.owned(self._state[b].grad)

    def _reset(self, b: Bucket) -> None:
        self._state[b].grad.zero_()
        for p in b.params:
            p.grad = None


class TransientShardSync(GradSync):
    """Stages 2-3: a full buffer only while a bucket is being filled and reduced; the owned
    reduced values accumulate in a shard-sized buffer (or on the host, with a sink). Both buffers
    are in the bucket's grad_dtype and the reduction in its reduce_dtype, as DeepSpeed's ZeRO-2/3
    reduce each micro-batch in communication_data_type and sum the partitions in grad_accum_dtype.

    Inside no_sync / hold, whole .grad accumulate until the final micro-batch, unless
    `every_microbatch`: then every backward's gradients are pushed and reduce-scattered into
    the shard as if nothing were held, as DeepSpeed's ZeRO-2 does, except those held intact
    (the pipeline runner's tied weights, summed over their tie group first), which are
    reduced when released.
    """

    bounded = True

    def __init__(self, buckets: list[Bucket], on_backward_done: Callable[[Bucket], None] | None = None,
                 overlap: bool = True, sink: GradSink | None = None, every_microbatch: bool = False):
        super().__init__(buckets, on_backward_done, overlap, sink)
        self.every_microbatch = every_microbatch

    def collect(self, params: Iterable[torch.Tensor]) -> None:
        if not self.every_microbatch:
            return
        for p in params:
            if id(p) in self._where and id(p) not in self._intact and p.grad is not None:
                self._on_grad(p)

    def _reduces_now(self, p: torch.Tensor) -> bool:
        return (self.every_microbatch and id(p) not in self._intact) or super()._reduces_now(p)

    def _nothing_new(self, b: Bucket) -> bool:
        """b was reduced and no gradient arrived since (pushing would reduce zeros)."""
        st = self._state[b]
        return st.reduced and not st.pushed and not any(p.grad is not None or id(p) in self._wide for p in b.params)

    def _push(self, b: Bucket, i: int) -> None:
        st, p = self._state[b], b.params[i]
        if st.grad is None:   # a fresh buffer per round; each slot is written before launch
            st.grad = torch.empty(b.padded, dtype=b.grad_dtype, device=b.device)
            st.grad[b.numel:].zero_()
        if i in st.pushed:    # a second gradient before the bucket was reduced: add it
            self._add_local(b, i)
            return
        view = b.slot(st.grad, i)   # the slot's first write: a copy, not zeros plus an add
        grad = self._local_grad(p)
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        p.grad = None
        st.pushed.add(i)

    def _keep(self, b: Bucket) -> None:
        st = self._state[b]
        if self.sink is not None:                              # on the host (CPU offload)
            self.sink.reduced(b, st.out, accumulate=True)
        else:
            st.shard = st.out.to(b.grad_dtype) if st.shard is None else st.shard.add_(st.out)
        st.grad = None

    def _reduced(self, b: Bucket) -> torch.Tensor | None:
        return self._state[b].shard

    def _reset(self, b: Bucket) -> None:
        self._state[b].grad = None
        for p in b.params:
            p.grad = None


def _resum(b: Bucket) -> float:
    """What turns a kept reduced buffer back into this rank's share of the sum: the owner of a slice
    (parts > 1) holds sum / mean_over alone; every rank of an unsplit bucket holds it, so each takes
    its 1 / size of the sum (a plain mean then needs nothing)."""
    r = b.reduction
    return r.mean_over if b.parts > 1 else r.mean_over / r.size


def _set_grad(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` p's gradient (wrapped like p when p is a DTensor, still sharing view's storage)."""
    if isinstance(p, DTensor):
        view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    p.grad = view
