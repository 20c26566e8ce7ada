"""Preemption: SIGTERM on one rank mid-run saves a checkpoint at the next step boundary on every rank, exit 0.

The main job runs under torchrun (2 processes, pipe 2) and rank 1 alone gets SIGTERM before step 3
(tests/faults/signal_train_gpt.py): torchrun exits 0 and the latest checkpoint is step 3's (the save
interval would have saved none before step 6). pipezero finetune (2 harness workers) gets the same
signal on rank 1 before step 2 and ends with Preempted, a SystemExit of code 0, at step 2. A rerun of
each resumes from that step, and its losses equal an uninterrupted run's within 1e-5. `pipezero train`
sent SIGTERM alone passes it on to its workers (in sessions of their own): they save, all exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from harness import run

ROOT = Path(__file__).resolve().parents[1]
GPT = ["--pipe", "2", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
       "--micro-batches", "2", "--eval-interval", "100", "--save-interval", "100", "--steps", "5",
       "--zero-stage", "1"]


def _tb_losses(out: Path) -> dict[int, float]:
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def _gpt(out: str) -> float:
    from pipezero.train.gpt.job import main
    return main(["--out", out, *GPT])


def test_main_job_saves_and_exits_0_on_sigterm_then_resumes(tmp_path):
    run(_gpt, 2, str(tmp_path / "straight"), timeout=240)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "faults" / "signal_train_gpt.py"), "--out", str(tmp_path / "stopped"), *GPT]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PIPEZERO_SIGNAL_AT": "2:1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step 3 | SIGTERM: checkpoint of step 3 saved, stopping with exit code 0" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert not (tmp_path / "stopped" / "model.safetensors").exists()  # not finished: no export
    run(_gpt, 2, str(tmp_path / "stopped"), timeout=240)
    straight, resumed = _tb_losses(tmp_path / "straight"), _tb_losses(tmp_path / "stopped")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4, 5], (straight, resumed)
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], abs=1e-5), (step, straight, resumed)


def _finetune(out: str, signal_at: int | None) -> tuple[int | None, float]:
    """(the exit code of a Preempted job, else None; its loss) with SIGTERM on rank 1 before step `signal_at`."""
    from pipezero.pipe import PipelineRunner
    from pipezero.train.finetune import main
    from pipezero.train.preempt import Preempted

    real, calls = PipelineRunner.train_step, [0]

    def train_step(self, *args, **kwargs):
        if calls[0] == signal_at and self.grid.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        calls[0] += 1
        return real(self, *args, **kwargs)
    PipelineRunner.train_step = train_step
    try:
        return None, main(["--pipe", "2", "--seq-len", "32", "--steps", "4", "--out", out, "--micro-batches", "2",
                           "--batch-size", "2", "--eval-interval", "100", "--save-interval", "100", "--lr", "3e-3"])
    except Preempted as stop:
        return stop.code, float("nan")
    finally:
        PipelineRunner.train_step = real


def test_finetune_saves_and_exits_0_on_sigterm_then_resumes(tmp_path):
    straight = run(_finetune, 2, str(tmp_path / "straight"), None, timeout=240)
    stopped = run(_finetune, 2, str(tmp_path / "stopped"), 1, timeout=240)
    assert [code for code, _ in stopped] == [0, 0], stopped
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = run(_finetune, 2, str(tmp_path / "stopped"), None, timeout=240)
    assert resumed[0][1] == pytest.approx(straight[0][1], abs=1e-5)
    a, b = _tb_losses(tmp_path / "straight"), _tb_losses(tmp_path / "stopped")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4], (a, b)
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), (step, a, b)


def test_pipezero_train_passes_sigterm_on_to_its_workers(tmp_path):
    """SIGTERM to `pipezero train` alone (as Kubernetes stops a container) reaches torchrun's workers,
    which run in sessions of their own: they save the step's checkpoint and every process exits 0."""
    out = tmp_path / "out"
    steps = [*GPT, "--steps", "400"]
    cmd = [sys.executable, "-m", "pipezero.train.cli", "train", "--nproc-per-node", "2", "--out", str(out), *steps]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = []
    for line in proc.stderr:  # the first step's log line: training is under way on both ranks
        seen.append(line)
        if "step 1/400" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=180)
    log = "".join(seen) + rest
    assert proc.returncode == 0, log[-4000:]
    assert "SIGTERM: checkpoint of step" in log, log[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("step_") and int(latest[5:]) < 400, latest
