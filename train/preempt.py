"""Preemption: SIGTERM or SIGUSR1 saves a checkpoint at the next step boundary on every rank, then exit 0.

A preempted node gets SIGTERM (Kubernetes, a cloud's spot reclaim, Slurm at the end of a job's
time) and, from Slurm with `--signal=USR1@<seconds>`, SIGUSR1 as a warning first. The handler
only notes the signal; the loop asks `requested()` at each step boundary, where one all-reduce
(MAX) of the noted signal number over the whole job tells every rank whether any rank got one,
so all of them stop after the same step. The loop then saves that step's checkpoint and calls
`exit_if_requested`, which raises `Preempted` (a SystemExit with code 0): the process ends
successfully and a rerun of the same command resumes from that step. Nothing is lost: the step
in flight when the signal came completes and is in the checkpoint. The agreement costs one
all-reduce of one integer per step (bench: README's Preemption section).

    stop = Preemption(enabled=args.save_on_signal, device=parts.device)
    for step in range(start, steps):
        ...train one step...
        if stop.requested() or (step + 1) % save_interval == 0:
            save(step + 1)
        stop.exit_if_requested(step + 1, steps, close=tb.close)
    stop.restore()
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipezero.train.forward_signals import SIGNALS

__all__ = ["Preempted", "Preemption", "SIGNALS"]

log = logging.getLogger("pipezero.preempt")


class Preempted(SystemExit):
    """The job stopped for a signal after saving its checkpoint: exit code 0."""

    def __init__(self, step: int, signum: int):
        super().__init__(0)
        self.step, self.signum = step, signum


class Preemption:
    """Notes SIGTERM / SIGUSR1 (while installed) and agrees at each step boundary whether to stop."""

    def __init__(self, enabled: bool = True, device: torch.device | None = None):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.device = device or torch.device("cpu")
        self.noted = 0        # the signal this rank got (0: none)
        self.agreed = 0       # the largest any rank got, as of the last requested()
        self._previous: dict[int, Any] = {}
        if self.enabled:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.noted = signum

    def requested(self) -> bool:
        """Whether any rank got a signal: a collective (every rank calls it at the same step boundary)."""
        if not self.enabled:
            return False
        flag = torch.tensor([self.noted], dtype=torch.int32, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed = int(flag.item())
        return self.agreed != 0

    def exit_if_requested(self, step: int, steps: int, close: Callable[[], None] | None = None) -> None:
        """After requested() said so and step `step`'s checkpoint is saved: close the logs, raise Preempted.

        At the last step (`step == steps`) the run is complete: it ends as usual instead.
        """
        if not self.agreed or step >= steps:
            return
        name = signal.Signals(self.agreed).name
        log.info("step %d | %s: checkpoint of step %d saved, stopping with exit code 0; run the same command "
                 "again to resume from it", step, name, step)
        if close is not None:
            close()
        self.restore()
        raise Preempted(step, self.agreed)

    def restore(self) -> None:
        """Put back the handlers that were installed before (the loop is over)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
