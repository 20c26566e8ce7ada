"""The planner: every layout of a job (layout.py), its step time (step_time.py, the schedule simulator
per rank) and peak memory (memory.py) for a model (model.py) on some hardware (hardware.py), ranked,
and the winner's ds_config (planner.py); `pipezero plan` is cli.py.

`pipezero.train.plan` was one module before it was this folder: its names are here as they were.
"""

from pipezero.train.plan.planner import (Prediction, ds_config, explain, format_table, plan, predict,
                                         torchrun_command, write_config)

__all__ = ["Prediction", "ds_config", "explain", "format_table", "plan", "predict", "torchrun_command",
           "write_config"]
