"""Tensor parallelism: a layer under torch's ColwiseParallel/RowwiseParallel plan equals the dense layer."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from harness import run
from pipezero.comm import is_replica
from pipezero.pipe.tensor_parallel import apply_tensor_plan, check_tensor_plan, whole_tensor


class MLP(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _parity(degree, compiled=False):
    torch.manual_seed(0)
    dense = MLP()
    sharded = MLP()
    sharded.load_state_dict(dense.state_dict())
    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tensor",))
    apply_tensor_plan(sharded, mesh, PLAN)
    x = torch.randn(4, 3, 8)
    dense(x).pow(2).sum().backward()
    out = (torch.compile(sharded, backend="aot_eager") if compiled else sharded)(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, dense(x))
    for (name, p), q in zip(sharded.named_parameters(), dense.parameters()):
        grad = whole_tensor(p, p.grad)
        torch.testing.assert_close(grad, q.grad, msg=name)
    dup = [n for n, p in sharded.named_parameters() if is_replica(p)]
    return dup


@pytest.mark.parametrize("degree, compiled", [(2, False), (4, False), (2, True)])
def test_tensor_parallel_layer_equals_dense(degree, compiled):
    """compiled: the hooks' all-reduces traced; on torch 2.11 the row-parallel sum of a 3-D input (a view,
    reduced through an autograd.Function) gave every parameter an all-zero gradient there."""
    dups = run(_parity, degree, degree, compiled, discard=compiled)  # a compile leaves fake tensors behind
    # replicated on every tensor rank: the norm, and the row-wise layer's bias (whole on every rank)
    assert dups[0] == [] and all(d == ["norm.weight", "norm.bias", "down.bias"] for d in dups[1:])


def test_bad_plans_are_clear_errors():
    with pytest.raises(ValueError, match=r"up \(Linear\) splits out_features=16 over tensor degree 3"):
        check_tensor_plan(MLP(), PLAN, 3)
    with pytest.raises(ValueError, match="names 'gate'"):
        check_tensor_plan(MLP(), {"gate": ColwiseParallel()}, 2)


def test_column_linears_reading_one_input_share_one_all_reduce():
    """q/k/v reading the same tensor pass one _ToTensorGroup node (one all-reduce of the summed input
    gradient, not three); a new input gets a new node. No process group: degree 1 moves nothing."""
    from pipezero.pipe.tensor_linear import SharedInput, shard_columns

    shared = SharedInput(None, 1)
    q, k, v = (nn.Linear(8, 8) for _ in range(3))
    for m in (q, k, v):
        shard_columns(m, None, 1, 0, shared)

    def nodes(out: torch.Tensor) -> int:
        seen, todo = set(), [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo += [f for f, _ in fn.next_functions]
        return sum(type(fn).__name__ == "_ToTensorGroupBackward" for fn in seen)
    x = torch.randn(2, 8, requires_grad=True)
    assert nodes(q(x) + k(x) + v(x)) == 1
    assert nodes(q(x) + k(x.clone())) == 2
