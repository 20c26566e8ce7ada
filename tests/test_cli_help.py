"""The command line answers before torch loads, shows its defaults, and `pipezero train` needs no config.

`pipezero --help`, `pipezero train --help`, `pipezero finetune --help` and `pipezero plan --help` took
35 s on a loaded machine: torch was imported before argparse ran. One subprocess asks each for its
help and reports whether torch (or transformers) was imported. `pipezero train --steps 20` read
"20" as a config path; now CONFIG is optional and the launch line carries the flags.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_HELP = """
import contextlib, io, json, sys
from pipezero.train.cli import main
out = {}
for argv in ([], ["train"], ["finetune"], ["plan"], ["simulate"]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    out[" ".join(argv)] = text.getvalue()
out["imported"] = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(json.dumps(out))
"""


def test_help_imports_no_torch_and_shows_defaults():
    done = subprocess.run([sys.executable, "-c", _HELP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["imported"] == [], out["imported"]
    text = {k: " ".join(v.split()) for k, v in out.items() if k != "imported"}
    assert "{simulate,plan,train,finetune}" in text[""], text[""]
    for command, shown in (("train", ["optimizer steps (default: 400)", "(default: runs/gpt)", "--nproc-per-node",
                                      "[CONFIG]", "--wandb [PROJECT]", "--no-save-on-signal"]),
                           ("finetune", ["optimizer steps (default: 100)", "(default: runs/finetune)",
                                         "peak learning rate (AdamW, warm-up then cosine) (default: 2e-05)",
                                         "--wandb [PROJECT]", "--no-save-on-signal"]),
                           ("plan", ["transformer blocks (default: 4)", "(default: local)"]),
                           ("simulate", ["(default: 1f1b)"])):
        missing = [s for s in shown if s not in text[command]]
        assert not missing, (command, missing, text[command])
        assert "(default: None)" not in text[command] and "(default: True)" not in text[command], text[command]


def test_the_flags_choices_are_the_registrys():
    from pipezero.pipe.float8 import RECIPES
    from pipezero.pipe.lora import ALL_LINEAR, LoraConfig
    from pipezero.pipe.memory.recompute import MODES
    from pipezero.pipe.schedule.registry import schedule_names
    from pipezero.train.flags import FLOAT8_RECIPES, RECOMPUTE_MODES, SCHEDULE_NAMES

    assert list(SCHEDULE_NAMES) == schedule_names() and FLOAT8_RECIPES == RECIPES
    assert RECOMPUTE_MODES == MODES
    from pipezero.train import flags

    lora = LoraConfig()
    assert flags.ALL_LINEAR == ALL_LINEAR and flags.LORA_DEFAULTS == dict(
        lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, target_modules=lora.target_modules)


def test_train_runs_without_a_config(monkeypatch, tmp_path):
    """`pipezero train --steps 20` launches the job on the defaults' 2 processes with --steps 20; a CONFIG
    (positional or --config) still works; the launcher's flags stay out of the job's command line."""
    from pipezero.train import cli

    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "run_forwarding", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["train", "--steps", "20"]) == 0
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"pipeline": {"stages": 4}}))
    assert cli.main(["train", str(config), "--steps", "3", "--max-restarts", "2", "--data", "2"]) == 0
    assert cli.main(["train", "--config", str(config), "--nproc-per-node=3"]) == 0
    (a, b, c) = calls
    assert "--nproc-per-node=2" in a and a[a.index("pipezero.train.gpt.job") + 1:] == ["--steps", "20"], a
    assert "--nproc-per-node=8" in b and "--max-restarts=2" in b, b
    assert b[b.index("pipezero.train.gpt.job") + 1:] == [str(config), "--steps", "3", "--data", "2"], b
    assert "--nproc-per-node=3" in c and c[-2:] == ["--config", str(config)], c
    from pipezero.train.gpt.job import parse_args

    assert parse_args([str(config), "--steps", "3"]).config == str(config)  # what each process reads
    with pytest.raises(SystemExit):
        cli.main(["train", str(tmp_path / "missing.json")])


def test_train_launches_tensor_and_sequence_ranks_too(monkeypatch, tmp_path):
    """--sequence-parallel / --tensor (or the config's sequence_parallel_size) multiply the processes: pipe 2 x
    sequence 2 on 2 processes was refused by the job (the world did not divide)."""
    from pipezero.train import cli

    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "run_forwarding", lambda cmd: calls.append(cmd) or 0)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 2}))
    assert cli.main(["train", "--steps", "2", "--sequence-parallel", "2"]) == 0
    assert cli.main(["train", "--steps", "2", "--tensor", "2", "--data", "2"]) == 0
    assert cli.main(["train", str(config), "--pipe", "1"]) == 0
    assert cli.main(["train", "--steps", "2", "--expert-parallel", "2"]) == 0  # the job refuses it: the GPT
    assert [next(t for t in cmd if t.startswith("--nproc-per-node=")) for cmd in calls] == [
        "--nproc-per-node=4", "--nproc-per-node=8", "--nproc-per-node=2", "--nproc-per-node=4"], calls
