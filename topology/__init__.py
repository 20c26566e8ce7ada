"""The 3D rank grid (pipe x data x tensor) over torch's DeviceMesh."""

from pipezero.topology.grid import AXES, Coords, Grid, grid_shape, rank_coords
from pipezero.topology.device import default_backend, device_for, process_device
from pipezero.topology.env import init_distributed

__all__ = ["AXES", "Coords", "Grid", "default_backend", "device_for", "grid_shape", "init_distributed",
           "process_device", "rank_coords"]
