"""The 3D rank grid (pipe x data x tensor) over torch's DeviceMesh."""

from pipezero.topology.grid import AXES, Grid, grid_shape
from pipezero.topology.env import init_distributed

__all__ = ["AXES", "Grid", "grid_shape", "init_distributed"]
