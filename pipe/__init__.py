"""Pipeline parallelism: layer specs, schedules as data, simulator, executor."""

from pipezero.pipe.actions import Action, Op, Schedule

__all__ = ["Action", "Op", "Schedule"]
