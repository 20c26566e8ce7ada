"""The rank grid (pipe x data x expert x sequence x tensor) over torch's DeviceMesh."""

from pipezero.topology.grid import AXES, FLATTENED, Coords, Grid, axis_groups, grid_shape, grid_sizes, rank_coords
from pipezero.topology.device import default_backend, device_for, process_device
from pipezero.topology.env import init_distributed

__all__ = ["AXES", "FLATTENED", "Coords", "Grid", "axis_groups", "default_backend", "device_for", "grid_shape",
           "grid_sizes", "init_distributed", "process_device", "rank_coords"]
