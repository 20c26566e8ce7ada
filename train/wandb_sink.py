"""Weights & Biases as a second sink of train/log.py's scalar writer: the same scalars, the same steps.

`wandb` is imported only when a run is opened (an optional extra: `pip install 'pipezero[wandb]'`),
so a job without W&B never loads it. The run's files go to <output_path>/wandb unless WANDB_DIR
names another folder; WANDB_MODE=offline keeps them there (`wandb sync` uploads them later).
A job resumed into the same output folder goes on logging into the same W&B run: the run's id
is kept in <output_path>/wandb_run_id (delete the file to start a new run there).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Mapping

from pipezero.train.config.monitor import WandbConfig

__all__ = ["WandbSink", "run_id"]

ID_FILE = "wandb_run_id"


class WandbSink:
    """One W&B run (ds_config's project, group and team); `log` a step's scalars, `close` finishes it."""

    def __init__(self, config: WandbConfig, output_path: str):
        try:
            import wandb
        except ImportError as err:
            raise ImportError("W&B logging (ds_config wandb.enabled, or --wandb) needs the wandb package: "
                              "pip install 'pipezero[wandb]', or turn W&B logging off") from err
        folder = None if os.environ.get("WANDB_DIR") else output_path
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        self._run: Any = wandb.init(project=config.project, group=config.group, entity=config.team, dir=folder,
                                    id=run_id(output_path), resume="allow")

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Scalars of one step (W&B merges calls of the same step into one row)."""
        if self._run is not None:
            self._run.log(dict(values), step=step)

    def close(self) -> None:
        """Finish the run (its files are complete afterwards)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def run_id(output_path: str) -> str:
    """The W&B run id of the job writing to output_path: the one kept there, else a new one, kept."""
    path = Path(output_path) / ID_FILE
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
    path.write_text(new + "\n")
    return new
