"""Grid: every factorisation of 1, 2, 4, 8 ranks against an independent computation."""

import itertools

import pytest
import torch.distributed as dist

from harness import run
from pipezero.topology import AXES, Grid, grid_shape, rank_coords


def _factorisations(n):
    return [(p, d, t) for p, d, t in itertools.product(range(1, n + 1), repeat=3) if p * d * t == n]


def _expected(rank, p, d, t):
    # independent: enumerate the grid in (pipe, data, tensor) order, tensor fastest
    order = list(itertools.product(range(p), range(d), range(t)))
    return order[rank]


def _check_all(shapes):
    out = []
    for p, d, t in shapes:
        grid = Grid(pipe=p, data=d, tensor=t)
        me = _expected(grid.rank, p, d, t)
        assert (grid.pipe_rank, grid.data_rank, grid.tensor_rank) == me
        for r in range(grid.world_size):
            c = grid.coords(r)
            assert (c.pipe, c.data, c.tensor) == _expected(r, p, d, t)
            assert grid.rank_of(pipe=c.pipe, data=c.data, tensor=c.tensor) == r
        for axis, i in (("pipe", 0), ("data", 1), ("tensor", 2)):
            members = [r for r in range(grid.world_size)
                       if all(_expected(r, p, d, t)[j] == me[j] for j in range(3) if j != i)]
            assert grid.group_ranks(axis) == members
            group = getattr(grid, f"{axis}_group")
            assert dist.get_process_group_ranks(group) == members
            assert grid.mesh[axis].size() == len(members)
        assert grid.is_first_stage == (me[0] == 0)
        assert grid.is_last_stage == (me[0] == p - 1)
        assert Grid(pipe=p, data=None, tensor=t).data_size == d
        out.append(repr(grid))
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_factorisation(world):
    shapes = _factorisations(world)
    results = run(_check_all, world, shapes)
    assert results[0] == [f"Grid(pipe={p}, data={d}, tensor={t})" for p, d, t in shapes]


def _bad_grid(kwargs):
    try:
        Grid(**kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipe=2, data=3, tensor=1), "Grid(pipe=2, data=3, tensor=1) needs 6 processes, but 4 were started"),
    (dict(pipe=3, data=None, tensor=1), "cannot infer the data degree"),
    (dict(pipe=0, data=None, tensor=1), "Grid(pipe=0)"),
    (dict(pipe=1, data=None, tensor=-2), "Grid(tensor=-2)"),
])
def test_bad_sizes_raise_on_every_rank(kwargs, message):
    messages = run(_bad_grid, 4, kwargs, timeout=60)
    assert all(m is not None and message in m for m in messages), messages


def test_grid_shape_is_pure():
    assert grid_shape(8, pipe=2, data=None, tensor=2) == (2, 2, 2)
    with pytest.raises(ValueError, match="positive integer"):
        grid_shape(4, pipe=True)


def _describe():
    return Grid(pipe=2, data=None, tensor=1).describe()


def test_describe_marks_this_rank():
    tables = run(_describe, 2)
    assert "0     0     0       0  <- me" in tables[0]
    assert "1     1     0       0  <- me" in tables[1]



def _groups(shape, axis):
    """Every group along `axis`: the ranks that share the other two coordinates."""
    index = AXES.index(axis)
    groups = {}
    for rank in range(shape[0] * shape[1] * shape[2]):
        c = rank_coords(rank, shape)
        key = tuple(v for i, v in enumerate((c.pipe, c.data, c.tensor)) if i != index)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


@pytest.mark.parametrize("shape, per_node, crossing", [
    ((2, 2, 1), 2, {"pipe"}),          # the multi-node test: 2 nodes x 2 processes, pipe 2 x data 2
    ((4, 2, 2), 8, {"pipe"}),          # 2 nodes of 8 GPUs: each node holds two whole stages
    ((2, 8, 2), 8, {"pipe", "data"}),  # a stage's data group spans 2 nodes of its own; tensor stays inside
])
def test_pipe_crosses_nodes_data_and_tensor_stay_inside(shape, per_node, crossing):
    # torchrun gives node n the contiguous global ranks n * per_node .. (n + 1) * per_node - 1
    crossed = {axis for axis in AXES if any(len({r // per_node for r in g}) > 1 for g in _groups(shape, axis))}
    assert crossed == crossing
    if shape == (2, 2, 1):  # each stage's data group is one node
        assert _groups(shape, "data") == [[0, 1], [2, 3]] and _groups(shape, "pipe") == [[0, 2], [1, 3]]
