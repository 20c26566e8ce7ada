"""ds_config["wandb"]: Weights & Biases logging, DeepSpeed's keys (enabled, project, group, team).

The run's scalars go to W&B beside TensorBoard (train/log.py's one writer has it as a second
sink, train/wandb_sink.py). `wandb` is an optional extra (`pip install 'pipezero[wandb]'`): an
enabled section without it is refused here, on every rank, before any process group exists.
DeepSpeed's default project is "deepspeed"; `--wandb` without a name picks "pipezero".
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pipezero.config_fields import ConfigError, ConfigTypeError, Section

__all__ = ["WandbConfig"]


@dataclass(kw_only=True, slots=True, frozen=True)
class WandbConfig:
    """ds_config["wandb"]: whether, and into which project / group / team (W&B's entity), to log."""

    enabled: bool = False
    project: str = "deepspeed"   # DeepSpeed 0.19.8's default
    group: str | None = None
    team: str | None = None

    @classmethod
    def parse(cls, sec: Section) -> "WandbConfig":
        """Read the section; an enabled one needs the wandb package installed."""
        sec.check(("enabled", "project", "group", "team"))
        values = {key: sec.raw(key, None) for key in ("project", "group", "team")}
        for key, value in values.items():
            if value is not None and not isinstance(value, str):
                raise ConfigTypeError(f"{sec.where(key)} = {value!r}: expected a string")
        cfg = cls(enabled=sec.bool("enabled", False), project=values["project"] or "deepspeed",
                  group=values["group"], team=values["team"])
        if cfg.enabled and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"{sec.where('enabled')} is true (or --wandb was given) but the wandb package is not "
                              "installed: pip install 'pipezero[wandb]', or turn W&B logging off")
        return cfg
