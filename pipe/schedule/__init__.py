"""Schedules as data, apart from the executor: actions, placement, the schedules and their registry,
the validator, the simulator, the pictures, and the timeline the executor measures (compared with
the simulator's). Only timeline.py's gather_events touches a process group.

The public names are pipezero.pipe's (`from pipezero.pipe import GPipe, simulate, validate`).
"""
