"""The 3D rank grid (pipe x data x tensor) over torch's DeviceMesh."""

from pipezero.topology.grid import AXES, Coords, Grid, grid_shape, rank_coords
from pipezero.topology.env import init_distributed

__all__ = ["AXES", "Coords", "Grid", "grid_shape", "init_distributed", "rank_coords"]
