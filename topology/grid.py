"""Grid: the rank grid (pipe x data x expert x sequence x tensor) as an explicit, validated object.

The grid's axes are one ordered list, `AXES`, slowest first: pipe, data, expert, sequence, tensor.
A rank's coordinates are its digits in that mixed radix (tensor fastest, as in Megatron-LM
and DeepSpeed): rank = (((pipe * data_deg + data) * expert_deg + expert) * sequence_deg + sequence)
* tensor_deg + tensor. The grid is a torch DeviceMesh with those dims; `grid.mesh` is that mesh,
so DTensor and FSDP work on its sub-meshes. FLATTENED names the groups that join several axes:
"data_sequence", the ranks that reduce dense gradients together (data x expert x sequence), and
"expert_data", the ranks that hold the same experts (data x sequence x tensor), and "stage", every rank of
one pipe stage (data x expert x sequence x tensor: what a MoE block beside a tensor split reduces its router
and shared experts over, pipe/tensor_tokens.py).

Experts (pipe/expert/): `expert=E` splits what a grid without it calls the data axis into
data x expert, E consecutive data ranks forming one expert group (`expert_group`, the ranks
that split the experts between them, all of one tensor index); the ranks holding the same experts
are data x sequence x tensor (`expert_data_group`, same expert index in every block; the data axis
alone without a sequence or tensor split): a tensor split leaves the experts whole and gives each
tensor rank its share of the tokens (pipe/tensor_tokens.py). Every rank of data x expert still reads
its own rows (its sequence ranks one slice of each), and the dense parameters reduce over all of
them. With expert=1 every name and rank is what it was, and `expert_data_group` is data x sequence x
tensor (every rank holds every expert; without a tensor axis, `data_sequence_group` itself).

Across nodes: torchrun gives each node's agent one contiguous block of global ranks
(node n holds ranks n * nproc_per_node ... (n + 1) * nproc_per_node - 1), so the axes that
vary fastest stay inside a node. Tensor groups exchange activations in every layer, and
sequence groups exchange queries, keys, values and outputs all-to-all in every attention, so
both get the fast links inside a node (NVLink), tensor innermost; data groups all-reduce or
reduce-scatter every gradient once a step; the pipe axis sends one activation per micro-batch
between neighbouring stages and is the one that crosses the slower network. With 2 nodes x 2
processes, pipe 2 x data 2 puts stage 0 (data ranks 0, 1) on one node and stage 1 on the
other. When tensor x sequence x data is a multiple of the processes per node, each stage owns
whole nodes and only its data group spans several of them.

Gradients are reduced, and ZeRO partitions, over data x expert x sequence (`data_sequence_group`,
as DeepSpeed reduces dense gradients over its data-parallel x sequence-parallel group, expert
ranks included): the sequence ranks of one data replica hold gradients of different parts of the
same batch (pipe/sequence/), the expert ranks of different rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipezero.topology.device import process_device
from pipezero.topology.env import init_distributed

__all__ = ["AXES", "FLATTENED", "Coords", "Grid", "axis_groups", "grid_shape", "grid_sizes", "rank_coords"]

AXES = ("pipe", "data", "expert", "sequence", "tensor")  # slowest first; a rank's digits in this order
# name -> the axes it joins: "data_sequence" the dense gradient reduction and ZeRO (expert ranks included,
# its name kept from before the expert axis), "data_expert" the rows' data replicas without sequence,
# "expert_data" the ranks holding the same experts (the experts' reduction and ZeRO group; the tensor ranks
# route their own shares of the tokens to them: pipe/tensor_tokens.py), "stage" every rank of one pipe stage (a
# token-split MoE block's dense parameters beside an expert axis: averaged over data x expert x sequence, summed
# over the tensor ranks' shares)
FLATTENED = {"data_sequence": ("data", "expert", "sequence"), "data_expert": ("data", "expert"),
             "expert_data": ("data", "sequence", "tensor"), "stage": ("data", "expert", "sequence", "tensor")}


def _call(sizes: dict[str, int | None]) -> str:
    """How the user wrote the grid: Grid(pipe=2, data=3, tensor=1), sequence and expert shown only when set."""
    shown = [f"{name}={sizes[name]!r}" for name in ("pipe", "data", "expert", "sequence", "tensor")
             if name not in ("sequence", "expert") or sizes.get(name, 1) != 1]
    return f"Grid({', '.join(shown)})"


def grid_sizes(world_size: int, pipe: int = 1, data: int | None = None, sequence: int = 1,
               tensor: int = 1, expert: int = 1) -> tuple[int, ...]:
    """The degrees, checked against the world size, `data` inferred when None: (pipe, data, sequence,
    tensor) when expert is 1 (as before the expert axis), else all five in AXES order.

    Pure arithmetic, so every rank raises the same ValueError before any collective.
    """
    for name, value in (("pipe", pipe), ("expert", expert), ("sequence", sequence), ("tensor", tensor),
                        ("data", data)):
        if value is None and name == "data":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Grid({name}={value!r}): every degree must be a positive integer")
    others = pipe * expert * sequence * tensor
    given = dict(pipe=pipe, expert=expert, sequence=sequence, tensor=tensor)
    if data is None:
        if world_size % others:
            named = " * ".join(n for n in given if n not in ("sequence", "expert") or given[n] != 1)
            raise ValueError(
                f"{_call(dict(given, data=None))} cannot infer the data "
                f"degree: {world_size} processes do not divide by {named}={others}; "
                f"start a multiple of {others} processes or change {named.replace(' * ', '/')}")
        data = world_size // others
    if data * others != world_size:
        raise ValueError(
            f"{_call(dict(given, data=data))} needs {data * others} processes, "
            f"but {world_size} were started; pass data=None to infer it or launch "
            f"torchrun --nproc-per-node={data * others}")
    if expert == 1:
        return pipe, data, sequence, tensor
    return pipe, data, expert, sequence, tensor


def grid_shape(world_size: int, pipe: int = 1, data: int | None = None, tensor: int = 1) -> tuple[int, int, int]:
    """(pipe, data, tensor) of a grid without a sequence axis: grid_sizes' older three-axis form."""
    pipe, data, _, tensor = grid_sizes(world_size, pipe, data, 1, tensor)
    return pipe, data, tensor


@dataclass(frozen=True)
class Coords:
    """Where one rank sits on the grid (sequence and expert last: Coords(pipe, data, tensor) is a grid
    without them)."""

    pipe: int
    data: int
    tensor: int
    sequence: int = 0
    expert: int = 0


def _sizes(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape in AXES order; a 3-tuple is the older (pipe, data, tensor) of a grid without a sequence
    axis, a 4-tuple (pipe, data, sequence, tensor) one without an expert axis."""
    if len(shape) == 3:
        return shape[0], shape[1], 1, 1, shape[2]
    if len(shape) == 4:
        return shape[0], shape[1], 1, shape[2], shape[3]
    if len(shape) != len(AXES):
        raise ValueError(f"grid shape {tuple(shape)}: expected one size per axis of {AXES}")
    return tuple(shape)


def rank_coords(rank: int, shape: Sequence[int]) -> Coords:
    """The coordinates of a global rank on a grid of `shape` (sizes in AXES order); pure arithmetic."""
    sizes = _sizes(shape)
    world = _product(sizes)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the grid of {world} ranks")
    digits = {}
    for name, size in reversed(list(zip(AXES, sizes))):  # tensor first: the fastest digit
        rank, digits[name] = divmod(rank, size)
    return Coords(**digits)


def _flat_rank(coords: dict[str, int], sizes: Sequence[int]) -> int:
    rank = 0
    for name, size in zip(AXES, sizes):
        rank = rank * size + coords[name]
    return rank


def axis_groups(shape: Sequence[int], axes: Sequence[str]) -> list[list[int]]:
    """Every group of ranks along `axes` (the ranks that share all other coordinates), each in
    rank order, the groups in rank order of their first member; pure arithmetic.

    axis_groups((2, 1, 1, 2), ["pipe"]) == [[0, 2], [1, 3]]. Several axes give their flattened
    groups: axis_groups(shape, FLATTENED["data_sequence"]).
    """
    sizes = _sizes(shape)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"axes {unknown} are not among the grid's axes {AXES}")
    fixed = [(n, s) for n, s in zip(AXES, sizes) if n not in axes]
    moving = [(n, s) for n, s in zip(AXES, sizes) if n in axes]
    groups = []
    for outer in itertools.product(*(range(s) for _, s in fixed)):
        base = dict(zip((n for n, _ in fixed), outer))
        groups.append(sorted(_flat_rank({**base, **dict(zip((n for n, _ in moving), inner))}, sizes)
                             for inner in itertools.product(*(range(s) for _, s in moving))))
    return sorted(groups)


def _product(sizes: Sequence[int]) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


class Grid:
    """The pipe x data x expert x sequence x tensor rank grid of the default process group.

    Tensor varies fastest, then sequence, then expert, then data, then pipe: on a multi-node
    torchrun launch the tensor and sequence groups stay inside a node and the pipeline crosses
    nodes (the module docstring says why). `axes` is the ordered list of (name, size), expert
    only when above 1; each axis has its `<axis>_size`, `<axis>_rank` and `<axis>_group`;
    `data_sequence_group` is the flattened group that reduces dense gradients (data x expert x
    sequence; data_group stays the data axis alone); `expert_data_group` holds the ranks with the
    same experts (data x sequence x tensor); `stage_group` every rank of this pipe stage (data x expert x
    sequence x tensor). `data_expert_rank` of `data_expert_size` says whose rows a rank reads.
    """

    def __init__(self, pipe: int = 1, data: int | None = None, tensor: int = 1, sequence: int = 1,
                 expert: int = 1):
        init_distributed()
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.shape = _sizes(grid_sizes(self.world_size, pipe, data, sequence, tensor, expert))
        self.axes: tuple[tuple[str, int], ...] = tuple((n, s) for n, s in zip(AXES, self.shape)
                                                       if n != "expert" or s > 1)
        self.pipe_size, self.data_size, self.expert_size, self.sequence_size, self.tensor_size = self.shape
        self.mesh: DeviceMesh = init_device_mesh(process_device().type, self.shape, mesh_dim_names=AXES)
        me = self.coords(self.rank)
        self.pipe_rank, self.data_rank, self.expert_rank = me.pipe, me.data, me.expert
        self.sequence_rank, self.tensor_rank = me.sequence, me.tensor
        self.pipe_group = self.mesh.get_group("pipe")
        self.data_group = self.mesh.get_group("data")
        self.expert_group = self.mesh.get_group("expert")
        self.sequence_group = self.mesh.get_group("sequence")
        self.tensor_group = self.mesh.get_group("tensor")
        self._made: dict[tuple[str, ...], Any] = {}  # the axes above 1 -> their group (_flattened_group)
        self.data_sequence_group = self._flattened_group("data_sequence")
        self.expert_data_group = self._flattened_group("expert_data")  # without an expert or tensor axis: the same
        self.stage_group = self._flattened_group("stage")
        self.data_expert_size = self.data_size * self.expert_size
        self.data_expert_rank = self.data_rank * self.expert_size + self.expert_rank
        self.data_sequence_size = self.data_expert_size * self.sequence_size
        self.data_sequence_rank = self.data_expert_rank * self.sequence_size + self.sequence_rank

    def _flattened_group(self, name: str) -> Any:
        """The process group of this rank along FLATTENED[name]: an axis's own when the others are 1, one made
        already over the same axes above 1 (expert_data is data_sequence without an expert or tensor axis),
        else new groups over axis_groups (dist.new_group is collective: every rank makes all, in order)."""
        used = tuple(axis for axis in FLATTENED[name] if getattr(self, f"{axis}_size") > 1)
        if len(used) < 2:
            return self.mesh.get_group(used[0] if used else FLATTENED[name][0])
        if used not in self._made:
            for ranks in self.axis_groups(name):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._made[used] = group
        return self._made[used]

    # -- coordinates --------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """The coordinates of a global rank."""
        return rank_coords(rank, self.shape)

    def rank_of(self, pipe: int | None = None, data: int | None = None, tensor: int | None = None,
                sequence: int | None = None, expert: int | None = None) -> int:
        """The global rank at these coordinates; an omitted axis means this rank's own."""
        given = dict(pipe=pipe, data=data, expert=expert, sequence=sequence, tensor=tensor)
        coords = {name: getattr(self, f"{name}_rank") if given[name] is None else given[name] for name in AXES}
        for name, size in zip(AXES, self.shape):
            if not 0 <= coords[name] < size:
                raise ValueError(f"{name}={coords[name]} is outside 0..{size - 1} on {self}")
        return _flat_rank(coords, self.shape)

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis` (or a FLATTENED name), in rank order."""
        axes = FLATTENED.get(axis, (axis,))
        if axes[0] not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {AXES} or {tuple(FLATTENED)}")
        return next(g for g in axis_groups(self.shape, axes) if self.rank in g)

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (or a FLATTENED name), the same list on every rank: what a
        collective dist.new_group per group loops over."""
        return axis_groups(self.shape, FLATTENED.get(axis, (axis,)))

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
    def _shown(self) -> list[str]:
        return [name for name, size in self.axes if name not in ("sequence", "expert") or size > 1]

    def describe(self) -> str:
        """A short table of who is where, for logs (the sequence column when that axis is used)."""
        names = self._shown()
        rows = ["rank  " + "  ".join(names)]
        for r in range(self.world_size):
            c = self.coords(r)
            mark = "  <- me" if r == self.rank else ""
            rows.append(f"{r:>4}  " + "  ".join(f"{getattr(c, n):>{len(n)}}" for n in names) + mark)
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"Grid({', '.join(f'{name}={size}' for name, size in self.axes if name in self._shown())})"
