"""examples/train_gpt.py with one injected crash, for the kill-and-restart test (tests/test_train_main.py).

PIPEZERO_CRASH_AT=step:rank makes that rank exit (code 17) just before training that step, on
torchrun's first attempt only, so the restarted job must resume from the last checkpoint. The
injection lives here, not in the example: it patches PipelineRunner.train_step, then runs the
example as torchrun would.
"""

import os
import runpy
import sys
from pathlib import Path

from pipezero.pipe.runner import PipelineRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _crash_before(at: int, rank: int) -> None:
    real, calls = PipelineRunner.train_step, [0]

    def train_step(self, *args, **kwargs):
        if (calls[0], self.grid.rank) == (at, rank):
            print(f"[rank {rank}] PIPEZERO_CRASH_AT: exiting at step {at}", file=sys.stderr, flush=True)
            os._exit(17)
        calls[0] += 1
        return real(self, *args, **kwargs)
    PipelineRunner.train_step = train_step


if __name__ == "__main__":
    spec = os.environ.get("PIPEZERO_CRASH_AT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _crash_before(*(int(v) for v in spec.split(":")))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
