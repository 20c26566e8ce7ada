"""The planner: every layout of a job (layout.py), its step time (step_time.py, the schedule simulator
per rank) and peak memory (memory.py) for a model (model.py) on some hardware (hardware.py), ranked,
and the winner's ds_config (planner.py); `pipezero plan` is cli.py.

`pipezero.train.plan` was one module before it was this folder: its names are here as they were,
whatever planner.py's `__all__` lists. They import planner.py on first use (pipezero/lazy.py), so
`pipezero plan --help` (cli.py) answers before torch loads.
"""

from pipezero.lazy import lazy_package

# planner.py's __all__, and write_config, public there though not in it
__all__ = ["Prediction", "ds_config", "explain", "format_table", "kit_table", "node_host", "plan", "predict",
           "predict_fitted", "torchrun_command", "write_config"]

lazy_package(__name__, {name: "pipezero.train.plan.planner" for name in __all__})
