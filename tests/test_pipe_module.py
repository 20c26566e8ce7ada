"""PipelineModule and partitioning: the split, the table, tied weights, local-only building, bad inputs."""

import pytest
import torch
from torch import nn

from harness import run
from pipezero.comm import is_replica
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.partition import partition, partition_balanced, partition_uniform
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec, count_parameters
from pipezero.topology import Grid
from test_pipe_runner import Block, Reference, loss_fn, specs


# -- partitioning, no process group ----------------------------------------------------------
def test_uniform_gives_the_remainder_to_the_first_stages():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


def _max_part(weights, bounds):
    return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("weights, parts", [
    ([5, 1, 1, 1, 1, 1, 5], 3), ([1] * 7, 2), ([0, 3, 3, 3, 3, 0], 2), ([10, 0, 0, 1, 1, 10], 4), ([2, 9, 2], 3)])
def test_balanced_is_optimal_against_brute_force(weights, parts):
    import itertools

    bounds = partition_balanced(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights)
    assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds  # every stage non-empty
    best = min(_max_part(weights, [0, *cut, len(weights)])
               for cut in itertools.combinations(range(1, len(weights)), parts - 1))
    assert _max_part(weights, bounds) == best


def test_parameters_and_type_methods():
    layers = [LayerSpec(nn.Embedding, 100, 8), *[LayerSpec(Block, 8) for _ in range(4)], torch.tanh,
              LayerSpec(nn.Linear, 8, 100)]
    assert count_parameters(layers[0]) == 800 and count_parameters(layers[5]) == 0
    # blocks (72 params each) split 2 + 2; zero-weight tanh joins the part before it
    assert partition(layers, 2, "type:block") == [0, 3, 7]
    assert partition(layers, 3, "parameters") == [0, 1, 6, 7]
    with pytest.raises(ValueError, match=r"matches none of the layer classes \['Block', 'Embedding', 'Linear', "):
        partition(layers, 2, "type:Attention")
    with pytest.raises(ValueError, match="unknown"):
        partition(layers, 2, "weights")


def test_cost_method_balances_stages_then_ranks():
    """Costs like a GPT's: embedding ~0, 24 blocks of 1, norm 0, head + loss 1.6."""
    costs = [0.0] + [1.0] * 24 + [0.0, 1.6]
    layers = list(range(len(costs)))
    # one chunk per rank: the head's stage gets fewer blocks (13 vs 11 + 1.6)
    assert partition(layers, 2, costs) == [0, 14, 27]
    # V placement (rank 0 runs stages 0 and 3): stage min-max alone ties at 7; the ranks then
    # balance to 11 blocks + head on rank 0 (12.6) and 13 on rank 1, not 13.6 vs 12
    bounds = partition(layers, 4, costs, ranks=[0, 1, 1, 0])
    stages = [sum(costs[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    assert max(stages) == 7 and stages[0] + stages[3] == 12.6 and stages[1] + stages[2] == 13
    # rank totals equal up to float rounding (summed in another order) must tie, so the
    # lighter heaviest stage decides: not [0, 2, 4, 6, 11] with 3 blocks + head on stage 3
    small = [0.13] + [1.47] * 8 + [0.06, 0.47]
    assert partition(list(range(11)), 4, small, ranks=[0, 1, 1, 0]) == [0, 3, 5, 7, 11]
    with pytest.raises(ValueError, match="3 costs for 27 layers"):
        partition(layers, 2, [1, 1, 1])
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        partition(layers, 2, [-1.0] + costs[1:])


def test_specs_check_their_arguments():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(torch.tanh)
    with pytest.raises(ValueError, match="identifier"):
        TiedLayerSpec("my key", nn.Linear, 2, 2)
    spec = TiedLayerSpec("emb", nn.Embedding, 4, 2, tied_weight_attr="bias")
    with pytest.raises(ValueError, match="no parameter 'bias'"):
        spec.tied_parameters(spec.build())


# -- on process groups -------------------------------------------------------------------------
class RankFilled(nn.Embedding):
    """Starts different on every rank, so only the broadcast can make the owners agree."""

    def __init__(self, *args):
        super().__init__(*args)
        nn.init.constant_(self.weight, float(torch.distributed.get_rank() + 1))


def _build(pipe, chunks, placement):
    grid = Grid(pipe=pipe)
    layers = [TiedLayerSpec("emb", RankFilled, 16, 8, forward_fn=lambda m, ids: (m(ids), ids)),
              *[LayerSpec(Block, 8) for _ in range(6)], lambda x: x,
              TiedLayerSpec("emb", RankFilled, 16, 8, forward_fn=lambda m, x: x[0] @ m.weight.t())]
    model = PipelineModule(layers, grid=grid, loss_fn=loss_fn, num_chunks=chunks, placement=placement,
                           partition_method="uniform")
    tied = model.tied["emb"].weight if "emb" in model.tied else None
    return dict(names=sorted(n for n, _ in model.named_parameters()),
                tied=None if tied is None else tied.detach().clone(),
                duplicate=is_replica(tied),
                table=model.describe())


@pytest.mark.parametrize("pipe, chunks, placement", [(2, 1, "looped"), (4, 2, "looped"), (2, 2, "v")])
def test_local_layers_only_and_tied_weights_agree(pipe, chunks, placement):
    out = run(_build, pipe, pipe, chunks, placement)
    every = [set(o["names"]) - {"tied.emb.weight"} for o in out]
    assert sum(len(s) for s in every) == len(set().union(*every)) == 12  # 6 blocks x 2, each built once
    owners = [r for r, o in enumerate(out) if o["tied"] is not None]
    for r in owners:  # all owners hold rank 0's values (rank 0 owns the first virtual stage)
        assert torch.equal(out[r]["tied"], torch.full((16, 8), 1.0))
        assert out[r]["duplicate"] == (r != 0)
    assert owners == ([0] if placement == "v" else [0, pipe - 1])
    table = out[0]["table"]
    assert "<- me" in table and f"over {pipe} ranks" in table and "RankFilled, Block" in table
    assert len(table.splitlines()) == pipe * chunks + 2


def test_names_match_the_single_process_model():
    out = run(_build_reference_names, 2)
    assert sorted(set(out[0]) | set(out[1])) == sorted(n for n, _ in Reference(3).named_parameters())


def _build_reference_names():
    model = PipelineModule(specs(3), grid=Grid(pipe=2), loss_fn=loss_fn)
    return [n for n, _ in model.named_parameters()]


def _bad_module(kwargs):
    try:
        PipelineModule(grid=Grid(pipe=2), loss_fn=loss_fn, **kwargs)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=specs(0)), "2 layers cannot fill 4 virtual stages"),   # more stages than layers
    (dict(layers=specs(2), partition_method="type:Attention"), "matches none of the layer classes"),
    (dict(layers=specs(4), num_chunks=3, placement="v"), "num_chunks must be even"),
    (dict(layers=specs(4), num_chunks=0), "num_chunks=0"),
    (dict(layers=[*specs(2), 3]), "layers[4]=3 is neither"),
])
def test_bad_model_raises_on_every_rank(kwargs, message):
    if "num_chunks" not in kwargs:
        kwargs = dict(kwargs, num_chunks=2)
    messages = run(_bad_module, 2, kwargs)
    assert all(m is not None and message in m for m in messages), messages
