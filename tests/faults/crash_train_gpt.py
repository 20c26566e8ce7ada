"""examples/train_gpt.py with one injected fault, for the restart tests (test_train_main.py, test_cluster.py).

Both faults strike just before training a step, on torchrun's first attempt only, so the
restarted job must resume from the last checkpoint. The injection lives here, not in the
example: it patches PipelineRunner.train_step, then runs the example as torchrun would.

* PIPEZERO_CRASH_AT=step:rank: that rank exits (code 17), a crashed process.
* PIPEZERO_STOP_AGENT_AT=step, set on one torchrun agent: its local rank 0 sends the agent
  SIGTERM, as Slurm does to a preempted node; the agent stops its workers and leaves the
  rendezvous open, so the other agents restart without it (a lost node).
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from pipezero.pipe import PipelineRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _before_step(at: int, fault) -> None:
    """Call fault(runner) when the runner is about to train step `at` (0-based) of this attempt."""
    real, calls = PipelineRunner.train_step, [0]

    def train_step(self, *args, **kwargs):
        if calls[0] == at:
            fault(self)
        calls[0] += 1
        return real(self, *args, **kwargs)
    PipelineRunner.train_step = train_step


def _crash(at: int, rank: int):
    def fault(runner) -> None:
        if runner.grid.rank == rank:
            print(f"[rank {rank}] PIPEZERO_CRASH_AT: exiting at step {at}", file=sys.stderr, flush=True)
            os._exit(17)
    return fault


def _stop_agent(at: int):
    def fault(runner) -> None:
        if os.environ.get("LOCAL_RANK") == "0":
            print(f"PIPEZERO_STOP_AGENT_AT: stopping this node's agent at step {at}", file=sys.stderr, flush=True)
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(60)  # the agent stops this worker first
            os._exit(17)
    return fault


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        if os.environ.get("PIPEZERO_CRASH_AT"):
            step, rank = (int(v) for v in os.environ["PIPEZERO_CRASH_AT"].split(":"))
            _before_step(step, _crash(step, rank))
        if os.environ.get("PIPEZERO_STOP_AGENT_AT"):
            step = int(os.environ["PIPEZERO_STOP_AGENT_AT"])
            _before_step(step, _stop_agent(step))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
