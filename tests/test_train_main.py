"""The main job in a shortened form, and a kill-and-restart under torchrun --max-restarts=1.

Both launch examples/train_gpt.py with torchrun --standalone as a user would (the harness's
pool cannot play torchrun's agent): pipe 2 x data 2 for a few steps with the TensorBoard
scalars read back; and 2 processes where rank 1 dies at step 3 on the first attempt only,
torchrun restarts the job, it resumes from the step-2 checkpoint and ends with exactly the
final loss of an uninterrupted run (the crash is injected by tests/faults/crash_train_gpt.py).
Runs that need no agent (the uninterrupted run, the seed's config) call the same main() in
the harness's workers: a torchrun launch costs every process a fresh import of torch.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from harness import run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
        "--micro-batches", "2", "--eval-interval", "2", "--steps-per-print", "2"]


def _torchrun(nproc: int, out: Path, *args: str, restarts: int = 0, env: dict | None = None,
              script: Path = ROOT / "examples" / "train_gpt.py"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", str(script), "--out", str(out), *TINY, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=full_env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


class _Lines(logging.Handler):
    """Keeps the messages of pipezero's log records (what rank 0 prints), whichever rank logs."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _main(argv: list[str]) -> tuple[float, list[str]]:
    """examples/train_gpt.py's main() in a harness worker: its final loss and its log messages."""
    import train_gpt

    lines = _Lines()
    logging.getLogger("pipezero").addHandler(lines)
    try:
        return train_gpt.main(argv), lines.lines
    finally:
        logging.getLogger("pipezero").removeHandler(lines)


def test_main_job_pipe2_data2_writes_tensorboard_and_checkpoint(tmp_path):
    done = _torchrun(4, tmp_path, "--pipe", "2", "--steps", "4", "--save-interval", "2", "--zero-stage", "2",
                     "--expect-device", "cpu")
    assert "device check: chunk 0 activation" in done.stderr
    assert f"saved checkpoint {tmp_path / 'checkpoints' / 'step_00000002'}" in done.stderr
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "val/loss", "train/lr", "train/loss_scale", "train/skipped_steps",
                "train/grad_norm", "perf/tokens_per_s", "pipeline/measured_bubble", "memory/peak_bytes",
                "comm/bytes/p2p_send"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert any(e.value > 0 for e in acc.Scalars("comm/bytes/p2p_send"))
    assert (tmp_path / "pipeline_measured_step4.png").is_file()  # the real step's timeline, always
    if importlib.util.find_spec("PIL") is not None:  # TensorBoard encodes images with pillow
        assert {"pipeline/simulated", "pipeline/measured"} <= set(acc.Tags()["images"])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (tmp_path / "model.safetensors").is_file()
    _sample_from_the_export(tmp_path)


def test_main_job_runs_the_seed_config_unchanged(tmp_path):
    """The seed's ds_config (ZeRO-3, optimizer and parameters offloaded, fp16) on pipe 2 x data 2,
    its batch keys as written; the loss falls. main() on 4 harness workers (the launch is
    test_main_job_pipe2_data2's)."""
    argv = ["--config", str(ROOT / "examples" / "configs" / "seed_ds_config.json"), "--out", str(tmp_path),
            "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--steps", "8",
            "--steps-per-print", "1", "--eval-interval", "100", "--save-interval", "100"]
    _, log = run(_main, 4, argv, timeout=400)[0]
    assert any("Grid(pipe=2, data=2, tensor=1), optimizer ZeroOptimizer(stage=3" in line for line in log), log[:3]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses


def _sample_from_the_export(out: Path) -> None:
    """The exported file rebuilds its GPT from the config in its header; the sampling command runs."""
    import generate
    from gpt import GPT, GPTConfig
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        cfg = json.loads(f.metadata()["gpt_config"])
    assert cfg == {"vocab_size": 256, "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 16, "seed": 0}
    GPT(GPTConfig(**cfg)).load_state_dict(load_file(str(out / "model.safetensors")))  # strict: every tensor
    text = generate.main(["--checkpoint", str(out), "--prompt", "def ", "--tokens", "8", "--temperature", "0"])
    assert text.startswith("def ") and len(text) > len("def ")

@pytest.mark.parametrize("pipe", [2])
def test_killed_rank_restarts_from_last_checkpoint(tmp_path, pipe):
    steps = ["--pipe", str(pipe), "--steps", "6", "--save-interval", "2", "--zero-stage", "0"]
    run(_main, 2, ["--out", str(tmp_path / "straight"), *TINY, *steps], timeout=240)  # uninterrupted
    crashed = _torchrun(2, tmp_path / "crashed", *steps, restarts=1, env={"PIPEZERO_CRASH_AT": "3:1"},
                        script=ROOT / "tests" / "faults" / "crash_train_gpt.py")
    assert "PIPEZERO_CRASH_AT: exiting at step 3" in crashed.stderr
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "crashed" / "summary.json").read_text())
    assert straight["resumed_from"] == 0 and resumed["resumed_from"] == 2
    bars = [line.split("]")[1].split()[0] for line in crashed.stderr.splitlines() if line.startswith("train [")]
    # torchrun may stop rank 0 before it draws step 3's bar; the restart resumes at 2 and counts on in global steps
    assert bars[:-4] in (["1/6", "2/6"], ["1/6", "2/6", "3/6"]) and bars[-4:] == ["3/6", "4/6", "5/6", "6/6"], bars
    assert resumed["final_loss"] == straight["final_loss"]


def test_help_shows_every_default(capsys):
    import train_gpt

    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("optimizer steps (default: 400)", "model width (default: 128)", "(default: runs/gpt)",
                  "interleaved_1f1b takes any >= 2"):
        assert shown in text
    assert "(default: None)" not in text


@pytest.mark.parametrize("script, name, cause", [
    ("train_gpt.py", "train_gpt.py", "FileNotFoundError: data file"),
    ("train_hf.py", "examples/train_hf.py", "ValueError: --data"),  # no --model: refused first
])
def test_a_known_failure_ends_with_one_line(tmp_path, script, name, cause):
    """Bad input ends the command with one line naming the cause and exit code 1 (PIPEZERO_TRACEBACK=1 gives
    the traceback); the fine-tuning job printed a whole traceback instead."""
    flag = "--data-path" if script == "train_gpt.py" else "--data"
    cmd = [sys.executable, str(ROOT / "examples" / script), "--pipe", "1", "--out", str(tmp_path / "o"), flag,
           str(tmp_path / "missing.txt")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    lines = [line for line in done.stderr.splitlines() if cause in line]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(name) and "missing.txt" in lines[0], lines
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
