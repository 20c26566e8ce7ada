"""Pipeline parallelism: layer specs, schedules as data, simulator, executor."""

from pipezero.pipe.schedule.actions import Action, ActionTable, Op, PipelineSchedule, Schedule
from pipezero.pipe.costs import measure_layer_costs
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.runner import PipelineRunner, PipelineTimeout
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec
from pipezero.pipe.schedule.registry import SCHEDULES, make_schedule, schedule_entry, schedule_names
from pipezero.pipe.schedule.render import to_chrome_trace, to_image, to_png, to_text
from pipezero.pipe.schedule.schedules import (Custom, DualPipeV, GPipe, Interleaved1F1B, OneFOneB,
                                     ZeroBubbleH1, ZeroBubbleV)
from pipezero.pipe.schedule.simulate import Costs, SimResult, simulate
from pipezero.pipe.schedule.validate import ScheduleError, validate

__all__ = ["Action", "Op", "ActionTable", "PipelineSchedule", "Schedule",
           "LayerSpec", "TiedLayerSpec", "PipelineModule", "measure_layer_costs", "PipelineRunner", "PipelineTimeout",
           "GPipe", "OneFOneB", "Interleaved1F1B", "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV", "Custom",
           "SCHEDULES", "make_schedule", "schedule_entry", "schedule_names",
           "validate", "ScheduleError", "simulate", "Costs", "SimResult",
           "to_text", "to_chrome_trace", "to_png", "to_image"]
