"""The fault catalogue's bad command lines of `pipezero finetune` (issue 44 items 10, 19 and 2).

Each must end in argparse's one-line usage error, or a ValueError / FileNotFoundError naming the
flag, before any model is built or any process group started: never a silent default (a zero
batch became 1 and 4), never a step trained and then a ZeroDivisionError (--save-interval 0),
never an internal ds_config key for a flag the user passed (--steps 0).
"""

from __future__ import annotations

from pathlib import Path

from catalogue import Case


def _ft(*argv: str):
    def run(tmp: Path):
        from pipezero.train.finetune import main
        return main(["--out", str(tmp / "o"), *[a.replace("{tmp}", str(tmp)) for a in argv]])
    return run


def _resume_from(name: str):
    def run(tmp: Path):
        from pipezero.train.finetune import main
        (tmp / "o" / "checkpoints" / "step_00000002").mkdir(parents=True)
        return main(["--out", str(tmp / "o"), "--resume-from", name])
    return run


def _flag(flag: str, value: str, *words: str) -> Case:
    return Case("finetune", f"{flag} {value}", _ft(flag, value), (f"argument {flag}", value, *words))


ALL = [
    _flag("--micro-batches", "0", "not a positive integer"),
    _flag("--batch-size", "0", "not a positive integer"),
    _flag("--batch-size", "-2", "not a positive integer"),
    _flag("--save-interval", "0", "not a positive integer"),
    _flag("--eval-interval", "0", "not a positive integer"),
    _flag("--eval-batches", "0", "not a positive integer"),
    _flag("--steps", "0", "not a positive integer"),
    Case("finetune", "resume-from not a step", _resume_from("latest"), ("--resume-from 'latest'", "step_00000012")),
    Case("finetune", "resume-from a missing step", _resume_from("step_00000099"),
         ("--resume-from step_00000099", "no such checkpoint", "step_00000002")),
]
