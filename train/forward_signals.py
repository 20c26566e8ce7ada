"""The launcher's side of preemption: SIGTERM / SIGUSR1 to `pipezero train` reach its workers.

`pipezero train` (and `pipezero finetune --nproc`) run torchrun as a child process, and torchrun
starts each worker in a session of its own, so a signal sent to the launcher alone (Kubernetes
stops a container by signalling its first process) would end the launcher and leave the workers
training unseen. While the launcher waits, it catches SIGTERM and SIGUSR1 and sends them on to
torchrun's workers (its child processes, read from /proc), which save a checkpoint at the next
step boundary and exit 0 (train/preempt.py); torchrun then exits 0, and so does the launcher.
Where /proc does not list the children, the signal goes to torchrun, which passes it on to the
workers (it is told to handle SIGUSR1 too) but gives them only 30 s before killing them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["SIGNALS", "TORCHRUN_SIGNALS", "run_forwarding", "wait_forwarding"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption's signals (train/preempt.py: save, then exit 0)

# what torchrun itself turns into a shutdown of its workers with the same signal (its default, + SIGUSR1)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc), or [] where the kernel does not list them."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def run_forwarding(cmd: list[str]) -> int:
    """Run torchrun's command line `cmd` to its end, SIGTERM / SIGUSR1 passed on to its workers; its status."""
    proc = subprocess.Popen(cmd, env={**os.environ, "TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS})
    return wait_forwarding(proc)


def wait_forwarding(proc: subprocess.Popen) -> int:
    """proc.wait(), passing SIGTERM / SIGUSR1 that reach this process on to proc's children."""

    def forward(signum: int, frame: Any) -> None:
        workers = children(proc.pid)
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not workers:
            proc.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in SIGNALS}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
