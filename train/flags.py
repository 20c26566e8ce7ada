"""The command line's shared pieces: argparse types, the defaults formatter, the W&B and preemption flags.

Every command (`pipezero simulate | plan | train | finetune`) builds its parser from these, and
this module imports neither torch nor another pipezero module, so `--help` answers before torch
loads and the commands' modules do not import each other for their flags.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["DefaultsHelp", "add_preempt_flag", "add_wandb_flag", "cost", "positive_int", "wandb_section"]

DEFAULT_WANDB_PROJECT = "pipezero"  # --wandb without a name, where the config names no project


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default; a flag whose default is None says in its own help what applies."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (expected >= 1)")
    return value


def cost(text: str) -> float:
    """argparse type: a finite number >= 0 (a cost in the simulator's time units)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def add_wandb_flag(p: argparse.ArgumentParser) -> None:
    """--wandb [PROJECT]: log the TensorBoard scalars to Weights & Biases too (ds_config's wandb section)."""
    p.add_argument("--wandb", nargs="?", const="", default=None, metavar="PROJECT",
                   help="log every TensorBoard scalar to Weights & Biases too, into PROJECT (default: the "
                        f"config's wandb.project, else {DEFAULT_WANDB_PROJECT!r}); needs pipezero[wandb]; "
                        "WANDB_MODE=offline keeps the run on disk")


def wandb_section(raw: dict[str, Any], project: str | None) -> None:
    """--wandb's value into a ds_config dict: its wandb section enabled, the project named (None: unchanged)."""
    if project is None:
        return
    section = dict(raw["wandb"]) if isinstance(raw.get("wandb"), dict) else {}
    section["enabled"] = True
    if project or not section.get("project"):
        section["project"] = project or DEFAULT_WANDB_PROJECT
    raw["wandb"] = section


def add_preempt_flag(p: argparse.ArgumentParser) -> None:
    """--no-save-on-signal: SIGTERM / SIGUSR1 end the job as Python does by default (train/preempt.py)."""
    p.add_argument("--no-save-on-signal", dest="save_on_signal", action="store_false",
                   help="by default SIGTERM or SIGUSR1 (a preemption, Slurm's warning) saves a checkpoint at the "
                        "next step boundary on every rank and exits 0; with this flag they stop the job as usual")
