"""measure_layer_costs: per-layer forward + backward times for partition_method=[costs]."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run
from pipezero.pipe import LayerSpec, PipelineModule, measure_layer_costs
from pipezero.topology import Grid


class Slow(nn.Module):
    """A layer that takes 40 ms whatever the input: the one a partition must isolate."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        time.sleep(0.04)
        return self.lin(x)


def _layers():
    return [LayerSpec(nn.Linear, 8, 8), LayerSpec(Slow, 8), LayerSpec(nn.Linear, 8, 8), torch.relu,
            LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 1)]


def test_costs_follow_time_and_reuse_equal_layers():
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    costs = measure_layer_costs(_layers(), x, loss_fn=F.mse_loss, targets=y, repeats=2)
    assert len(costs) == 6 and all(c > 0 for c in costs)
    assert costs[1] >= 40 and costs[1] == max(costs)
    assert costs[0] == costs[2] == costs[4]  # same class on the same shapes: timed once
    assert costs[5] != costs[0]              # the last layer carries the loss: its own time


def test_bad_arguments():
    with pytest.raises(ValueError, match="repeats=0"):
        measure_layer_costs(_layers(), torch.randn(2, 8), repeats=0)
    with pytest.raises(TypeError, match="not a LayerSpec"):
        measure_layer_costs([3], torch.randn(2, 8))
    with pytest.raises(TypeError, match="sample must be a tensor"):
        measure_layer_costs(_layers(), "text")


def _partition_by_measured_costs():
    """Every rank measures; the max over ranks makes their partitions agree; the slow layer
    gets a stage nearly to itself."""
    x = torch.randn(4, 8)
    costs = measure_layer_costs(_layers(), x, repeats=1)
    model = PipelineModule(_layers(), grid=Grid(pipe=2), loss_fn=F.mse_loss, partition_method=costs)
    return costs, model.bounds


def test_ranks_agree_on_costs_and_partition():
    (c0, b0), (c1, b1) = run(_partition_by_measured_costs, 2)
    assert c0 == c1 and b0 == b1
    assert b0 == [0, 2, 6]  # stage 0: the Linear and the slow layer; stage 1: the rest
