"""examples/train_gpt.py where one rank gets SIGTERM before a step, as a preempted process does (test_preempt.py).

PIPEZERO_SIGNAL_AT=step:rank: just before training step `step` (0-based), that rank sends itself
SIGTERM. The job must finish that step on every rank, save its checkpoint and exit 0.
"""

import os
import runpy
import signal
import sys

from crash_train_gpt import EXAMPLE, _before_step


def _signal(rank: int):
    def fault(runner) -> None:
        if runner.grid.rank == rank:
            print(f"[rank {rank}] PIPEZERO_SIGNAL_AT: SIGTERM", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
    return fault


if __name__ == "__main__":
    step, rank = (int(v) for v in os.environ["PIPEZERO_SIGNAL_AT"].split(":"))
    _before_step(step, _signal(rank))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
