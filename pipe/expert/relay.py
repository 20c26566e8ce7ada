"""Two sides taking turns: one micro-batch's expert all-to-all travels while another's compute runs.

DualPipeV lists its steady state as pairs, a forward of one chunk beside a backward of the other
(different micro-batches); DeepSeek's DualPipe overlaps them so that the expert all-to-all of one
travels while the other computes (DeepSeek-V3 technical report, 2024, 3.2.1). `Relay.run(forward,
backward)` runs the pair's two halves, the forward on the calling thread and the backward on one
helper thread, EXACTLY ONE of them running at any time (pipe/pairs.py plans the pairs: DualPipeV's,
and 1F1B's or ZB-V's neighbouring F | B and F | I):

* the running side hands the turn to the other right after it launches an expert all-to-all
  (`hand_over()`, called by pipe/expert/in_flight.py's InFlight.start, the only switch point), and
  waits there until the turn comes back;
* when one side finishes, the other runs to its end without switching;
* an exception on either side ends both (the waiting side raises RelayAborted at its switch) and is
  raised on the caller once the helper thread has ended: no side is left waiting.

Why this overlaps on one CUDA stream: the forward launches its rows (NCCL's stream) and hands over;
the backward queues its kernels on the compute stream up to its own launch and hands back; the
forward's wait (a stream wait, not a host block) is queued only after the backward's kernels, so NCCL
moves the forward's rows while the backward computes, and the other way round. On CPU (gloo) the
exchange's own threads move the rows while the other side computes.

Deterministic: the switch points are the launches, fixed by the code and the model, not by timing,
and exactly one side runs, so every rank of an expert group, which runs the same steps of the same
layers, makes the same collectives in the same order (the expert exchanges and counts, ZeRO's
gathers and gradient reductions of the backward, on their groups); no rank can wait on a collective
its peers make later. The active relay is one module-level value, not thread-local: on CUDA the
autograd engine runs the backward on its own device thread, not on the thread that called backward.

What the two sides must not share: thread-local state is each side's own (grad mode, autocast,
saved-tensor hooks, torch's checkpoint and dispatch modes: the forward keeps the caller's; autograd's
device thread takes the helper thread's), and process-global state is swapped at every switch:
`kept`, pairs of (read it, set it), each side finds at its turn what it had left (the runner passes
pipe/deferred_linear.py's collecting sink: the forward's and the backward's recompute differ).
Nothing else in the package keeps such state across an expert layer: a Hugging Face stage's mask and
cos/sin cache (pipe/hf/layer_inputs.py) is keyed by the micro-batch's own tensors, so turns only
rebuild it; a checkpointed run's host offload is begun by forwards alone; the selective policy's flag
is thread-local.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, Callable, Sequence, TypeVar

import torch

__all__ = ["Relay", "RelayAborted", "hand_over", "relay_running"]

A = TypeVar("A")
B = TypeVar("B")
Kept = tuple[Callable[[], Any], Callable[[Any], None]]  # a process-global each side keeps its own value of

_active: "Relay | None" = None  # the relay running now, seen from any thread (autograd's device threads too)


class RelayAborted(RuntimeError):
    """The other side of the relay failed: this side stops at its next switch (its error is the caller's)."""


def relay_running() -> bool:
    """Is a relay running its two sides now (on any thread)?"""
    return _active is not None


def hand_over() -> None:
    """Right after an expert all-to-all is launched: while a relay runs, the other side takes the turn and
    this side waits for it to come back; elsewhere a no-op."""
    relay = _active
    if relay is not None:
        relay._switch()


class Relay:
    """Runs two callables in turns, exactly one at a time, switching at each `hand_over()`."""

    def __init__(self, kept: Sequence[Kept] = ()):
        self._kept = list(kept)
        self._cond = threading.Condition()
        self._turn, self._done, self._failed = 0, [False, False], False
        self._values: list[list[Any]] = [[], []]
        self.switches = 0  # hand-overs in the last run (tests read it)

    def run(self, first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
        """first() here, second() on a helper thread, in turns; both results, or the first real error."""
        global _active
        if _active is not None:
            raise RuntimeError("Relay.run inside a running relay: relays do not nest")
        start = [get() for get, _ in self._kept]
        self._values, self.switches = [list(start), list(start)], 0
        self._turn, self._done, self._failed = 0, [False, False], False
        results: list[Any] = [None, None]
        errors: list[BaseException | None] = [None, None]
        helper = threading.Thread(target=self._side, args=(1, second, results, errors, _caller_state()),
                                  name="pipezero-relay", daemon=True)
        _active = self
        try:
            helper.start()
            self._side(0, first, results, errors, None)
            helper.join()
        finally:
            _active = None
            self._restore(start)
        real = [e for e in errors if e is not None and not isinstance(e, RelayAborted)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        return results[0], results[1]

    # -- the two sides ------------------------------------------------------------------------
    def _side(self, me: int, fn: Callable[[], Any], results: list, errors: list,
              state: Callable[[], ExitStack] | None) -> None:
        try:
            with state() if state is not None else ExitStack():
                if me == 1:
                    self._wait_turn(1)  # the first side's first launch, or its end
                results[me] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors[me] = err
            with self._cond:
                self._failed = True
        finally:
            with self._cond:
                self._done[me] = True
                self._turn = 1 - me
                self._cond.notify_all()

    def _switch(self) -> None:
        """The running side hands the turn over and waits for it to come back."""
        with self._cond:
            me = self._turn
            if self._done[1 - me]:
                return  # the other side has ended: run on
            self._values[me] = [get() for get, _ in self._kept]
            self._turn = 1 - me
            self.switches += 1
            self._cond.notify_all()
        self._wait_turn(me)

    def _wait_turn(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me or self._failed)
            if self._failed:
                raise RelayAborted("the other side of the pair failed")
        self._restore(self._values[me])

    def _restore(self, values: Sequence[Any]) -> None:
        for (_, set_value), value in zip(self._kept, values):
            set_value(value)


def _caller_state() -> Callable[[], ExitStack]:
    """What the helper thread must share with the caller's: grad mode, and on CUDA the device and stream
    (both thread-local; a new thread would start on device 0's default stream)."""
    grad = torch.is_grad_enabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def enter() -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        if stream is not None:
            stack.enter_context(torch.cuda.device(stream.device))
            stack.enter_context(torch.cuda.stream(stream))
        return stack
    return enter
