"""Grid: every factorisation of 1, 2, 4, 8 ranks against an independent computation."""

import itertools

import pytest
import torch.distributed as dist

from harness import run
from pipezero.topology import AXES, FLATTENED, Grid, axis_groups, grid_shape, grid_sizes, rank_coords

FOUR = ("pipe", "data", "sequence", "tensor")  # a 4-tuple shape: the grid without an expert axis


def _factorisations(n, axes=3):
    return [f for f in itertools.product(range(1, n + 1), repeat=axes) if _prod(f) == n]


def _prod(sizes):
    out = 1
    for s in sizes:
        out *= s
    return out


def _expected(rank, p, d, s, t):
    # independent: enumerate the grid in (pipe, data, sequence, tensor) order, tensor fastest
    order = list(itertools.product(range(p), range(d), range(s), range(t)))
    return order[rank]


def _check_all(shapes):
    out = []
    for p, d, s, t in shapes:
        grid = Grid(pipe=p, data=d, tensor=t, sequence=s)
        me = _expected(grid.rank, p, d, s, t)
        assert (grid.pipe_rank, grid.data_rank, grid.sequence_rank, grid.tensor_rank) == me
        for r in range(grid.world_size):
            c = grid.coords(r)
            assert (c.pipe, c.data, c.sequence, c.tensor) == _expected(r, p, d, s, t)
            assert grid.rank_of(pipe=c.pipe, data=c.data, sequence=c.sequence, tensor=c.tensor) == r
        for axis, moving in (("pipe", {0}), ("data", {1}), ("sequence", {2}), ("tensor", {3}),
                             ("data_sequence", {1, 2})):
            members = [r for r in range(grid.world_size)
                       if all(_expected(r, p, d, s, t)[j] == me[j] for j in range(4) if j not in moving)]
            assert grid.group_ranks(axis) == members
            group = getattr(grid, f"{axis}_group")
            assert dist.get_process_group_ranks(group) == members
            if axis != "data_sequence":
                assert grid.mesh[axis].size() == len(members)
        assert grid.data_sequence_size == d * s and grid.data_sequence_rank == me[1] * s + me[2]
        assert grid.axes == (("pipe", p), ("data", d), ("sequence", s), ("tensor", t))
        assert grid.is_first_stage == (me[0] == 0)
        assert grid.is_last_stage == (me[0] == p - 1)
        assert Grid(pipe=p, data=None, tensor=t, sequence=s).data_size == d
        out.append(repr(grid))
    return out


def _shown(p, d, s, t):
    return f"Grid(pipe={p}, data={d}, tensor={t})" if s == 1 else f"Grid(pipe={p}, data={d}, sequence={s}, tensor={t})"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_factorisation(world):
    # every (pipe, data, tensor) factorisation, and at 4 and 8 ranks those with a sequence axis of 2
    shapes = [(p, d, 1, t) for p, d, t in _factorisations(world)]
    shapes += [(p, d, 2, t) for p, d, t in _factorisations(world // 2)] if world >= 4 else []
    results = run(_check_all, world, shapes)
    assert results[0] == [_shown(*shape) for shape in shapes]


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
    (dict(pipe=1, data=None, tensor=1, sequence=3), "Grid(pipe=1, data=None, sequence=3, tensor=1) cannot infer"),
    (dict(pipe=1, data=4, tensor=1, sequence=2), "Grid(pipe=1, data=4, sequence=2, tensor=1) needs 8 processes"),
])
def test_bad_sizes_raise_on_every_rank(kwargs, message):
    messages = run(_bad_grid, 4, kwargs, timeout=60)
    assert all(m is not None and message in m for m in messages), messages


def test_grid_shape_is_pure():
    assert grid_shape(8, pipe=2, data=None, tensor=2) == (2, 2, 2)
    assert grid_sizes(16, pipe=2, data=None, sequence=2, tensor=2) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="positive integer"):
        grid_shape(4, pipe=True)


def _describe():
    return Grid(pipe=2, data=None, tensor=1).describe()


def test_describe_marks_this_rank():
    tables = run(_describe, 2)
    assert "0     0     0       0  <- me" in tables[0]
    assert "1     1     0       0  <- me" in tables[1]



def _groups(shape, axis):
    """Every group along `axis`: the ranks that share the other coordinates (independent of axis_groups)."""
    index = (AXES if len(shape) == 5 else FOUR).index(axis)
    groups = {}
    for rank in range(_prod(shape)):
        c = _expected(rank, *shape)
        groups.setdefault(tuple(v for i, v in enumerate(c) if i != index), []).append(rank)
    return sorted(groups.values())


def test_axis_groups_and_the_flattened_group_are_pure_arithmetic():
    for shape in _factorisations(8, axes=4) + _factorisations(12, axes=4):
        for axis in FOUR:
            assert axis_groups(shape, [axis]) == _groups(shape, axis), (shape, axis)
        p, d, s, t = shape
        flat = axis_groups(shape, FLATTENED["data_sequence"])  # data x sequence: same pipe and tensor
        assert len(flat) == p * t and all(len(g) == d * s for g in flat)
        for g in flat:
            coords = [rank_coords(r, shape) for r in g]
            assert len({(c.pipe, c.tensor) for c in coords}) == 1
            assert [(c.data, c.sequence) for c in coords] == list(itertools.product(range(d), range(s)))
    assert axis_groups((1, 2, 2, 1), ["sequence"]) == [[0, 1], [2, 3]]
    assert axis_groups((1, 2, 2, 1), ["data"]) == [[0, 2], [1, 3]]
    assert rank_coords(3, (2, 2, 1)) == rank_coords(3, (2, 2, 1, 1))  # the older three-axis shape
    with pytest.raises(ValueError, match="not among the grid's axes"):
        axis_groups((1, 1, 1, 1), ["experts"])


@pytest.mark.parametrize("shape, per_node, crossing", [
    ((2, 2, 1, 1), 2, {"pipe"}),          # the multi-node test: 2 nodes x 2 processes, pipe 2 x data 2
    ((4, 2, 1, 2), 8, {"pipe"}),          # 2 nodes of 8 GPUs: each node holds two whole stages
    ((2, 8, 1, 2), 8, {"pipe", "data"}),  # a stage's data group spans 2 nodes of its own; tensor stays inside
    ((2, 2, 2, 2), 8, {"pipe"}),          # sequence and tensor inside a node, the stage owns it
    ((1, 2, 4, 2), 8, {"data"}),          # 8 sequence x tensor ranks per node: only data crosses
])
def test_pipe_crosses_nodes_data_and_tensor_stay_inside(shape, per_node, crossing):
    # torchrun gives node n the contiguous global ranks n * per_node .. (n + 1) * per_node - 1
    crossed = {axis for axis in FOUR if any(len({r // per_node for r in g}) > 1 for g in _groups(shape, axis))}
    assert crossed == crossing
    if shape == (2, 2, 1, 1):  # each stage's data group is one node
        assert _groups(shape, "data") == [[0, 1], [2, 3]] and _groups(shape, "pipe") == [[0, 2], [1, 3]]


def _expected5(rank, p, d, e, s, t):
    # independent: the old data index is data * e + expert (e consecutive old data ranks per expert group)
    order = list(itertools.product(range(p), range(d), range(e), range(s), range(t)))
    return order[rank]


def test_expert_axis_is_pure_arithmetic():
    """The expert axis splits the old data axis: E consecutive data ranks share one expert group,
    the same expert index across blocks holds the same experts, dense gradients reduce over all."""
    assert AXES == ("pipe", "data", "expert", "sequence", "tensor")
    assert grid_sizes(16, pipe=2, data=None, tensor=2, expert=2) == (2, 2, 2, 1, 2)
    assert grid_sizes(16, pipe=2, data=None, tensor=2) == (2, 4, 1, 2)  # expert=1: the four axes as before
    with pytest.raises(ValueError, match=r"Grid\(pipe=1, data=None, expert=3, tensor=1\) cannot infer"):
        grid_sizes(4, data=None, expert=3)
    for shape in _factorisations(8, axes=5) + _factorisations(12, axes=5):
        p, d, e, s, t = shape
        for r in range(_prod(shape)):
            c = rank_coords(r, shape)
            assert (c.pipe, c.data, c.expert, c.sequence, c.tensor) == _expected5(r, *shape)
        for axis in AXES:
            want = sorted(_groups5(shape, axis))
            assert axis_groups(shape, [axis]) == want, (shape, axis)
        dense = axis_groups(shape, FLATTENED["data_sequence"])  # same pipe and tensor
        assert len(dense) == p * t and all(len(g) == d * e * s for g in dense)
    # 8 ranks, data 2 x expert 4: the old data ranks 0-3 and 4-7 are the two expert groups
    assert axis_groups((1, 2, 4, 1, 1), ["expert"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axis_groups((1, 2, 4, 1, 1), ["data"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the same experts
    assert axis_groups((1, 2, 4, 1, 1), FLATTENED["data_sequence"]) == [list(range(8))]
    # with pipe 2 and sequence 2 (16 ranks): the expert group steps over the sequence ranks
    assert axis_groups((2, 2, 2, 2, 1), ["expert"])[:2] == [[0, 2], [1, 3]]
    assert axis_groups((2, 2, 2, 2, 1), FLATTENED["data_sequence"]) == [list(range(8)), list(range(8, 16))]
    # the same experts: every data and sequence rank of one expert index (the experts' reduction group)
    assert axis_groups((2, 2, 2, 2, 1), FLATTENED["expert_data"])[:2] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert axis_groups((1, 1, 2, 2, 1), FLATTENED["expert_data"]) == [[0, 1], [2, 3]]
    # beside a tensor split the experts are whole on every tensor rank: expert 2 x tensor 2, the expert group
    # one tensor index, the same experts one expert index (pipe/tensor_tokens.py)
    assert axis_groups((1, 1, 2, 1, 2), ["expert"]) == [[0, 2], [1, 3]]
    assert axis_groups((1, 1, 2, 1, 2), FLATTENED["expert_data"]) == [[0, 1], [2, 3]]
    assert axis_groups((2, 3, 1, 1, 2), ["data"]) == axis_groups((2, 3, 1, 2), ["data"])  # expert 1: as before


def _groups5(shape, axis):
    index = AXES.index(axis)
    groups = {}
    for rank in range(_prod(shape)):
        c = _expected5(rank, *shape)
        groups.setdefault(tuple(v for i, v in enumerate(c) if i != index), []).append(rank)
    return list(groups.values())
