"""W&B beside TensorBoard: ds_config's wandb section (DeepSpeed's keys) and --wandb, offline.

The main job runs 3 steps with --wandb and WANDB_MODE=offline; the offline run's .wandb file,
read back by wandb's own reader (`wandb leet inspect --json`), holds every scalar of the
TensorBoard event file at the same step with the same value. Resumed to 5 steps in the same
folder, it logs steps 4 and 5 into the same W&B run (the same id). The section's keys are DeepSpeed
0.19.8's own (its WandbConfig's fields); a missing wandb package is refused before training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from harness import run

TINY = ["--pipe", "1", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
        "--micro-batches", "2", "--eval-interval", "2", "--save-interval", "100"]


def _job(out: str, wandb_dir: str, steps: int = 3) -> float:
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_SILENT="true")
    try:
        from pipezero.train.gpt.job import main
        return main(["--out", out, "--wandb", "pz-test", *TINY, "--steps", str(steps)])
    finally:
        for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT"):
            os.environ.pop(key, None)


def _wandb_rows(file: Path) -> dict[int, dict[str, float]]:
    """The history rows of one offline run's .wandb file, by step, through wandb's own reader."""
    cli = Path(sys.executable).with_name("wandb")
    done = subprocess.run([str(cli), "leet", "inspect", "--json", str(file)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows: dict[int, dict[str, float]] = {}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows.setdefault(int(item["_step"]), {}).update(item)
        if record.get("type") == "run":
            assert record["run"]["project"] == "pz-test", record
    return rows


def test_wandb_offline_run_holds_the_tensorboard_scalars(tmp_path):
    run(_job, 1, str(tmp_path / "out"), str(tmp_path), timeout=240)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "val/loss", "train/lr", "perf/tokens_per_s"} <= set(tags), tags
    files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows = _wandb_rows(files[0])
    assert sorted(rows) == [1, 2, 3], sorted(rows)
    for tag in tags:
        for event in acc.Scalars(tag):
            got = rows[event.step].get(tag)
            assert got == pytest.approx(event.value, rel=1e-6, abs=1e-30), (tag, event.step, got, event.value)

    # resumed in the same folder (--steps 5 after 3): the same W&B run goes on from step 4
    run(_job, 1, str(tmp_path / "out"), str(tmp_path), 5, timeout=240)
    again = [f for f in tmp_path.glob("wandb/offline-run-*/run-*.wandb") if f != files[0]]
    assert len(again) == 1, again
    assert again[0].stem == files[0].stem, (again[0], files[0])  # run-<id>: the same id
    assert sorted(_wandb_rows(again[0])) == [4, 5]


def test_wandb_section_keys_are_deepspeeds_and_a_missing_package_is_refused(monkeypatch):
    from deepspeed.monitor.config import WandbConfig as DeepSpeedWandb

    from pipezero.config_fields import ConfigError
    from pipezero.train.config import parse_config
    from pipezero.train.config.monitor import WandbConfig
    from pipezero.train.finetune import parse_args, train_config

    ours = WandbConfig()
    theirs = DeepSpeedWandb()
    assert set(WandbConfig.__dataclass_fields__) == set(DeepSpeedWandb.model_fields)
    assert all(getattr(ours, k) == getattr(theirs, k) for k in WandbConfig.__dataclass_fields__)
    cfg = parse_config({"train_batch_size": 1, "wandb": {"enabled": "true", "project": "p", "group": "g",
                                                          "team": "t"}})
    assert cfg.wandb == WandbConfig(enabled=True, project="p", group="g", team="t")
    with pytest.raises(ConfigError, match="projct"):
        parse_config({"train_batch_size": 1, "wandb": {"enabled": True, "projct": "p"}})
    finetune = train_config(parse_args(["--wandb", "--steps", "2"]), None, 128)  # the flag reaches the config
    assert finetune.wandb == WandbConfig(enabled=True, project="pipezero")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"pip install 'pipezero\[wandb\]'"):
        parse_config({"train_batch_size": 1, "wandb": {"enabled": True}})
