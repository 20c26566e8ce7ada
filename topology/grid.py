"""Grid: the 3D rank grid (pipe x data x tensor) as an explicit, validated object.

Rank order puts tensor fastest, then data, then pipe, so the ranks of one tensor group
are adjacent (as in Megatron-LM and DeepSpeed): rank = (pipe * data_deg + data) * tensor_deg + tensor.
The grid is a torch DeviceMesh with dims ("pipe", "data", "tensor"); `grid.mesh` is that
mesh, so DTensor and FSDP work on its sub-meshes.

Across nodes: torchrun gives each node's agent one contiguous block of global ranks
(node n holds ranks n * nproc_per_node ... (n + 1) * nproc_per_node - 1), so the axes that
vary fastest stay inside a node. Tensor groups exchange activations in every layer and data
groups all-reduce or reduce-scatter every gradient, so they get the fast links inside a node
(NVLink); the pipe axis sends one activation per micro-batch between neighbouring stages and
is the one that crosses the slower network. With 2 nodes x 2 processes, pipe 2 x data 2
puts stage 0 (data ranks 0, 1) on one node and stage 1 on the other. When tensor x data is
a multiple of the processes per node, each stage owns whole nodes and only its data group
spans several of them; a tensor degree above the processes per node would cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipezero.topology.device import process_device
from pipezero.topology.env import init_distributed

AXES = ("pipe", "data", "tensor")


def grid_shape(world_size: int, pipe: int = 1, data: int | None = None, tensor: int = 1) -> tuple[int, int, int]:
    """Check the degrees against the world size and infer `data` when it is None.

    Pure arithmetic, so every rank raises the same ValueError before any collective.
    """
    for name, value in (("pipe", pipe), ("tensor", tensor), ("data", data)):
        if value is None and name == "data":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Grid({name}={value!r}): every degree must be a positive integer")
    if data is None:
        if world_size % (pipe * tensor):
            raise ValueError(
                f"Grid(pipe={pipe}, data=None, tensor={tensor}) cannot infer the data degree: "
                f"{world_size} processes do not divide by pipe*tensor={pipe * tensor}; "
                f"start a multiple of {pipe * tensor} processes or change pipe/tensor")
        data = world_size // (pipe * tensor)
    if pipe * data * tensor != world_size:
        raise ValueError(
            f"Grid(pipe={pipe}, data={data}, tensor={tensor}) needs {pipe * data * tensor} processes, "
            f"but {world_size} were started; pass data=None to infer it or launch "
            f"torchrun --nproc-per-node={pipe * data * tensor}")
    return pipe, data, tensor


@dataclass(frozen=True)
class Coords:
    """Where one rank sits on the grid."""

    pipe: int
    data: int
    tensor: int


def rank_coords(rank: int, shape: tuple[int, int, int]) -> Coords:
    """The (pipe, data, tensor) coordinates of a global rank on a grid of `shape`; pure arithmetic."""
    pipe_size, data_size, tensor_size = shape
    if not 0 <= rank < pipe_size * data_size * tensor_size:
        raise ValueError(f"rank {rank} is outside the grid of {pipe_size * data_size * tensor_size} ranks")
    return Coords(rank // (tensor_size * data_size), (rank // tensor_size) % data_size, rank % tensor_size)


class Grid:
    """The pipe x data x tensor rank grid of the default process group.

    Tensor varies fastest, then data, then pipe: on a multi-node torchrun launch the tensor and
    data groups stay inside a node and the pipeline crosses nodes (the module docstring says why).
    """

    def __init__(self, pipe: int = 1, data: int | None = None, tensor: int = 1):
        init_distributed()
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.shape = grid_shape(self.world_size, pipe, data, tensor)
        self.pipe_size, self.data_size, self.tensor_size = self.shape
        self.mesh: DeviceMesh = init_device_mesh(process_device().type, self.shape, mesh_dim_names=AXES)
        me = self.coords(self.rank)
        self.pipe_rank, self.data_rank, self.tensor_rank = me.pipe, me.data, me.tensor
        self.pipe_group = self.mesh.get_group("pipe")
        self.data_group = self.mesh.get_group("data")
        self.tensor_group = self.mesh.get_group("tensor")

    # -- coordinates --------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """The (pipe, data, tensor) coordinates of a global rank."""
        return rank_coords(rank, self.shape)

    def rank_of(self, pipe: int | None = None, data: int | None = None, tensor: int | None = None) -> int:
        """The global rank at these coordinates; an omitted axis means this rank's own."""
        pipe = self.pipe_rank if pipe is None else pipe
        data = self.data_rank if data is None else data
        tensor = self.tensor_rank if tensor is None else tensor
        for name, value, size in (("pipe", pipe, self.pipe_size), ("data", data, self.data_size),
                                  ("tensor", tensor, self.tensor_size)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside 0..{size - 1} on {self}")
        return (pipe * self.data_size + data) * self.tensor_size + tensor

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in axis order."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {AXES}")
        size = getattr(self, f"{axis}_size")
        return [self.rank_of(**{axis: i}) for i in range(size)]

    # -- pipeline ends ------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        """Pipe rank 0: it holds the first virtual stage under every placement (it takes the inputs)."""
        return self.pipe_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The last pipe rank. It holds the last virtual stage only when chunks are looped; under
        a V placement that stage is on pipe rank 0 (PipelineModule.is_last(chunk) says per chunk)."""
        return self.pipe_rank == self.pipe_size - 1

    # -- display -------------------------------------------------------------------
    def describe(self) -> str:
        """A short table of who is where, for logs."""
        rows = ["rank  pipe  data  tensor"]
        for r in range(self.world_size):
            c = self.coords(r)
            mark = "  <- me" if r == self.rank else ""
            rows.append(f"{r:>4}  {c.pipe:>4}  {c.data:>4}  {c.tensor:>6}{mark}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"Grid(pipe={self.pipe_size}, data={self.data_size}, tensor={self.tensor_size})"
