"""A resume on a smaller data degree keeps the global batch through more accumulation steps.

An elastic restart onto fewer nodes reruns the main job's command on fewer processes. Here a
pipe 2 x data 2 run of examples/train_gpt.py stops after its step-K checkpoint and the same
command continues on 2 processes (pipe 2 x data 1): the accumulation steps double, the global
batch and the data position keep their meaning, and every loss matches the uninterrupted
4-process run within 1e-5 (only the order of the sums differs). The launches go through the
harness's worker pools (no torchrun start-up per run); tests/test_multinode.py does the same
with real torchrun agents.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from harness import run
from pipezero.train.config_batch import BatchConfig, keep_global_batch
from pipezero.train.config_fields import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

N, K = 8, 4  # steps, and the checkpoint the interrupted run stops after
ARGS = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
        "--micro-batches", "2", "--pipe", "2", "--steps", str(N), "--save-interval", str(K),
        "--eval-interval", "100", "--steps-per-print", "100"]


class _Stop(Exception):
    """Ends a run at the top of a step, on every rank alike (a node lost right after a checkpoint)."""


def _main(out: str, stop_at: int | None = None) -> None:
    import train_gpt

    def stop(step: int, rank: int) -> None:
        if step == stop_at:
            raise _Stop

    hook = train_gpt._crash_for_the_restart_test
    train_gpt._crash_for_the_restart_test = stop
    try:
        train_gpt.main(["--out", out, *ARGS])
    except _Stop:
        pass
    finally:
        train_gpt._crash_for_the_restart_test = hook


def losses(out: Path) -> dict[int, float]:
    """train/loss by step from a run's TensorBoard logs (a resumed run appends to the same folder)."""
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


@pytest.fixture(scope="session")
def straight_4(tmp_path_factory) -> Path:
    """The uninterrupted pipe 2 x data 2 run of N steps."""
    out = tmp_path_factory.mktemp("straight4")
    run(_main, 4, str(out), timeout=240)
    return out


def test_resume_on_half_the_data_degree_keeps_the_global_batch(straight_4, tmp_path):
    run(_main, 4, str(tmp_path), K, timeout=240)     # 4 processes until the step-K checkpoint
    run(_main, 2, str(tmp_path), timeout=240)        # the same command on 2: pipe 2 x data 1
    manifest = json.loads((tmp_path / "checkpoints" / f"step_{N:08d}" / "manifest.json").read_text())
    assert manifest["world"] == 2 and manifest["grid"]["data"] == 1
    assert manifest["meta"]["batch"] == {"train_batch_size": 8, "micro_batch_size": 2,
                                         "accumulation_steps": 4, "data_degree": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from"] == K
    truth, resumed = losses(straight_4), losses(tmp_path)
    assert sorted(resumed) == list(range(1, N + 1))
    torch.testing.assert_close(torch.tensor([resumed[s] for s in range(1, N + 1)]),
                               torch.tensor([truth[s] for s in range(1, N + 1)]), rtol=0, atol=1e-5)


def _batch(tbs: int, mbs: int, gas: int, dp: int) -> BatchConfig:
    return BatchConfig(train_batch_size=tbs, micro_batch_size=mbs, accumulation_steps=gas, data_degree=dp)


def test_keep_global_batch_rule():
    saved = _batch(16, 2, 2, 4)
    assert keep_global_batch(_batch(8, 2, 2, 2), saved) == _batch(16, 2, 4, 2)    # fewer nodes: more steps
    assert keep_global_batch(_batch(4, 2, 2, 1), saved) == _batch(16, 2, 8, 1)
    assert keep_global_batch(_batch(32, 2, 2, 8), saved) == _batch(16, 2, 1, 8)   # more nodes: fewer
    assert keep_global_batch(_batch(8, 2, 1, 4), saved) == _batch(8, 2, 1, 4)     # same degree: untouched
    assert keep_global_batch(_batch(8, 2, 2, 2), None) == _batch(8, 2, 2, 2)      # no checkpoint
    with pytest.raises(ConfigError, match=r"16 is not divisible by micro batch 2 x data degree 3 = 6"):
        keep_global_batch(_batch(12, 2, 2, 3), saved)
