"""Which checkpoint a job resumes from: the latest under its checkpoint folder, or the one --resume-from names.

A job reads the chosen checkpoint twice: its batch sizes before the parts exist (`saved_batch`: a
resume on another data degree keeps the global batch) and its state after (`load_state`). Both
reads go to the same choice, made once here, so `--resume-from step_00000002` reaches step 2 even
when the latest checkpoint is damaged (the recovery files.py's errors name works as written).

    point = resume_point(out / "checkpoints", args.resume_from)     # before any collective
    cfg = ... keep_global_batch(cfg.batch, point_batch(point))
    meta = resume_from_point(parts, point, model_config)            # None: start fresh
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pipezero.train.checkpoint.files import latest_step, step_dir_name
from pipezero.train.checkpoint.state import load_state, saved_batch
from pipezero.train.config.batch import BatchConfig

__all__ = ["ResumePoint", "point_batch", "resume_from_point", "resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to resume: the folder of its step_* folders, and its step (None: the one `latest` names)."""

    root: Path
    step: int | None

    def __str__(self) -> str:
        return str(self.root / (step_dir_name(self.step) if self.step is not None else "latest"))


def resume_point(ckpt_dir: str | os.PathLike, resume_from: str | None = None) -> ResumePoint | None:
    """The checkpoint to resume (None: start fresh); reads no tensor, needs no process group.

    `resume_from` None: the latest under `ckpt_dir`, if any; a step folder's name (step_00000012):
    that step under `ckpt_dir`; a path to a step folder: that one, wherever it lies.
    """
    ckpt_dir = Path(ckpt_dir)
    if resume_from is None:
        return ResumePoint(ckpt_dir, None) if latest_step(ckpt_dir) is not None else None
    path = Path(resume_from)
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        raise ValueError(f"--resume-from {resume_from!r}: expected a checkpoint folder name like step_00000012 "
                         f"(see {ckpt_dir}), or the path of one")
    root = path.parent if len(path.parts) > 1 else ckpt_dir
    if not (root / name).is_dir():
        found = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        raise FileNotFoundError(f"--resume-from {resume_from}: no such checkpoint under {root}; there are {found}")
    return ResumePoint(root, int(name[5:]))


def point_batch(point: ResumePoint | None) -> BatchConfig | None:
    """The batch sizes the chosen checkpoint was trained with (None: starting fresh, or an old checkpoint)."""
    return None if point is None else saved_batch(point.root, point.step)


def resume_from_point(parts: Any, point: ResumePoint | None,
                      model_config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Load the chosen checkpoint into `parts` (every rank); its meta, or None to start fresh."""
    if point is None:
        return None
    return load_state(parts, point.root, point.step, model_config=model_config)
