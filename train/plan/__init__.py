"""The planner: every layout of a job (layout.py), its step time (step_time.py, the schedule simulator
per rank) and peak memory (memory.py) for a model (model.py) on some hardware (hardware.py), ranked,
and the winner's ds_config (planner.py); `pipezero plan` is cli.py.

`pipezero.train.plan` was one module before it was this folder: its names are here as they were,
whatever planner.py's `__all__` lists.
"""

from pipezero.train.plan import planner as _planner
from pipezero.train.plan.planner import *  # noqa: F401,F403 - the old module's names
from pipezero.train.plan.planner import write_config  # public there, though not in its __all__

__all__ = [*_planner.__all__, "write_config"]
