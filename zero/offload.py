"""ZeRO-Offload's host side: gradients down during backward, the CPU step, parameters back up.

With `offload_optimizer` the fp32 master shards and the optimizer state live in host memory
and the optimizer steps there. What makes it fast is that the transfers hide behind work
the GPU or the CPU does anyway (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
Training", USENIX ATC 2021, section 4):

* a bucket's reduced gradient shard is copied into a pinned, reused host buffer on a side
  stream as soon as its reduction completes, while backward still runs (`reduced`). Stages 0-1
  copy once per step and land in fp32 (the GPU converts: the host has nothing to do); stages
  2-3 copy every micro-batch in the model dtype and a host thread (the lane) adds each landed
  copy into the bucket's fp32 sum at once. step() only waits for what is still under way
  (`hand_over`);
* the optimizer steps one bucket at a time, in the order the gradients landed, and each stepped
  master is uploaded (a non-blocking copy on a side stream) while the next bucket steps
  (`stepping`). When nothing between the hand-over and the core optimizer reads the gradients
  (ZeroOptimizer.step() directly over torch's optimizer: no loss scaler, no clipping link),
  the hand-over does not wait for the copies (`streaming`): each bucket steps as soon as its own
  gradient has landed (and, at stages 2-3, been folded), while the GPU still runs the end of
  backward;
* the step runs on every host core this process may use (torchrun sets OMP_NUM_THREADS=1;
  the cores are split over the local processes). Build Adam/AdamW with `fused=True`: torch's
  fused CPU kernel is one vectorised pass, 5.3x the foreach step measured on CPU (a torch
  optimizer of yours is not switched to it, its rounding differs from foreach in the last bit;
  ds_config's Adam over CUDA parameters is built fused, train/config/optim.py);
* optionally (`delayed=True`, the paper's delayed parameter update, DPU) the CPU step of step
  k's gradients runs in a background thread during step k+1's forward and backward, and its
  result reaches the model at step k+1's step(): the forward/backward of step k+1 uses
  parameters updated with the gradients of steps up to k-1. The loss-scale/overflow check and
  gradient clipping of step k still run in step k's step() (they need collectives); only the
  optimizer's element-wise update is deferred. It costs a second host fp32 gradient buffer.

With `offload_param` (stage 3) the owned parameter slices live in (pinned) host memory and are
uploaded when their submodule runs (see stage3.py), so the device holds only the working set,
on any data degree, one included.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import torch

from pipezero.comm import Handle
from pipezero.zero.partition import Bucket

__all__ = ["HostOffload", "host_copy", "host_threads", "upload"]


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t, pinned when a GPU may copy from it asynchronously."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if torch.cuda.is_available() and t.device.type == "cuda" else out


def host_threads() -> int:
    """Host cores for this process: the cores it may run on, split over torchrun's local processes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def upload(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Handle:
    """Copy host `src` into device `dst` on `stream`; wait() orders the current stream after it.

    `dst` was allocated on the current stream, so the copy first waits for the work queued there.
    """
    if stream is None or dst.device.type != "cuda":
        dst.copy_(src.view_as(dst))
        return Handle("", [])
    stream.wait_stream(torch.cuda.current_stream(dst.device))
    with torch.cuda.stream(stream):
        dst.copy_(src.view_as(dst), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return Handle("", [], lambda: torch.cuda.current_stream(dst.device).wait_event(done))


class HostOffload:
    """The host half of an offloaded ZeroOptimizer: gradient landing, the CPU step, the upload.

    `buckets`: the optimizer's buckets (masters on the host); `core`: the innermost torch
    optimizer, which the chain steps. GradSync calls `reduced` and `hand_over`; ZeroOptimizer
    wraps its inner step in `stepping` and publishes through `wait_upload`.
    """

    def __init__(self, buckets: list[Bucket], core: Any, delayed: bool = False):
        self.buckets, self.core, self.delayed = buckets, core, delayed
        self.threads = host_threads()
        cuda = [b for b in buckets if b.device.type == "cuda"]
        device = cuda[0].device if cuda else None
        self._down = torch.cuda.Stream(device) if device is not None else None
        self._up = torch.cuda.Stream(device) if device is not None else None
        self._landing: dict[Bucket, torch.Tensor] = {}   # pinned: the D2H copies land here
        self._grads: dict[tuple, torch.Tensor] = {}      # host fp32: sums, and what the master steps with
        self._flip = 0   # delayed: which of two sum buffers this step fills; the update in flight reads the other
        self._ready: dict[Bucket, Any] = {}              # this step's gradient so far: a tensor or a _Landing
        self._lane: ThreadPoolExecutor | None = None      # folds landed copies into the sums (GPU only)
        self._uploads: dict[Bucket, Any] = {}
        self._order: list[Bucket] = []                   # buckets in the order their gradients landed
        self._streaming = False                          # hand_over gives copies still landing (see streaming)
        self._unlanded: dict[Bucket, Any] = {}           # their copies or folds: a bucket steps once its own is done
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- gradients: device -> host (GradSync's GradSink) -----------------------------------
    def reduced(self, b: Bucket, values: torch.Tensor, accumulate: bool) -> None:
        """Start copying b's reduced owned gradient to the host: to be added to what this step
        already brought (accumulate) or to replace it. The device copy of `values` may be freed.

        From a GPU the copy lands in a pinned buffer while backward goes on: in fp32, ready as it
        is, when it replaces; in the model dtype when it adds, and the host lane folds it into b's
        fp32 sum as soon as it has landed. step() then finds the gradients made or under way.
        """
        if b not in self._order:
            self._order.append(b)
        adding = accumulate and b in self._ready
        running = _result(self._ready.pop(b, None))    # b's landing buffer is free again
        # a copy that replaces (stages 0-1, once per step) lands in fp32 and needs no host work;
        # one that adds (stages 2-3, every micro-batch) moves half the bytes and is folded
        source, done = self._copy_down(b, values, values.dtype if accumulate else torch.float32)
        if done is not None and not accumulate and not self.delayed:
            self._ready[b] = _Landing(source, done)   # the master steps with it once it has landed
        elif done is None and not adding and not self.delayed and source.dtype == torch.float32:
            self._ready[b] = source    # already fp32 on the host: the master steps with it as it is
        elif done is None:
            self._ready[b] = _fold(running if adding else self._sum_buffer(b), source, None, adding)
        else:
            total = running if adding else self._sum_buffer(b)
            self._ready[b] = _Landing(total, self._host_lane().submit(_fold, total, source, done, adding))

    def hand_over(self, b: Bucket) -> torch.Tensor | None:
        """At step: the host fp32 gradient for b's master (None if nothing was reduced).

        Delayed, it is always a buffer of our own: the update in flight reads the previous one.
        Streaming, a gradient still landing (or being folded) is given as it is and b's step
        waits for it.
        """
        pending = self._ready.pop(b, None)
        if self._streaming and isinstance(pending, _Landing):
            self._unlanded[b] = pending.done
            return pending.tensor
        return _result(pending)

    @contextmanager
    def streaming(self) -> Iterator[None]:
        """Inside, hand_over does not wait for gradients still landing or folding: only the core
        optimizer's per-bucket step may read the gradients it hands over (`stepping` waits for
        each bucket's copy first, and for all of them when it ends)."""
        self._streaming = True
        try:
            yield
        finally:
            self._streaming = False

    def discard(self) -> None:
        """Forget the gradients of this step (zero_grad without a step)."""
        for pending in self._ready.values():
            _result(pending)
        self._ready.clear()
        self._land_all()

    def _land_all(self) -> None:
        """Wait for every gradient handed over while still landing or folding."""
        for done in self._unlanded.values():
            _wait(done)
        self._unlanded.clear()

    def _host_lane(self) -> ThreadPoolExecutor:
        """One host thread that folds landed gradients (on every host core of this process)."""
        if self._lane is None:
            self._lane = ThreadPoolExecutor(1, "pipezero-offload", initializer=torch.set_num_threads,
                                            initargs=(self.threads,))
        return self._lane

    def _copy_down(self, b: Bucket, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """A non-blocking copy into b's pinned landing buffer (of `dtype`: the GPU converts) on the
        side stream, and its event."""
        if self._down is None or values.device.type != "cuda":
            return values, None
        landing = self._landing.get(b)
        if landing is None:
            landing = self._landing[b] = torch.empty(values.numel(), dtype=dtype, pin_memory=True)
        self._down.wait_stream(torch.cuda.current_stream(values.device))
        with torch.cuda.stream(self._down):
            landing.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._down)
        values.record_stream(self._down)   # the caller may free it; the copy still reads it
        return landing, done

    def _sum_buffer(self, b: Bucket) -> torch.Tensor:
        grad = self._grads.get((b, self._flip))
        if grad is None:
            grad = self._grads[(b, self._flip)] = torch.empty(b.shard_numel, dtype=torch.float32,
                                                pin_memory=b.device.type == "cuda")
        return grad

    # -- the step ---------------------------------------------------------------------------
    @contextmanager
    def stepping(self, after: Callable[[Bucket], None]) -> Iterator[None]:
        """Inside, the core optimizer steps bucket by bucket on every host core, calling `after(b)`
        behind each; delayed, it only records the request and the step runs in a background
        thread once the block ends (with the hyperparameters of now)."""
        self._wait_uploads()
        saved = self.core.__dict__.get("step")
        original = self.core.step
        requested: list[list[dict]] = []

        def step(closure: Any = None) -> None:
            if self.delayed:
                requested.append([dict(g) for g in self.core.param_groups])
            else:
                self._per_bucket(original, after, self.core.param_groups)
        self.core.step = step
        try:
            yield
        finally:
            self._land_all()
            if saved is None:
                del self.core.step
            else:
                self.core.step = saved
        if requested:
            self._thread = threading.Thread(target=self._background, args=(original, requested[0]), daemon=True)
            self._thread.start()
            self._flip ^= 1

    @property
    def in_flight(self) -> bool:
        """A delayed update is being computed (its masters' gradients must stay as they are)."""
        return self._thread is not None

    def settle(self, after: Callable[[Bucket], None]) -> None:
        """Delayed: wait for the update in flight, drop its gradients, publish it (`after` per bucket)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        for b in self.buckets:
            b.master.grad = None
            after(b)

    def start_upload(self, b: Bucket) -> None:
        """Copy b's stepped master into its model slice (asynchronously on a side stream to a GPU)."""
        if self._up is None or b.local.device.type != "cuda":
            b.publish_master()
            return
        self._up.wait_stream(torch.cuda.current_stream(b.local.device))
        with torch.cuda.stream(self._up):
            b.publish_master()
            done = torch.cuda.Event()
            done.record(self._up)
        self._uploads[b] = done

    def wait_upload(self, b: Bucket) -> None:
        """The current stream waits until b's model slice holds the stepped master."""
        done = self._uploads.get(b)
        if done is not None:
            torch.cuda.current_stream(b.local.device).wait_event(done)

    # -- internals -----------------------------------------------------------------------------
    def _per_bucket(self, step: Callable[[], Any], after: Callable[[Bucket], None], groups: list[dict]) -> None:
        """Step each bucket's master alone (landing order first), through a private param_groups list,
        so the shared groups are never edited (the delayed step runs beside the main thread)."""
        shared = self.core.param_groups
        landed = set(self._order)
        order = self._order + [b for b in self.buckets if b not in landed]
        try:
            with _num_threads(self.threads):
                for b in order:
                    landed = self._unlanded.pop(b, None)
                    if landed is not None:
                        _wait(landed)
                    self.core.param_groups = [dict(g, params=[b.master] if i == b.group_index else [])
                                              for i, g in enumerate(groups)]
                    step()
                    after(b)
        finally:
            self.core.param_groups = shared

    def _background(self, step: Callable[[], Any], groups: list[dict]) -> None:
        try:
            self._per_bucket(step, lambda b: None, groups)
        except BaseException as error:  # noqa: BLE001 - re-raised by settle() on the main thread
            self._error = error

    def _wait_uploads(self) -> None:
        """The masters are about to change: the last step's uploads must have read them."""
        for done in self._uploads.values():
            done.synchronize()
        self._uploads.clear()


def _fold(total: torch.Tensor, source: torch.Tensor, done: Any, adding: bool) -> torch.Tensor:
    """total = source (or total + source) once the copy into source has landed (`done`)."""
    if done is not None:
        done.synchronize()
    return total.add_(source) if adding else total.copy_(source)


class _Landing(NamedTuple):
    """A host gradient still being written: the tensor, to be read once `done` (the copy's CUDA
    event, or the lane's fold) has finished."""
    tensor: torch.Tensor
    done: Any


def _wait(done: Any) -> None:
    """Block until a copy's event has fired or a fold has run (re-raising its error)."""
    done.result() if isinstance(done, Future) else done.synchronize()


def _result(pending: Any) -> Any:
    """This step's gradient so far: waited for while its copy or its fold is under way."""
    if isinstance(pending, _Landing):
        _wait(pending.done)
        return pending.tensor
    return pending


@contextmanager
def _num_threads(n: int) -> Iterator[None]:
    """At least n intra-op threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(n, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)
