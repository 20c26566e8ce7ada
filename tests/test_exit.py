"""Jobs that train correctly exit with code 0, in every configuration, every time.

tests/jobs/exit_job.py runs each case as two real processes that train three steps and then
leave as a script does; every rank must exit 0 with no abort on stderr. ZeRO-3 with both
offloads and fp16 (the seed's configuration) runs four times: its abort at exit ("terminate
called without an active exception", exit -6) was intermittent, and on a quiet machine the
runs pass even without the fix, so the last two tests check the fix's two parts directly
(each fails without its part).
"""

import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent / "jobs" / "exit_job.py"
SEED = "3-both-fp16-model-yes"
CASES = [SEED] * 4 + [
    "3-both-fp16-model-no", "3-none-bf16-model-yes", "3-optimizer-fp32-model-no", "2-optimizer-fp16-model-yes",
    "1-none-fp32-model-no", "0-none-bf16-model-yes", "2-none-fp16-pipe-yes", "1-optimizer-fp32-pipe-no",
    "0-none-bf16-pipe-no",
]


def test_every_job_exits_with_code_zero():
    done = subprocess.run([sys.executable, str(JOB), *CASES], capture_output=True, text=True, timeout=600,
                          env=_env())
    codes = {}
    for line in done.stdout.splitlines():
        case, *ranks = line.split()
        codes.setdefault(case, []).append([int(c) for c in ranks])
    assert sum(len(v) for v in codes.values()) == len(CASES), f"cases missing:\n{done.stdout}\n{done.stderr[-3000:]}"
    failed = {case: runs for case, runs in codes.items() if any(c != 0 for run in runs for c in run)}
    assert not failed, f"exit codes per run {failed}:\n{done.stderr[-3000:]}"
    assert "terminate called" not in done.stderr, done.stderr[-3000:]


def _env() -> dict:
    """A bare environment on the CPU (gloo) everywhere: with a GPU visible the two ranks would ask for cuda:0, cuda:1."""
    import os

    return {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "",
            **{k: os.environ[k] for k in ("PYTHONPATH", "HOME") if k in os.environ}}


def test_the_process_group_is_gone_before_the_interpreter_finalises():
    """The mechanism behind the exit codes, checked every time rather than by chance: a handler
    registered before init_distributed runs after pipezero's (atexit is last-in, first-out), so
    it sees whether the default group was destroyed while the interpreter was still whole."""
    code = ("import atexit, torch.distributed as dist\n"
            "from pipezero.topology.env import init_distributed\n"
            "atexit.register(lambda: print('initialised at exit:', dist.is_initialized(), flush=True))\n"
            "init_distributed()\n"
            "assert dist.is_initialized()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initialised at exit: False" in done.stdout, (done.stdout, done.stderr[-3000:])


def test_a_waited_handle_keeps_no_work_alive():
    """A finished collective's Work (and through it its tensors) is dropped at wait(): held past
    the step, gloo's threads could still own it at interpreter exit."""
    import torch

    from pipezero.comm.collectives import Handle

    class Work:
        def wait(self):
            return True

    handle = Handle("", [Work(), torch.futures.Future()])
    handle._works[1].set_result(None)
    handle.wait()
    assert handle._works == [] and handle.is_completed()
