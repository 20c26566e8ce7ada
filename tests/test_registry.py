"""The schedule registry: every entry is accepted by the config, `pipezero simulate` and
train_gpt.py's parser, and trains through build() to the same losses as 1F1B (fp32)."""

import sys
from pathlib import Path

import pytest
import torch

from harness import run
from pipezero.pipe import SCHEDULES, make_schedule, schedule_entry, schedule_names
from pipezero.train.cli import main as cli
from pipezero.train.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPTConfig, gpt_loss, gpt_specs  # noqa: E402
import train_gpt  # noqa: E402

TINY = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)


def _config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "pipeline": {"stages": 2, "schedule": name}}


def test_the_table_lists_every_schedule_with_its_class_defaults():
    assert schedule_names() == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
    assert [(e.chunks, e.placement) for e in SCHEDULES.values()] == [
        (1, "looped"), (1, "looped"), (2, "looped"), (1, "looped"), (2, "v"), (2, "v")]
    assert schedule_entry("ZeroBubbleV").name == "zbv" and schedule_entry("DualPipeV").name == "dualpipev"
    assert make_schedule("interleaved_1f1b", 8, chunks=3).num_chunks == 3
    with pytest.raises(ValueError, match="expected one of gpipe, 1f1b"):
        schedule_entry("2f2b")
    with pytest.raises(ValueError, match="runs 2 chunk"):
        make_schedule("zbv", 8, chunks=3)
    with pytest.raises(ValueError, match="chunks >= 2"):
        make_schedule("interleaved_1f1b", 8, chunks=1)


@pytest.mark.parametrize("name", schedule_names())
def test_every_entry_point_accepts_every_schedule(name, tmp_path, capsys):
    entry = SCHEDULES[name]
    cfg = parse_config(_config(name), world_size=2)
    assert (cfg.pipeline.schedule, cfg.pipeline.chunks) == (name, entry.chunks)
    assert cli(["simulate", "--schedule", name, "--stages", "2", "--microbatches", "4",
                "--png", str(tmp_path / "s.png")]) == 0
    assert type(entry.cls(num_microbatches=4)).__name__ in capsys.readouterr().out
    args = train_gpt.parse_args(["--schedule", name])
    assert parse_config(train_gpt.ds_config(args), world_size=2).pipeline.schedule == name


def test_chunks_reach_config_cli_and_train_gpt(tmp_path, capsys):
    args = train_gpt.parse_args(["--schedule", "interleaved_1f1b", "--chunks", "3", "--layers", "6"])
    assert parse_config(train_gpt.ds_config(args), world_size=2).pipeline.chunks == 3
    assert cli(["simulate", "--schedule", "interleaved_1f1b", "--chunks", "3", "--stages", "2",
                "--microbatches", "4", "--png", str(tmp_path / "s.png")]) == 0
    assert "num_chunks=3" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r'\["chunks"\] = 3: schedule "dualpipev" runs 2'):
        parse_config({**_config("dualpipev"), "pipeline": {"stages": 2, "schedule": "dualpipev", "chunks": 3}},
                     world_size=2)
    with pytest.raises(SystemExit, match="zb_h1"):
        cli(["simulate", "--schedule", "zb_h1", "--chunks", "2"])


def _losses_per_schedule() -> dict:
    from pipezero.train.build import build

    out = {}
    for name in schedule_names():
        parts = build(_config(name), specs=gpt_specs(TINY), loss_fn=gpt_loss)
        losses = []
        for step in range(2):
            x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(step))
            losses.append(parts.runner.train_step(x, x.roll(1, 1)).item())
            parts.optimizer.step()
            parts.optimizer.zero_grad()
        out[name] = (type(parts.schedule).__name__, parts.module.num_chunks, losses)
    return out


def test_every_schedule_trains_through_build_to_the_same_losses():
    for got in run(_losses_per_schedule, 2):
        reference = got["1f1b"][2]
        for name, (cls, chunks, losses) in got.items():
            assert (cls, chunks) == (SCHEDULES[name].cls.__name__, SCHEDULES[name].chunks)
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5, msg=name)
